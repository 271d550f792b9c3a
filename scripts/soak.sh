#!/usr/bin/env bash
# Kill-and-resume soak: `moe train` on an emulated cluster of 2 hosts x 1 rank (docs/cluster.md; root),
# a checkpoint every EVERY steps, one host SIGKILLed (`moe cluster kill`, the hosts in turn) at a random
# moment of each attempt, and the job resumed from its last checkpoint until it reaches STEPS. At the
# end its final checkpoint's weights and optimizer state must equal, byte for byte, those of an
# uninterrupted run of the same command on the same cluster. Prints one report line per fault and a
# summary: faults injected, resumes, steps lost (trained again after a kill), time lost (the faulted
# run's wall time over the reference's; steps read off the progress lines, every 10 steps). Exit 0 only
# when both runs finished and the files are equal; 77 (skipped) without root or network namespaces.
#
# Usage: scripts/soak.sh [STEPS [EVERY [MAX_SECONDS_TO_A_KILL]]]   (defaults 2000, 50, 6; seeded: SEED)
# MOE: the moe binary (default build/release/moe). The cluster is named moesoak and always taken down.
set -euo pipefail
steps="${1:-2000}"
every="${2:-50}"
max_wait="${3:-6}"
cd "$(dirname "$0")/.."
moe="${MOE:-$PWD/build/release/moe}"
RANDOM="${SEED:-1}"
work="$(mktemp -d /tmp/moe-soak.XXXXXX)"
cluster=(env MOE_CLUSTER_NAME=moesoak "$moe" cluster)
cleanup() { "${cluster[@]}" down >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

# A small model so that 2000 steps take minutes; one thread per rank, the GEMM kernel pinned (a resumed
# run keeps its checkpoint's anyway), every flag the same in both runs.
train=(train --data docs/model.md --seq-len 32 --d-model 32 --layers 2 --heads 2 --d-ffn 64 --experts 4
       --batch-size 8 --steps "$steps" --checkpoint-every "$every" --eval-batches 1 --log-every 10
       --threads 1 --gemm onednn --seed 1 --comm-timeout 10)

if ! why=$("${cluster[@]}" check 2>&1); then echo "soak: skipped: $why"; exit 77; fi
"${cluster[@]}" down >/dev/null 2>&1 || true
"${cluster[@]}" up --nodes 2 --ranks-per-node 1 --nic 1gbit >/dev/null

now() { date +%s.%N; }
# The step a run's log reached (its last progress line), 0 when none.
last_step() { grep -oE '^step +[0-9]+/' "$1" | tail -1 | grep -oE '[0-9]+' || echo 0; }
# The step of the checkpoint in DIR, 0 when there is none.
checkpoint_step() { sed -nE 's/^  "step": *([0-9]+).*/\1/p' "$1/state.json" 2>/dev/null | head -1 || true; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

echo "soak: reference run, $steps steps, uninterrupted"
t0=$(now)
"${cluster[@]}" run -- "$moe" "${train[@]}" --checkpoint-dir "$work/ref" >"$work/ref.log" 2>&1 ||
  { tail -20 "$work/ref.log"; echo "soak: the reference run failed"; exit 1; }
ref_s=$(elapsed "$t0")

echo "soak: faulted run, a host killed 1-${max_wait} s after each start"
faults=0 resumes=0 lost=0 attempt=0
# An attempt killed before its first checkpoint makes no progress; where that happens (a job that starts
# slowly: a sanitizer build, a loaded machine) the kill window doubles, so the run always ends.
stretch=1
t0=$(now)
while :; do
  done_step=$(checkpoint_step "$work/run"); done_step=${done_step:-0}
  (( done_step >= steps )) && break  # an attempt killed just as it finished had written its last checkpoint
  attempt=$((attempt + 1))
  resume=()
  if [[ -f "$work/run/state.json" ]]; then resume=(--resume "$work/run"); resumes=$((resumes + 1)); fi
  from=$(checkpoint_step "$work/run"); from=${from:-0}
  log="$work/run.$attempt.log"
  "${cluster[@]}" run -- "$moe" "${train[@]}" --checkpoint-dir "$work/run" "${resume[@]}" >"$log" 2>&1 &
  job=$!
  wait_ds=$(((10 + RANDOM % (max_wait * 10 - 9)) * stretch))  # tenths of a second: 1 s .. max_wait, stretched
  for ((i = 0; i < wait_ds; ++i)); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$job" 2>/dev/null; then
    host="n$((faults % 2))"
    "${cluster[@]}" kill "$host" >/dev/null 2>&1 || true
    status=0; wait "$job" || status=$?
    faults=$((faults + 1))
    reached=$(last_step "$log"); kept=$(checkpoint_step "$work/run"); kept=${kept:-0}
    (( reached > kept )) && lost=$((lost + reached - kept))
    echo "soak: fault $faults: killed $host after $((wait_ds / 10)).$((wait_ds % 10)) s (attempt from step $from reached step $reached; exit $status); the last checkpoint is at step $kept"
    if (( kept == from && stretch < 64 )); then
      stretch=$((stretch * 2))
      echo "soak: no checkpoint since the last fault: the kill window is now ${stretch}x"
    fi
    continue
  fi
  status=0; wait "$job" || status=$?
  if (( status != 0 )); then tail -20 "$log"; echo "soak: attempt $attempt failed without a fault (exit $status)"; exit 1; fi
  break
done
run_s=$(elapsed "$t0")

equal=1
for f in "$work"/ref/*.safetensors; do
  name=$(basename "$f")
  if ! cmp -s "$f" "$work/run/$name"; then echo "soak: $name differs from the uninterrupted run's"; equal=0; fi
done
files=$(ls "$work"/ref/*.safetensors | wc -l)
echo "soak: $steps steps, checkpoint every $every: $faults faults injected, $resumes resumes, $lost steps lost," \
  "$run_s s against $ref_s s uninterrupted ($(awk -v a="$run_s" -v b="$ref_s" 'BEGIN { printf "%.1f", a - b }') s lost)"
if (( equal )); then
  echo "soak: the final weights and optimizer state equal the uninterrupted run's byte for byte ($files files)"
else
  exit 1
fi
