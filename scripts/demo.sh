#!/usr/bin/env bash
# Kiln's main job end to end: import a model, run the optimization pipeline, compile one
# artifact for three GPU generations (NVRTC needs no GPU), and run the model on the best
# backend this machine has.
set -euo pipefail
build_dir=${1:-build}
root=$(cd "$(dirname "$0")/.." && pwd)
kiln="$build_dir/bin/kiln"
model="$root/examples/kir/mlp.kir"

# Best backend available: the CUDA backend for this GPU's generation, else the compiled CPU
# backend when one is registered, else the reference interpreter.
backends=$("$kiln" plugins | awk '$2 == "backend" {print $1}')
backend=reference
if command -v nvidia-smi > /dev/null 2>&1; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 || true)
  case "$cc" in
    8.*) want=cuda-sm80 ;;
    9.*) want=cuda-sm90 ;;
    10.*) want=cuda-sm100 ;;
    *) want= ;;
  esac
  if [ -n "$want" ] && grep -qx "$want" <<< "$backends"; then backend=$want; fi
fi
if [ "$backend" = reference ] && grep -qx cpu <<< "$backends"; then backend=cpu; fi

echo "== $("$kiln" --version | head -1); best backend here: $backend"
echo "== optimizing $model"
"$kiln" opt "$model" --passes "canonicalize,cse,dce" --timing -o "$build_dir/demo-mlp.opt.kir"
if grep -qx cuda-sm90 <<< "$backends"; then
  echo "== compiling one artifact for sm_80, sm_90a and sm_100a"
  "$kiln" compile "$build_dir/demo-mlp.opt.kir" --target sm_80,sm_90a,sm_100a --sym B=4 \
    -o "$build_dir/demo-mlp.kiln"
  "$kiln" inspect "$build_dir/demo-mlp.kiln"
fi
echo "== running on $backend"
"$kiln" run "$build_dir/demo-mlp.opt.kir" --backend "$backend" --random-inputs --seed 1 --sym B=2
if [ -d "$build_dir/python/kiln" ] && [ -x "$root/.venv/bin/python" ]; then
  echo "== the same from Python (examples/python/quickstart.py)"
  PYTHONPATH="$build_dir/python" "$root/.venv/bin/python" "$root/examples/python/quickstart.py"
fi
