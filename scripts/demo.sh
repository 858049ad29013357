#!/usr/bin/env bash
# Kiln's main job end to end: import a model, run the optimization pipeline, compile it for
# the best backend this machine has, and run it.
set -euo pipefail
build_dir=${1:-build}
root=$(cd "$(dirname "$0")/.." && pwd)
kiln="$build_dir/bin/kiln"
model="$root/examples/kir/mlp.kir"

# Best backend available: a GPU backend when one is registered and a GPU is present, then the
# compiled CPU backend, then the reference interpreter.
backends=$("$kiln" plugins | awk '$2 == "backend" {print $1}')
backend=reference
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then
  for b in cuda-sm100 cuda-sm90 cuda-sm80; do
    if grep -qx "$b" <<< "$backends"; then backend=$b; break; fi
  done
fi
if [ "$backend" = reference ] && grep -qx cpu <<< "$backends"; then backend=cpu; fi

echo "== kiln $("$kiln" --version | head -1 | awk '{print $2}'), backend: $backend"
echo "== optimizing $model"
"$kiln" opt "$model" --passes "canonicalize,cse,dce" --timing -o "$build_dir/demo-mlp.opt.kir"
echo "== running on $backend"
"$kiln" run "$build_dir/demo-mlp.opt.kir" --backend "$backend" --random-inputs --seed 1
