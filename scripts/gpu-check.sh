#!/usr/bin/env bash
# Runs Kiln's GPU checks on a machine with an NVIDIA GPU, from a build made elsewhere and
# copied here with the shared libraries it needs in BUILD/lib (see "GPU testing" in README.md).
# Writes logs and a summary to OUT (default ./gpu-check-out).
#
#   scripts/gpu-check.sh BUILD_DIR [OUT]
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
step() {  # step NAME COMMAND...: runs, logs to OUT/NAME.log, records the exit status
  local name=$1; shift
  local t0=$(date +%s.%N)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-3s %6.1fs\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" | tee -a "$summary"
}

nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | tee -a "$summary"
step runtime_gpu_tests "$build/bin/runtime_gpu_tests"
step cuda_gpu_tests "$build/bin/cuda_gpu_tests"

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

# ONNX node tests on the reference and GPU backends ($KILN_NODE_TESTS: a node-test folder such
# as Debian's /usr/share/libonnx-testdata/data/node, carried along).
if [ -n "${KILN_NODE_TESTS:-}" ] && [ -d "$KILN_NODE_TESTS" ]; then
  jobs=$(nproc)
  step conformance-reference "$build/bin/kiln-onnx-conformance" "$KILN_NODE_TESTS" --backend reference \
    --expected-failures "$root/tests/onnx/expected_failures.txt" --jobs "$jobs" --report "$out/conformance-reference.json"
  step conformance-cuda-sm90 "$build/bin/kiln-onnx-conformance" "$KILN_NODE_TESTS" --backend cuda-sm90 \
    --jobs "$jobs" --timeout 120 --memory-limit 0 --report "$out/conformance-cuda-sm90.json"
  tail -n 1 "$out/conformance-reference.log" "$out/conformance-cuda-sm90.log" | tee -a "$summary"
fi
cat "$summary"
