#!/usr/bin/env bash
# Fewer staging calls for the lent GPU (forty-third session: four calls instead of six, two
# for runs that need no model). A call carries the checkout plus one part, 64 MiB in all; the
# checkout is ~28 MB with the shipped drafter (18.4 MB) and ~8.4 MB without it, so the drafter
# travels as a staged file instead and the parts grow to 55 MB.
#
# Usage, from the repository root, after ../shared/tools/stage-for-gpu.sh --pip mlx-lm==0.32.2
# <the GGUF> <the llguidance wheel> wrote .dev/p1..pN (any PART_MB):
#   bash benchmarks/gpu/stage_parts.sh
# writes
#   .dev/q1..q2  wheels/ + files/llguidance*.whl (47.5 MB parts): runs without a model
#                (kernels_h200.sh stack, verify --parts matrices,llama8b)
#   .dev/r1..r4  wheels/ + files/ + files2/model.safetensors (55 MB parts): everything
# Then, for K = 1..N: move the drafter out of the checkout first (mv models/dspark-*/model.safetensors
# somewhere outside it) and carry [".dev/rK"] with `mkdir -p /root/s && cp .dev/rK/* /root/s/`;
# kernels_h200.sh / h200_session.sh unpack /root/s as before; start every later command with
# `cp /root/s/files2/model.safetensors models/dspark-smollm2-135m-instruct/`. Move the drafter
# back here afterwards (and check `git status` before committing).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
ls .dev/p*/part_* > /dev/null
drafter=models/dspark-smollm2-135m-instruct/model.safetensors
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && cat "$root"/.dev/p*/part_* | tar xf -)
mkdir -p "$tmp/files2" && cp "$drafter" "$tmp/files2/"
rm -rf .dev/q* .dev/r*
(cd "$tmp" && tar cf - wheels files/*.whl | split -b 47500000 - q_)
(cd "$tmp" && tar cf - wheels files files2 | split -b 55000000 - r_)
for kind in q r; do
  i=0
  for p in "$tmp"/${kind}_*; do
    i=$((i + 1)); mkdir -p ".dev/$kind$i"; mv "$p" ".dev/$kind$i/part_${p##*_}"
  done
  echo "$kind: $i parts"
done
du -sh .dev/q* .dev/r* | sed 's/^/  /'
