#!/usr/bin/env bash
# One-GPU NCCL checks (a mesh of one rank): collective GPU tests, the abort path, and tensor- and
# data-parallel programs of one rank on cuda-sm90 against the unsharded run. Run from the repo
# root with the carried build in build-gpu/ (scripts/carry-build.sh build build-gpu).
set -u
root=$PWD; b=$root/build-gpu; out=${OUT:-/tmp/out}
there=$(sed -n 's/^Kiln_BINARY_DIR:STATIC=//p' $b/CMakeCache.txt); mkdir -p "$(dirname "$there")"; [ -e "$there" ] || ln -s $b "$there"
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' $b/CMakeCache.txt); [ -e "$src" ] || ln -s $root "$src"
export LD_LIBRARY_PATH=$b/lib KILN_CACHE_DIR=/tmp/kc
cudnn=$(python3 -c "import nvidia.cudnn,os;print(os.path.dirname(nvidia.cudnn.__file__)+'/lib')" 2>/dev/null); [ -n "$cudnn" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$cudnn
rc=0
step() { echo "== $*"; "$@"; local r=$?; echo "rc=$r"; [ $r -eq 0 ] || rc=1; }
step $b/bin/cuda_collective_gpu_tests
step timeout 200 $b/bin/cuda_collective_watchdog_gpu_tests
step $b/bin/runtime_gpu_tests
step $b/bin/cuda_gpu_tests
m=tests/models/gpt2-small-legacy
common="--sym batch=2 --sym seq=16 --random-inputs --seed 3"
step $b/bin/kiln run $m/model.onnx --passes canonicalize,cse $common --backend cuda-sm90 --output output=@/tmp/whole.npy
step $b/bin/kiln run $m/model.onnx --passes 'canonicalize,cse,tensor-parallel{mesh="tp=1"}' $common --backend cuda-sm90 --output output=@/tmp/tp1.npy
sed 's/dp=4/dp=1/' examples/pipelines/data-parallel.toml > /tmp/dp1.toml
step $b/bin/kiln launch -n 1 -- $b/bin/kiln run $m/model.onnx --pipeline /tmp/dp1.toml $common --output output=@/tmp/dp1.npy
step python3 -c "
import numpy as np, sys
w=np.load('/tmp/whole.npy')
for f in ['/tmp/tp1.npy','/tmp/dp1.npy']:
    g=np.load(f); d=np.abs(g-w).max(); print(f, 'max |diff|', d, 'nan', np.isnan(g).any()); assert np.isfinite(g).all() and d < 1e-4
"
echo "all rc=$rc"
exit $rc
