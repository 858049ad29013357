#!/usr/bin/env bash
# Runs Kiln's GPU checks on a machine with an NVIDIA GPU, from a build made elsewhere and
# copied here with the shared libraries it needs in BUILD/lib (see "GPU testing" in README.md).
# Writes logs and a summary to OUT (default ./gpu-check-out); exits 1 when any step fails (a test
# binary that skips for want of a GPU fails here too) and ends with a line naming the failures.
#
#   scripts/gpu-check.sh BUILD_DIR [OUT]
#
# KILN_NODE_TESTS: the ONNX node-test folder (default Debian's /usr/share/libonnx-testdata/data/node
# where it exists; carry a copy to a machine without it). Without one the check fails, unless
# KILN_SKIP_NODE_TESTS=1 says to skip them. KILN_MODELS_DIR: more exported models to check.
set -uo pipefail
build=$(cd "${1:?usage: gpu-check.sh BUILD_DIR [OUT]}" && pwd)
out=${2:-gpu-check-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
# The build recorded absolute paths of the machine it was configured on: the sources, and the
# build folder under which the test binaries look for the plugins. Each missing one is linked here.
link_configured() {  # link_configured CACHE_ENTRY HERE
  local there
  there=$(sed -n "s/^$1=//p" "$build/CMakeCache.txt")
  if [ -n "$there" ] && [ ! -e "$there" ]; then
    mkdir -p "$(dirname "$there")" && ln -s "$2" "$there"
  fi
}
link_configured CMAKE_HOME_DIRECTORY:INTERNAL "$root"
link_configured Kiln_BINARY_DIR:STATIC "$build"
export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KILN_CACHE_DIR="$out/cache"
kiln="$build/bin/kiln"
summary="$out/summary.txt"
: > "$summary"
steps=0
failed=()
record() {  # record NAME RC SECONDS: one summary line; a non-zero RC is a failure
  steps=$((steps + 1))
  [ "$2" -eq 0 ] || failed+=("$1")
  printf '%-28s rc=%-3s %6.1fs\n' "$1" "$2" "$3" | tee -a "$summary"
}
step() {  # step NAME COMMAND...: runs, logs to OUT/NAME.log, records the exit status
  local name=$1; shift
  local t0
  t0=$(date +%s.%N)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')"
}
sharded() {  # sharded N BINARY: N processes, KILN_TEST_SHARD=I/N each; fails when any fails
  local n=$1 bin=$2 i rc=0 pids=()
  for ((i = 0; i < n; ++i)); do
    KILN_TEST_SHARD=$i/$n "$bin" > "$out/$(basename "$bin").shard$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { rc=1; echo "shard $i/$n failed: see $(basename "$bin").shard$i.log"; }
  done
  cat "$out/$(basename "$bin")".shard*.log
  return "$rc"
}

step nvidia-smi nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
cat "$out/nvidia-smi.log" >> "$summary"
# cuDNN for the conv steps: PyTorch's wheel ships libcudnn.so.9; use it when the loader finds none.
have_cudnn() {
  ldconfig -p 2>/dev/null | grep -q 'libcudnn\.so\.9 ' && return 0
  local d dirs
  IFS=: read -ra dirs <<< "$LD_LIBRARY_PATH"
  for d in "${dirs[@]}"; do [ -e "$d/libcudnn.so.9" ] && return 0; done
  return 1
}
if ! have_cudnn; then
  cudnn=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2>/dev/null)
  if [ -n "$cudnn" ] && [ -e "$cudnn/libcudnn.so.9" ]; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$cudnn"
    echo "note: libcudnn.so.9 from $cudnn" | tee -a "$summary"
  fi
fi

# Every GPU test binary (ctest label gpu): the runtime's, and the CUDA backend's against the
# reference interpreter; the INT4 one in four shards side by side, as ctest runs it.
step runtime_gpu_tests "$build/bin/runtime_gpu_tests"
for bin in "$build"/bin/cuda_*gpu_tests; do
  name=$(basename "$bin")
  if [ "$name" = cuda_int4_gpu_tests ]; then
    step "$name" sharded 4 "$bin"
  else
    step "$name" "$bin"
  fi
done

# One artifact for three generations, inspected, then run here against the reference.
for m in mlp attention convnet; do
  syms=(--sym B=2)
  [ "$m" = attention ] && syms+=(--sym S=8)
  step "compile-$m" "$kiln" compile "$root/examples/kir/$m.kir" --target sm_80,sm_90a,sm_100a \
    "${syms[@]}" -o "$out/$m.kiln"
  step "inspect-$m" "$kiln" inspect "$out/$m.kiln" --json
  step "run-ref-$m" "$kiln" run "$root/examples/kir/$m.kir" --random-inputs --seed 3 "${syms[@]}" --backend reference
  step "run-gpu-$m" "$kiln" run "$root/examples/kir/$m.kir" --random-inputs --seed 3 "${syms[@]}" --backend cuda-sm90
done

# The real models against onnxruntime's outputs: the small versions in tests/models, and
# any exported by bench/models/export.py into $KILN_MODELS_DIR (e.g. the full-size ones).
for d in "$root"/tests/models/*/ ${KILN_MODELS_DIR:+"$KILN_MODELS_DIR"/*/}; do
  [ -f "$d/model.onnx" ] || continue
  step "model-$(basename "$d")" python3 "$root/tests/models/check_model.py" "$kiln" "$d" --backend cuda-sm90
done

# The quantizing pipelines (FP8 GEMMs, fused INT4 dequantize-GEMMs) on the small models, the
# same quantization run by the reference interpreter as the signal (min-size 0: their weights are
# under the INT4 pipelines' threshold).
for d in "$root"/tests/models/{llama,gpt2}-small-legacy; do
  for p in h200-fp8 a100-int4 h200-int4; do
    step "quantized-$(basename "$d")-$p" python3 "$root/tests/models/check_quantized.py" "$kiln" "$d" \
      --pipeline "$root/examples/pipelines/$p.toml" --min-size 0 --backend cuda-sm90
  done
done

# ONNX node tests on the reference and GPU backends, each against its expected-failure list (a
# new failure, or a listed test that passes, fails the step): reference's list, and on cuda-sm90
# that list joined with the tests that pass on reference but not there.
node=${KILN_NODE_TESTS:-}
if [ -z "$node" ] && [ -d /usr/share/libonnx-testdata/data/node ]; then node=/usr/share/libonnx-testdata/data/node; fi
if [ "${KILN_SKIP_NODE_TESTS:-0}" = 1 ]; then
  for name in conformance-reference conformance-cuda-sm90; do
    printf '%-28s skipped (KILN_SKIP_NODE_TESTS=1)\n' "$name" | tee -a "$summary"
  done
elif [ -z "$node" ] || [ ! -d "$node" ]; then
  echo "gpu-check: no ONNX node tests at '${node:-/usr/share/libonnx-testdata/data/node}': set KILN_NODE_TESTS=DIR" \
       "(a copy of Debian's libonnx-testdata data/node), or KILN_SKIP_NODE_TESTS=1 to skip them" | tee "$out/node-tests.log"
  record node-tests 1 0
else
  jobs=$(nproc)
  onnx=$root/tests/onnx
  step conformance-reference "$build/bin/kiln-onnx-conformance" "$node" --backend reference \
    --expected-failures "$onnx/expected_failures.txt" --tolerances "$onnx/tolerances.txt" \
    --jobs "$jobs" --report "$out/conformance-reference.json"
  step conformance-cuda-sm90 "$build/bin/kiln-onnx-conformance" "$node" --backend cuda-sm90 \
    --expected-failures "$onnx/expected_failures.txt" --expected-failures "$onnx/cuda_sm90_exceptions.txt" \
    --tolerances "$onnx/tolerances.txt" --jobs "$jobs" --timeout 120 --memory-limit 0 \
    --report "$out/conformance-cuda-sm90.json"
  tail -n 1 "$out/conformance-reference.log" "$out/conformance-cuda-sm90.log" | tee -a "$summary"
fi

if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu-check: all $steps steps passed" | tee -a "$summary"
  exit 0
fi
echo "gpu-check: ${#failed[@]} of $steps steps failed: ${failed[*]}" | tee -a "$summary"
exit 1
