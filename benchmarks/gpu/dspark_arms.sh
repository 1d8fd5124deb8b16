#!/usr/bin/env bash
# Several DSpark training arms side by side on one GPU: the same staged data, the same start
# (INIT), the same schedule, one setting changed per arm, so their held-out acceptance can be
# compared without a second session's noise. Each arm is an h200_session.sh run of its own
# (ROOT=/root/arm_<name>); settings shared by all arms (INIT, LR, MICRO, SEED, MAX_NEW, ...)
# come from the environment, each arm's own from ARMS: arms separated by ';', each a name then
# VAR=value words, e.g.
#   ARMS='ctl;taps TAPS=1,8,14,20,24,27,28;ce CE=0.5 L1=0.5'
#   dspark_arms.sh gen                   # seed every arm's run directory from the staged
#                                        # files/examples.jsonl.gz + prompts.jsonl.gz (required:
#                                        # this generates nothing)
#   dspark_arms.sh train STEPS BUDGET_S  # all arms at once, resumable; then every arm's exported
#                                        # drafter, log and run config in $OUT/arms.tar.part_*
#                                        # (cat them | tar x: arms/<name>/...; an arm the budget
#                                        # stopped early: arms/<name>/drafter-partial/, its newest
#                                        # checkpoint exported, with its step in STEP)
# A call returns at most 8 files of at most ~16 MiB: the arms travel as one tar in 15 MiB parts,
# enough for about six arms with their 19 MB drafters; more parts than 8 is an error.
# Memory: arms share the card, and two did not fit an H100: in the forty-seventh session two
# 7-layer arms at MICRO=8 both ran out of its 80 GB at step 2, while one arm alone at MICRO=4
# trained at 0.48 s per step (78.8 GB held).
# On an H100 run one arm per call (ARMS='name ...'); the H200's 141 GB is untried with two.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
usage() { echo "usage: ARMS='name VAR=value ...; ...' $0 gen | train STEPS BUDGET_S" >&2; exit 2; }
phase=${1:-}
case "$phase" in
  gen) ;;
  train) [ $# -eq 3 ] || usage ;;
  *) usage ;;
esac
if [ "$phase" = gen ] && [ ! -f /root/s/files/examples.jsonl.gz ]; then
  echo "no staged data (/root/s/files/examples.jsonl.gz): dspark_arms.sh trains on staged data only" >&2; exit 1
fi
IFS=';' read -ra specs <<< "${ARMS:?ARMS: name VAR=value ...; ...}"
names=(); settings=()
for spec in "${specs[@]}"; do
  read -ra words <<< "$spec"
  [ ${#words[@]} -gt 0 ] || continue  # (an empty arm: a trailing ';')
  names+=("${words[0]}"); settings+=("${words[*]:1}")
done
[ ${#names[@]} -gt 0 ] || usage
pids=()
for i in "${!names[@]}"; do
  name=${names[$i]}; read -ra env_words <<< "${settings[$i]}"
  mkdir -p "/root/arms/$name"
  if [ "$phase" = gen ]; then
    log=/root/arms/$name/gen.log
    env ${env_words[@]+"${env_words[@]}"} ROOT="/root/arm_$name" OUT="/root/arms/$name" \
      bash "$here/h200_session.sh" gen 60 > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
    grep -q "seeded .* from staged data" "$log" || { echo "$name: not seeded from the staged data"; tail -20 "$log"; exit 1; }
    rm -f "/root/arms/$name"/*.jsonl.gz  # (the staged data again)
    echo "$name: $(tail -1 "$log")"
  else
    env ${env_words[@]+"${env_words[@]}"} ROOT="/root/arm_$name" OUT="/root/arms/$name" \
      bash "$here/h200_session.sh" train "$2" "$3" > "/root/arms/$name/train.log" 2>&1 &
    pids+=($!)
  fi
done
[ "$phase" = train ] || exit 0
for p in "${pids[@]}"; do wait "$p" || true; done
for name in "${names[@]}"; do
  log=/root/arm_$name/dspark-run/train_log.jsonl
  rows=0; [ -f "$log" ] && rows=$(grep -c '"step"' "$log" || true)
  echo "$name: $rows log rows; last: $([ -f "$log" ] && tail -1 "$log" | cut -c1-160)"
  grep -iE "error|Traceback|out of memory" "/root/arms/$name/train.log" | tail -3 || true
  # An arm the budget stopped before STEPS has no export: export its newest checkpoint the way
  # the trainer exports (the run's export grid, float16) into drafter-partial/, named by its step
  # (its learning rate had not decayed to 0: compare such arms at equal steps only).
  rm -rf "/root/arms/$name/drafter-partial"  # (an earlier call's, superseded by this one's)
  if [ ! -d "/root/arms/$name/drafter" ] || [ -z "$(ls -A "/root/arms/$name/drafter")" ]; then
    # (the staged wheels and this checkout: h200_session.sh sets the same path for its children)
    PYTHONPATH="/tmp/site:$repo" python3 - "/root/arm_$name/dspark-run" "/root/arms/$name/drafter-partial" <<'EOF' \
      || echo "$name: no partial export" >&2
import json
import sys
from drafters.dspark.loader import load_dspark, save_dspark
from drafters.dspark.train import latest_checkpoint
ckpt = latest_checkpoint(sys.argv[1])
if ckpt is None:
    sys.exit(f"{sys.argv[1]}: no checkpoint to export")
train = json.loads((ckpt / "trainer_state.json").read_text())["train"]  # (the grid the run trains for)
save_dspark(load_dspark(ckpt, dtype=None), sys.argv[2], bits=train.get("qat_bits", 4),
            group_size=train.get("qat_group_size", 64), dtype="float16")
open(f"{sys.argv[2]}/STEP", "w").write(ckpt.name + "\n")
print(f"exported {ckpt} -> {sys.argv[2]}")
EOF
  fi
done
rm -f "$out"/arms.tar.part_*
(cd /root && tar cf - arms) | split -b 15M - "$out/arms.tar.part_"
parts=$(ls "$out"/arms.tar.part_* | wc -l)
ls -la "$out"
if [ "$parts" -gt 8 ]; then echo "$parts tar parts: a call returns 8 files; fewer arms per run" >&2; exit 1; fi
