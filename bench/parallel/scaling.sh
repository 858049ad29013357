#!/usr/bin/env bash
# Multi-GPU scaling against one GPU, on a host with 2 or more GPUs (nvidia-h200-x2): a Llama-style
# block (d 4096, ff 11008, T 2048, bf16) tensor-parallel over 2 GPUs vs the same block on 1
# (goal >= 1.7x throughput), and GPT-2 small data-parallel over 2 GPUs vs 1 at the same global
# batch (goal >= 1.9x). Every run is `kiln bench` with graphs on; the 2-GPU runs go through
# `kiln launch -n 2`, rank 0 reporting. Writes OUT/scaling.md and the JSON reports.
#
#   bench/parallel/scaling.sh BUILD_DIR OUT [GPT2_DIR]
#
# GPT2_DIR: a full-size GPT-2 folder exported by `python3 bench/models/export.py --out DIR
# --size full --exporters legacy` (model.onnx with a symbolic batch); skipped when absent.
set -euo pipefail
build=$(cd "${1:?usage: scaling.sh BUILD_DIR OUT [GPT2_DIR]}" && pwd)
out=${2:?usage: scaling.sh BUILD_DIR OUT [GPT2_DIR]}
gpt2=${3:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
kiln="$build/bin/kiln"
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge 2 ] || { echo "scaling.sh: needs 2 GPUs, this host has $gpus" >&2; exit 77; }
bench=(bench --iterations 50 --warmup 10 --graphs on)

python3 "$root/bench/parallel/llama_block.py" "$out/block"
"$kiln" "${bench[@]}" "$out/block/block.kir" --pipeline "$root/examples/pipelines/cuda-sm90.toml" \
  --report-json "$out/block-1gpu.json"
"$kiln" launch -n 2 -- "$kiln" "${bench[@]}" "$out/block/block.kir" \
  --pipeline "$root/examples/pipelines/tensor-parallel.toml" --report-json "$out/block-tp2.json"

if [ -n "$gpt2" ] && [ -f "$gpt2/model.onnx" ]; then
  sed 's/dp=4/dp=2/' "$root/examples/pipelines/data-parallel.toml" > "$out/dp2.toml"
  for b in 16 64; do
    "$kiln" "${bench[@]}" "$gpt2/model.onnx" --pipeline "$root/examples/pipelines/cuda-sm90.toml" \
      --sym batch=$b --sym seq=512 --report-json "$out/gpt2-b$b-1gpu.json"
    "$kiln" launch -n 2 -- "$kiln" "${bench[@]}" "$gpt2/model.onnx" --pipeline "$out/dp2.toml" \
      --sym batch=$b --sym seq=512 --report-json "$out/gpt2-b$b-dp2.json"
  done
fi

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def median(name):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        return None
    g = json.load(open(p))["graphs"]["on"]
    return g["device_ms"]["median"] if g.get("device_ms") else g["latency_ms"]["median"]
rows = [("Llama-style block, tensor-parallel", "block-1gpu.json", "block-tp2.json", 1.7)]
for b in (16, 64):
    rows.append((f"GPT-2 small batch {b}, data-parallel", f"gpt2-b{b}-1gpu.json", f"gpt2-b{b}-dp2.json", 1.9))
lines = ["| model | 1 GPU ms | 2 GPUs ms | speed-up | goal |", "|---|---:|---:|---:|---:|"]
for what, one, two, goal in rows:
    a, b = median(one), median(two)
    if a is None or b is None:
        continue
    lines.append(f"| {what} | {a:.3f} | {b:.3f} | {a / b:.2f}x | {goal}x |")
text = "\n".join(lines) + "\n"
open(os.path.join(out, "scaling.md"), "w").write(text)
print(text)
PY
