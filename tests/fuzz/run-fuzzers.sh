#!/usr/bin/env bash
# Builds Kiln's libFuzzer targets (clang, ASan+UBSan) and runs them side by side for a while.
#
#   tests/fuzz/run-fuzzers.sh [SECONDS] [kir] [toml] [onnx]
#
# SECONDS defaults to 1860 per target; with no names all three run. Environment:
#   BUILD  build folder (default: ../build-fuzz next to the source tree)
#   WORK   where each target keeps its growing corpus, crash artifacts and log
#          (default: $BUILD/fuzz-work/NAME/{corpus,artifacts,log})
#   JOBS   ninja parallelism (default 2)
#   NO_BUILD=1  skip the configure and build steps (the binaries exist)
# New crashers land in $WORK/NAME/artifacts; minimize one with
#   $BUILD/bin/fuzz_NAME -minimize_crash=1 -runs=10000 -exact_artifact_path=OUT CRASH
# and check OUT into tests/corpus/NAME so the replay test keeps covering it.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$(dirname "$SRC")/build-fuzz}
WORK=${WORK:-$BUILD/fuzz-work}
SECS=${1:-1860}
shift || true
NAMES=${*:-kir toml onnx}

if [ -z "${NO_BUILD:-}" ] && [ ! -f "$BUILD/build.ninja" ]; then
  SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
  cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DKILN_FUZZ=ON -DKILN_WERROR=OFF \
    "-DCMAKE_C_FLAGS=$SAN -fsanitize=fuzzer-no-link" \
    "-DCMAKE_CXX_FLAGS=$SAN -fsanitize=fuzzer-no-link" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" \
    "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" \
    "-DCMAKE_MODULE_LINKER_FLAGS=-fsanitize=address,undefined"
fi

binary() { case $1 in kir) echo fuzz_kir_parser ;; toml) echo fuzz_pipeline_toml ;; onnx) echo fuzz_onnx_import ;; esac; }
seeds() {
  case $1 in
    kir) echo "$SRC/tests/corpus/kir $SRC/tests/lit $SRC/examples/kir" ;;
    toml) echo "$SRC/tests/corpus/toml $SRC/examples/pipelines" ;;
    onnx) echo "$SRC/tests/corpus/onnx" ;;
  esac
}

targets=()
for n in $NAMES; do targets+=("$(binary "$n")"); done
[ -n "${NO_BUILD:-}" ] || ninja -C "$BUILD" -j"${JOBS:-2}" "${targets[@]}"

pids=()
for n in $NAMES; do
  dir=$WORK/$n
  mkdir -p "$dir/corpus" "$dir/artifacts"
  dict=()
  [ -f "$SRC/tests/fuzz/$n.dict" ] && dict=(-dict="$SRC/tests/fuzz/$n.dict")
  # The first folder receives new inputs; the seed folders are only read. Fork mode keeps
  # fuzzing after a crash, timeout or OOM, so one finding does not end an unattended run.
  # shellcheck disable=SC2046
  nice "$BUILD/bin/$(binary "$n")" "$dir/corpus" $(seeds "$n") "${dict[@]}" \
    -max_total_time="$SECS" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
    -artifact_prefix="$dir/artifacts/" > "$dir/log" 2>&1 &
  pids+=($!)
  echo "fuzz: $n running as pid $! (log: $dir/log)"
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
