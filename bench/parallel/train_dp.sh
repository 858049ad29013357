#!/usr/bin/env bash
# GPT-2 small data-parallel training on 2 GPUs against 1 GPU (goal: >= 1.9x the tokens/s), on a
# host with 2 or more GPUs (nvidia-h200-x2 or nvidia-h100-x2). `kiln train` runs the training step
# (autodiff, AdamW with clipping, fused, cuda-sm90) of bench/parallel/gpt2_train.py's model:
#
#   1 GPU,  batch 8                                   the baseline
#   2 GPUs, batch 16 (8 per GPU, `kiln launch -n 2`)  the goal's ratio: the same work per GPU
#   2 GPUs, batch 8  (4 per GPU)                      the same global batch: its losses must be
#                                                     the 1-GPU run's (fp32 tolerance)
#
# Throughput is the median tokens/s of the steps after the first WARMUP (default 5), from the
# progress lines rank 0 prints (global tokens per step over the step's time). Writes
# OUT/train-dp.md and the logs.
#
#   bench/parallel/train_dp.sh BUILD_DIR OUT [STEPS] [WARMUP]
#   AUTOCAST=bf16 bench/parallel/train_dp.sh ...   # bf16 contractions, fp32 master weights
set -euo pipefail
build=$(cd "${1:?usage: train_dp.sh BUILD_DIR OUT [STEPS] [WARMUP]}" && pwd)
out=${2:?usage: train_dp.sh BUILD_DIR OUT [STEPS] [WARMUP]}
steps=${3:-30}
warmup=${4:-5}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
kiln="$build/bin/kiln"
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge 2 ] || { echo "train_dp.sh: needs 2 GPUs, this host has $gpus" >&2; exit 77; }

python3 "$root/bench/parallel/gpt2_train.py" "$out" --batch 8 16 --steps "$steps" --ranks 2 \
  ${AUTOCAST:+--autocast "$AUTOCAST"}
train=(train --steps "$steps")
"$kiln" "${train[@]}" "$out/model-b8.kir" --pipeline "$out/train-1gpu.toml" --data "$out/data-b8" \
  --loss-file "$out/loss-1gpu-b8.npy" 2>&1 | tee "$out/1gpu-b8.log"
"$kiln" launch -n 2 -- "$kiln" "${train[@]}" "$out/model-b16.kir" --pipeline "$out/train-dp2.toml" \
  --data "$out/data-b16" 2>&1 | tee "$out/dp2-b16.log"
"$kiln" launch -n 2 -- "$kiln" "${train[@]}" "$out/model-b8.kir" --pipeline "$out/train-dp2.toml" \
  --data "$out/data-b8" --loss-file "$out/loss-dp2-b8.npy" 2>&1 | tee "$out/dp2-b8.log"

python3 - "$out" "$warmup" <<'PY'
import os, re, statistics, sys
import numpy as np
out, warmup = sys.argv[1], int(sys.argv[2])
def rate(log):
    r = [float(m.group(1)) for m in re.finditer(r"step \d+/\d+ .* ([0-9.]+) tokens/s", open(os.path.join(out, log)).read())]
    if len(r) <= warmup:
        sys.exit(f"train_dp.sh: {log} has {len(r)} progress lines, need more than {warmup}")
    return statistics.median(r[warmup:])
one, two, same = rate("1gpu-b8.log"), rate("dp2-b16.log"), rate("dp2-b8.log")
a, b = np.load(os.path.join(out, "loss-1gpu-b8.npy")), np.load(os.path.join(out, "loss-dp2-b8.npy"))
worst = float(np.max(np.abs(a - b) / np.abs(a)))
lines = ["| GPT-2 small training (T 512) | tokens/s | vs 1 GPU | goal |", "|---|---:|---:|---:|",
         f"| 1 GPU, batch 8 | {one:.0f} | 1.00x | |",
         f"| 2 GPUs data-parallel, batch 16 (8 per GPU) | {two:.0f} | {two / one:.2f}x | 1.9x |",
         f"| 2 GPUs data-parallel, batch 8 (4 per GPU) | {same:.0f} | {same / one:.2f}x | |",
         "", f"Batch 8 on 2 GPUs vs 1 GPU: losses agree to {worst:.1e} (relative, worst of {len(a)} steps)."]
text = "\n".join(lines) + "\n"
open(os.path.join(out, "train-dp.md"), "w").write(text)
print(text)
PY
