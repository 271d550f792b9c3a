#!/usr/bin/env bash
# The CI-sized fuzz smoke (fuzz/README.md): builds the fuzz preset's targets and runs each one for
# SECONDS (default 30) over its committed corpus and regressions, one after another. Inputs that find
# new coverage go to a temporary folder (the committed corpus is not changed; see the README to keep
# them); a crash leaves its input in build/fuzz/artifacts/ and the script fails naming the targets.
# Usage: scripts/fuzz-smoke.sh [SECONDS]
set -euo pipefail
seconds="${1:-30}"
cd "$(dirname "$0")/.."
targets=(config safetensors checkpoint data load_trace cluster)
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz --target "${targets[@]/#/fuzz_}"
new_inputs="$(mktemp -d)"
trap 'rm -rf "$new_inputs"' EXIT
mkdir -p build/fuzz/artifacts
failed=()
for t in "${targets[@]}"; do
  mkdir -p "$new_inputs/$t"
  folders=("fuzz/corpus/$t")
  [[ -d "fuzz/regressions/$t" ]] && folders+=("fuzz/regressions/$t")
  echo "== fuzz_$t: ${seconds} s"
  if ! build/fuzz/fuzz/fuzz_"$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
       -artifact_prefix="build/fuzz/artifacts/$t-" -print_final_stats=1 "$new_inputs/$t" "${folders[@]}" \
       2> "$new_inputs/$t.log"; then
    failed+=("$t")
    tail -40 "$new_inputs/$t.log"
  fi
  grep -E "^Done [0-9]+ runs|stat::number_of_executed_units|stat::peak_rss_mb" "$new_inputs/$t.log" || true
done
if (( ${#failed[@]} )); then
  echo "fuzz smoke: FAILED: ${failed[*]} (inputs in build/fuzz/artifacts/)"
  exit 1
fi
echo "fuzz smoke: ${#targets[@]} targets, ${seconds} s each, no crash"
