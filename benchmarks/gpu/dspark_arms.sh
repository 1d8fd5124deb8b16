#!/usr/bin/env bash
# Several DSpark training arms side by side on one GPU: the same staged data, the same start
# (INIT), the same schedule, one setting changed per arm, so their held-out acceptance can be
# compared without a second session's noise. Each arm is an h200_session.sh run of its own
# (ROOT=/root/arm_<name>); settings shared by all arms (INIT, LR, MICRO, SEED, MAX_NEW, ...)
# come from the environment, each arm's own from ARMS: arms separated by ';', each a name then
# VAR=value words, e.g.
#   ARMS='ctl;taps TAPS=1,8,14,20,24,27,28;ce CE=0.5 L1=0.5'
#   dspark_arms.sh gen                   # seed every arm's run directory from the staged
#                                        # files/examples.jsonl.gz + prompts.jsonl.gz (no generation)
#   dspark_arms.sh train STEPS BUDGET_S  # all arms at once, resumable; then every arm's exported
#                                        # drafter, log and run config in $OUT/arms.tar.part_*
#                                        # (cat them | tar x: arms/<name>/...)
# A call returns at most 8 files of at most ~16 MiB: the arms travel as one split tar.
# Memory: arms share the card; MICRO=8 keeps a 7-layer arm's 64 x 1,024-token step small.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
IFS=';' read -ra arms <<< "${ARMS:?ARMS: name VAR=value ...; ...}"
pids=()
for arm in "${arms[@]}"; do
  read -ra words <<< "$arm"
  name=${words[0]}
  mkdir -p "/root/arms/$name"
  case "$1" in
    gen) env "${words[@]:1}" ROOT="/root/arm_$name" OUT="/root/arms/$name" \
           bash "$here/h200_session.sh" gen 60 > "/root/arms/$name.gen.log" 2>&1
         rm -f "/root/arms/$name"/*.jsonl.gz  # (the staged data again)
         tail -2 "/root/arms/$name.gen.log" ;;
    train) env "${words[@]:1}" ROOT="/root/arm_$name" OUT="/root/arms/$name" \
             bash "$here/h200_session.sh" train "$2" "$3" > "/root/arms/$name.train.log" 2>&1 &
           pids+=($!) ;;
    *) echo "usage: $0 gen|train STEPS BUDGET_S" >&2; exit 2 ;;
  esac
done
[ "$1" = train ] || exit 0
for p in "${pids[@]}"; do wait "$p" || true; done
for arm in "${arms[@]}"; do
  read -ra words <<< "$arm"
  name=${words[0]}
  echo "$name: $(grep -c '"step"' "/root/arm_$name/dspark-run/train_log.jsonl" 2>/dev/null || echo 0) log rows," \
       "last $(tail -1 "/root/arm_$name/dspark-run/train_log.jsonl" 2>/dev/null | cut -c1-160)"
  grep -iE "error|Traceback|out of memory" "/root/arms/$name.train.log" | tail -3 || true
  cp "/root/arms/$name.train.log" "/root/arms/$name/" 2>/dev/null || true
done
(cd /root && tar cf - arms) | split -b 15M - "$out/arms.tar.part_"
ls -la "$out"
