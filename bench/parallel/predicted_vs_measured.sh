#!/usr/bin/env bash
# The planner's predictions against `kiln bench` on this host: a Llama-style block (d 4096,
# ff 11008, T 2048, bf16; bench/parallel/llama_block.py) planned for 1 GPU and, with 2 or more
# GPUs, for 2; each plan's predicted step time next to the measured median device time of the
# same model compiled with `[parallel] strategy = "auto"` (so the measured program is the chosen
# one). Writes OUT/predicted_vs_measured.md and the JSON it read.
#
#   bench/parallel/predicted_vs_measured.sh BUILD_DIR OUT [PROBE.toml]
#
# PROBE.toml: bench/parallel/probe.py's measurements of this host (default: the h200 preset).
set -euo pipefail
build=$(cd "${1:?usage: predicted_vs_measured.sh BUILD_DIR OUT [PROBE.toml]}" && pwd)
out=${2:?usage: predicted_vs_measured.sh BUILD_DIR OUT [PROBE.toml]}
probe=${3:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cuDNN from PyTorch's wheel where the system has none (the cuda plugins link it).
cudnn=$(python3 -c "import nvidia.cudnn,os;print(os.path.dirname(nvidia.cudnn.__file__)+'/lib')" 2>/dev/null || true)
[ -n "$cudnn" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$cudnn"
kiln="$build/bin/kiln"
gpus=$(nvidia-smi -L | wc -l)
python3 "$root/bench/parallel/llama_block.py" "$out/block"
meshes=(1)
[ "$gpus" -ge 2 ] && meshes+=(2)
for n in "${meshes[@]}"; do
  "$kiln" plan "$out/block/block.kir" --devices "$n" ${probe:+--probe "$probe"} --json > "$out/plan-$n.json"
  "$kiln" plan "$out/block/block.kir" --devices "$n" ${probe:+--probe "$probe"} > "$out/plan-$n.txt"
  {
    sed -n '/^passes/,/^$/p' "$root/examples/pipelines/cuda-sm90.toml"
    echo "[parallel]"
    echo 'strategy = "auto"'
    echo "options = { devices = $n${probe:+, probe = \"$(cd "$(dirname "$probe")" && pwd)/$(basename "$probe")\"} }"
    echo "[backend]"
    echo 'name = "cuda-sm90"'
    echo 'targets = ["sm_90a"]'
  } > "$out/auto-$n.toml"
  # One process per rank, also for one: a per-rank program takes its rank from the launcher.
  "$kiln" launch -n "$n" -- "$kiln" bench "$out/block/block.kir" --pipeline "$out/auto-$n.toml" --iterations 50 --warmup 10 \
    --graphs on --report-json "$out/bench-$n.json"
done
python3 - "$out" "${meshes[@]}" <<'PY'
import json, os, sys
out, meshes = sys.argv[1], sys.argv[2:]
lines = ["| devices | chosen | predicted step | predicted comm | measured median (device) | measured / predicted |",
         "|---:|---|---:|---:|---:|---:|"]
for n in meshes:
    plan = json.load(open(os.path.join(out, f"plan-{n}.json")))["chosen"]
    g = json.load(open(os.path.join(out, f"bench-{n}.json")))["graphs"]["on"]
    ms = g["device_ms"]["median"] if g.get("device_ms") else g["latency_ms"]["median"]
    lines.append(f"| {n} | `{plan['strategy']}` | {plan['step_s'] * 1e3:.3f} ms | {plan['comm_s'] * 1e3:.3f} ms | "
                 f"{ms:.3f} ms | {ms / (plan['step_s'] * 1e3):.2f} |")
text = "\n".join(lines) + "\n"
open(os.path.join(out, "predicted_vs_measured.md"), "w").write(text)
print(text)
PY
