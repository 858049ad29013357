#!/usr/bin/env bash
# Installs Kiln into a fresh prefix, builds examples/plugin-template against it from a clean
# build folder, and checks that the installed `kiln` lists and runs the plugin.
set -euo pipefail
build_dir=$1
src_dir=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
for path in bin/kiln include/kiln/plugin.h include/kiln/version.h include/kiln/ir/graph.h \
            include/kiln/core/registry.h lib/cmake/Kiln/KilnConfig.cmake \
            lib/kiln/plugins/kiln-plugin-transforms.so; do
  [ -e "$work/prefix/$path" ] || { echo "missing from the install tree: $path"; exit 1; }
done

cmake -S "$src_dir/examples/plugin-template" -B "$work/plugin-build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/plugin-build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }

listing=$("$work/prefix/bin/kiln" plugins --plugin-path "$work/plugin-build")
echo "$listing" | grep -q "square-to-mul" || { echo "plugin not listed:"; echo "$listing"; exit 1; }

cat > "$work/square.kir" <<'KIR'
graph @main(%x: f32[4]) -> (f32[4]) {
  %two = constant() {value = dense<f32[]>[2.0]} : f32[]
  %y = pow(%x, %two) : f32[4]
  return %y
}
KIR
out=$("$work/prefix/bin/kiln" opt "$work/square.kir" --plugin-path "$work/plugin-build" \
      --passes "square-to-mul,dce")
echo "$out"
echo "$out" | grep -q "mul(%x, %x)" || { echo "pass did not rewrite pow"; exit 1; }
if echo "$out" | grep -q "pow("; then echo "pow left behind"; exit 1; fi
echo "template plugin builds against the installed SDK and runs"
