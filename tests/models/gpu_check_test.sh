#!/usr/bin/env bash
# Checks scripts/gpu-check.sh's verdicts without a GPU, on a fake build whose binaries are stubs:
# it exits 0 only when every step passes, names each failing step (a test binary, one INT4 shard,
# a model whose GPU output holds a NaN), fails when the ONNX node tests are missing unless told to
# skip them, and runs the cuda-sm90 node tests against both expected-failure lists.
#
#   gpu_check_test.sh SOURCE_DIR PYTHON_WITH_NUMPY
set -euo pipefail
root=$1
python=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
build=$work/build
mkdir -p "$build/bin" "$build/lib" "$work/path" "$work/node"
touch "$build/CMakeCache.txt"
ln -s "$(command -v "$python")" "$work/path/python3"
printf '#!/bin/sh\necho "Fake GPU, 9.0, 1 MiB, 0"\n' > "$work/path/nvidia-smi"

# A test binary: fails when GPU_CHECK_STUB_FAIL names it, or it with its shard (NAME@I/N).
cat > "$work/test-binary" <<'EOF'
#!/bin/sh
me=$(basename "$0")
case "${GPU_CHECK_STUB_FAIL:-}" in "$me"|"$me@${KILN_TEST_SHARD:-}") echo "FAIL stub"; exit 1 ;; esac
echo "0 of 1 cases failed"
EOF
for b in runtime_gpu_tests cuda_gpu_tests cuda_gemv_gpu_tests cuda_int4_gpu_tests; do
  cp "$work/test-binary" "$build/bin/$b"
done
# kiln: `run` on an ONNX model copies its saved outputs to the --output files (with a NaN in the
# first element on cuda-sm90 under GPU_CHECK_STUB_NAN=1); quant-report counts one of each.
cat > "$build/bin/kiln" <<'EOF'
#!/bin/bash
cmd=$1 model=${2:-}
case "$cmd" in
  quant-report) echo "contractions by op: matmul 1 scaled_matmul 1 matmul_int4 1" ;;
  calibrate) while [ $# -gt 0 ]; do [ "$1" = -o ] && echo '{}' > "$2"; shift; done ;;
  run)
    nan=0
    while [ $# -gt 0 ]; do
      case "$1" in
        --backend) [ "$2" = cuda-sm90 ] && [ "${GPU_CHECK_STUB_NAN:-0}" = 1 ] && nan=1 ;;
        --output) outs+=("$2") ;;
      esac
      shift
    done
    for o in "${outs[@]}"; do
      name=${o%%=@*} path=${o#*=@}
      python3 -c 'import sys, numpy as np
a = np.load(sys.argv[1]).copy()
if sys.argv[3] == "1": a.flat[0] = np.nan
np.save(sys.argv[2], a)' "$(dirname "$model")/output_$name.npy" "$path" "$nan"
    done ;;
esac
exit 0
EOF
# kiln-onnx-conformance: prints its arguments and a passing summary.
printf '#!/bin/sh\necho "args: $*"\necho "1 passed, 0 failed, 0 skipped"\n' > "$build/bin/kiln-onnx-conformance"
chmod +x "$work"/path/* "$build"/bin/*

failures=0
# check NAME WANT_RC LAST_LINE_REGEX [ENV=VALUE...]: runs gpu-check.sh, checks its status and last line.
check() {
  local name=$1 want=$2 last=$3 rc=0
  shift 3
  env PATH="$work/path:$PATH" "$@" "$root/scripts/gpu-check.sh" "$build" "$work/out-$name" \
    > "$work/$name.txt" 2>&1 || rc=$?
  local got
  got=$(tail -n 1 "$work/$name.txt")
  if [ "$rc" != "$want" ] || ! [[ $got =~ $last ]]; then
    echo "FAIL $name: exit $rc (want $want), last line '$got' (want /$last/)"
    cat "$work/$name.txt"
    failures=$((failures + 1))
  else
    echo "PASS $name: $got"
  fi
}
node="KILN_NODE_TESTS=$work/node"
check all-pass 0 '^gpu-check: all [0-9]+ steps passed$' "$node"
check binary-fails 1 '^gpu-check: 1 of [0-9]+ steps failed: cuda_gemv_gpu_tests$' "$node" \
  GPU_CHECK_STUB_FAIL=cuda_gemv_gpu_tests
check shard-fails 1 '^gpu-check: 1 of [0-9]+ steps failed: cuda_int4_gpu_tests$' "$node" \
  GPU_CHECK_STUB_FAIL=cuda_int4_gpu_tests@2/4
check nan-output 1 '^gpu-check: [0-9]+ of [0-9]+ steps failed: model-.*quantized-' "$node" GPU_CHECK_STUB_NAN=1
check no-node-tests 1 '^gpu-check: 1 of [0-9]+ steps failed: node-tests$' KILN_NODE_TESTS="$work/none"
check skip-node-tests 0 '^gpu-check: all [0-9]+ steps passed$' KILN_NODE_TESTS="$work/none" KILN_SKIP_NODE_TESTS=1

expect() {  # expect NAME FILE REGEX: FILE matches REGEX (grep -E)
  if grep -Eq -- "$3" "$2"; then echo "PASS $1"; else echo "FAIL $1: $2 lacks /$3/"; failures=$((failures + 1)); fi
}
expect "cuda-sm90 node tests use both lists" "$work/out-all-pass/conformance-cuda-sm90.log" \
  "--expected-failures $root/tests/onnx/expected_failures.txt --expected-failures $root/tests/onnx/cuda_sm90_exceptions.txt"
expect "reference node tests use reference's list alone" "$work/out-all-pass/conformance-reference.log" \
  "--expected-failures $root/tests/onnx/expected_failures.txt --tolerances"
expect "skipped node tests say so" "$work/out-skip-node-tests/summary.txt" "^conformance-cuda-sm90 +skipped"
expect "the NaN is named" "$work/out-nan-output/model-gpt2-small-legacy.log" "got nan, expected .* \(got NaN\)"
expect "the missing node tests are named" "$work/no-node-tests.txt" "no ONNX node tests at '$work/none'"
if [ -d /usr/share/libonnx-testdata/data/node ]; then
  check default-node-tests 0 '^gpu-check: all [0-9]+ steps passed$'
  expect "node tests default to Debian's" "$work/out-default-node-tests/conformance-reference.log" \
    "args: /usr/share/libonnx-testdata/data/node "
fi
echo "$failures failed"
[ "$failures" -eq 0 ]
