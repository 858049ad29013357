#!/usr/bin/env bash
# The planner's predictions for a Llama-8B-shaped model (d 4096, ff 14336, 32 layers, GQA 32/8
# heads, vocab 128256, bf16; prefill of T tokens) on 8 devices: batch 1, batch 8, batch 8 under a
# memory limit, and the smallest footprint. The model is written with a sparse side file (shapes
# only: planning reads no weight). Needs no GPU; pass a probe TOML (bench/parallel/probe.py) to
# use measured rates instead of the h200 preset.
#
#   bench/parallel/plan_llama8b.sh BUILD_DIR [PROBE.toml] [T]
set -euo pipefail
build=$(cd "${1:?usage: plan_llama8b.sh BUILD_DIR [PROBE.toml] [T]}" && pwd)
probe=${2:-}
seq=${3:-2048}
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$root/bench/parallel/llama_block.py" "$tmp" --d 4096 --ff 14336 --heads 32 --kv-heads 8 --layers 32 \
  --vocab 128256 --symbolic --planning-only --name llama8b >&2
kiln=("$build/bin/kiln" plan "$tmp/llama8b.kir" --devices 8 --sym T="$seq" --top 6)
[ -n "$probe" ] && kiln+=(--probe "$probe")
run() {
  echo "\$ kiln plan llama8b.kir --devices 8 --sym T=$seq $*${probe:+ --probe $probe}"
  "${kiln[@]}" "$@"
  echo
}
run --sym B=1
run --sym B=8
run --sym B=8 --memory-limit 12GiB
run --sym B=8 --objective memory
