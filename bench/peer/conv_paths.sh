#!/usr/bin/env bash
# Vision workloads against PyTorch (bench/peer/run.py), then the same exported models through
# Kiln's convolution paths, each with a per-step profile, to see where convolution time goes:
# nhwc (the pipeline as shipped: layout-nhwc, cuDNN channels last), dwnchw (depthwise convs left
# NCHW, for the generated depthwise kernel: layout-nhwc{depthwise=false}), nchw (the pipeline
# without layout-nhwc: depthwise convs as the generated kernel, `conv_depthwise` steps, 1x1 convs
# as strided-batched cuBLASLt GEMMs, `gemm` steps, the rest cuDNN) and, on request, cudnn (nchw
# with `depthwise = "cudnn", conv1x1 = "cudnn"`: every conv a cuDNN NCHW step) and gemm (nchw with
# `conv = "gemm"`: im2col GEMMs) and cudnnpatch (the shipped pipeline with kernel-sized strided
# convs left cuDNN convs: layout-nhwc{patches-as-linear=false}). Run from the repo root on the GPU host with the carried build in
# build-gpu/ (scripts/carry-build.sh build build-gpu).
#
#   [PATHS=nhwc,dwnchw,nchw,cudnn,gemm,cudnnpatch] bench/peer/conv_paths.sh OUT WORKLOAD[,WORKLOAD...]
set -u
PATHS=${PATHS:-nhwc,dwnchw,nchw}
out=${1:?usage: conv_paths.sh OUT WORKLOADS}; only=${2:?usage: conv_paths.sh OUT WORKLOADS}
b=$PWD/build-gpu
export LD_LIBRARY_PATH=$b/lib KILN_CACHE_DIR=/tmp/kc KILN_COMMIT=${KILN_COMMIT:-unknown}
cudnn=$(python3 -c "import nvidia.cudnn;print(list(nvidia.cudnn.__path__)[0]+'/lib')" 2>/dev/null)
[ -n "$cudnn" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$cudnn
mkdir -p "$out"
rc=0
python3 bench/peer/run.py --kiln "$b/bin/kiln" --only "$only" --out "$out" --kiln-profile 12 --budget 420 \
  >"$out/peer.log" 2>&1 || rc=1
base=examples/pipelines/cuda-sm90-tf32.toml
sed 's/"layout-nhwc", //' $base >/tmp/conv-nchw.toml
sed 's/"layout-nhwc", /"layout-nhwc{depthwise=false}", /' $base >/tmp/conv-dwnchw.toml
sed 's/"layout-nhwc", /"layout-nhwc{patches-as-linear=false}", /' $base >/tmp/conv-cudnnpatch.toml
sed 's/allow-tf32 = true }/allow-tf32 = true, conv = "gemm" }/' /tmp/conv-nchw.toml >/tmp/conv-gemm.toml
sed 's/allow-tf32 = true }/allow-tf32 = true, depthwise = "cudnn", conv1x1 = "cudnn" }/' /tmp/conv-nchw.toml \
  >/tmp/conv-cudnn.toml
if grep -q layout-nhwc /tmp/conv-nchw.toml || ! grep -q 'conv = "gemm"' /tmp/conv-gemm.toml ||
  ! grep -q 'conv1x1 = "cudnn"' /tmp/conv-cudnn.toml || ! grep -q 'patches-as-linear=false' /tmp/conv-cudnnpatch.toml; then
  echo "conv_paths.sh: could not derive the nchw, cudnn, gemm and cudnnpatch pipelines from $base" >&2; exit 1
fi
for w in ${only//,/ }; do
  m=/tmp/kiln-peer/$w/model.onnx
  [ -f "$m" ] || { echo "$w: no exported model" >>"$out/conv-paths.txt"; rc=1; continue; }
  for path in ${PATHS//,/ }; do
    p=$base; [ $path = nchw ] && p=/tmp/conv-nchw.toml; [ $path = gemm ] && p=/tmp/conv-gemm.toml
    [ $path = dwnchw ] && p=/tmp/conv-dwnchw.toml; [ $path = cudnn ] && p=/tmp/conv-cudnn.toml
    [ $path = cudnnpatch ] && p=/tmp/conv-cudnnpatch.toml
    echo "== $w conv=$path" >>"$out/conv-paths.txt"
    "$b/bin/kiln" bench "$m" --pipeline "$p" --target sm_90a -o "/tmp/$w-$path.kiln" --iterations 50 --profile 12 \
      >>"$out/conv-paths.txt" 2>&1 || { echo "rc=$?" >>"$out/conv-paths.txt"; rc=1; }
  done
done
for d in /tmp/kiln-peer/*/; do
  for f in "$d"*.log; do [ -f "$f" ] && cp "$f" "$out/$(basename "$d")-$(basename "$f")"; done
done
exit $rc
