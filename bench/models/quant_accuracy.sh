#!/usr/bin/env bash
# Runs `kiln quant-report` for the quantizing example pipelines on each trained model folder that
# bench/models/train.py wrote, all pairs in parallel (the reference interpreter is CPU-bound and
# splits large contractions across cores). FP8 pipelines with static scales are calibrated first
# on the folder's calib/ sets; every report runs on its eval/ sets, with the issue's floors
# (FP8 25 dB, INT4 16 dB end to end) as --floor, so a report below its floor exits 1.
#
#   bench/models/quant_accuracy.sh KILN MODELS_DIR OUT [MODEL_DIR...]
#
# Writes OUT/<model>.<pipeline>.txt (the report, then "rc=N seconds=S") and prints the
# end-to-end lines of each.
set -u
if [ $# -lt 3 ]; then
  echo "usage: $0 KILN MODELS_DIR OUT [MODEL_DIR...]" >&2
  exit 2
fi
kiln=$(realpath "$1")
models=$(realpath "$2")
mkdir -p "$3"
out=$(realpath "$3")
shift 3
root=$(cd "$(dirname "$0")/../.." && pwd)
# pipeline:floor (dB); portable-bf16 has none: it shows what the bf16 conversion alone costs.
pipelines="portable-bf16: h200-fp8:25 a100-int4:16 h200-int4:16"
dirs=("$@")
[ ${#dirs[@]} -eq 0 ] && dirs=("$models"/*-trained)
for dir in "${dirs[@]}"; do
  if [ ! -f "$dir/model.onnx" ] || [ ! -d "$dir/eval" ] || [ ! -d "$dir/calib" ]; then
    echo "quant_accuracy.sh: '$dir' is not a trained model folder (model.onnx, calib/, eval/; bench/models/train.py writes them)" >&2
    exit 2
  fi
done

for dir in "${dirs[@]}"; do
  dir=$(realpath "$dir")
  name=$(basename "$dir")
  sym=()
  if [ -f "$dir/dims.txt" ]; then
    while read -r line; do [ -n "$line" ] && sym+=(--sym "$line"); done < "$dir/dims.txt"
  fi
  for entry in $pipelines; do
    p=${entry%%:*}
    floor=${entry#*:}
    toml="$root/examples/pipelines/$p.toml"
    (
      start=$(date +%s)
      work=$(mktemp -d)
      cd "$work" || exit 1
      rc=0
      if grep -q 'scales=' "$toml"; then
        "$kiln" calibrate "$dir/model.onnx" --pipeline "$toml" --inputs "$dir/calib" -o scales.json "${sym[@]}" || rc=$?
      fi
      if [ $rc -eq 0 ]; then
        "$kiln" quant-report "$dir/model.onnx" --pipeline "$toml" --inputs "$dir/eval" ${floor:+--floor "$floor"} \
          "${sym[@]}" || rc=$?
      fi
      echo "rc=$rc seconds=$(($(date +%s) - start))"
      rm -rf "$work"
    ) > "$out/$name.$p.txt" 2>&1 &
  done
done
wait

status=0
for f in "$out"/*.txt; do
  echo "== $(basename "$f" .txt)"
  sed -n '/^end to end:/,$p' "$f" | grep -v '^end to end:'
  grep -q '^rc=0 ' "$f" || status=1
done
exit $status
