#!/bin/sh
# Give MLX's Linux CPU backend an optimised BLAS (engine/blas.py preloads it at start-up).
# 1. Debian/Ubuntu/Fedora OpenBLAS through the system package manager when we may install;
# 2. otherwise the cmeel-openblas wheel into the venv (it needs libgfortran.so.5).
# Never fails the setup: without OpenBLAS the server runs on MLX's reference BLAS, slower,
# and says so in its log.
PY=${1:-python3}
have_system() {
  for f in /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 /usr/lib*/libopenblas.so.0; do
    [ -e "$f" ] && return 0
  done
  return 1
}
if have_system; then echo "OpenBLAS: system library found"; exit 0; fi
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"
if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "OpenBLAS: installing libopenblas0-pthread with apt-get"
    $SUDO apt-get install -y -qq --no-install-recommends libopenblas0-pthread >/dev/null 2>&1 || \
      { $SUDO apt-get update -qq >/dev/null 2>&1 && \
        $SUDO apt-get install -y -qq --no-install-recommends libopenblas0-pthread >/dev/null 2>&1; }
  elif command -v dnf >/dev/null 2>&1; then
    $SUDO dnf install -y -q openblas >/dev/null 2>&1
  fi
fi
if have_system; then echo "OpenBLAS: system library installed"; exit 0; fi
echo "OpenBLAS: no system package; trying the cmeel-openblas wheel (needs libgfortran.so.5)"
"$PY" -m pip install -q 'cmeel-openblas>=0.3.26' || true
if ! ldconfig -p 2>/dev/null | grep -q 'libgfortran.so.5'; then
  echo "WARNING: libgfortran.so.5 is missing, so cmeel-openblas cannot load. MLX will use its slow"
  echo "         reference BLAS. Install OpenBLAS (e.g. 'sudo apt-get install libopenblas0-pthread')."
fi
exit 0
