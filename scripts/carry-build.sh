#!/usr/bin/env bash
# Copies what a build needs to run on another machine (a GPU host without Kiln's Debian packages):
# the executables, Kiln's libraries and plugins, CMakeCache.txt (scripts/gpu-check.sh reads the
# configured source path from it) and the non-system shared libraries they link (toml++, libonnx,
# protobuf), stripped. Run there with LD_LIBRARY_PATH=DEST/lib.
#
#   scripts/carry-build.sh BUILD_DIR DEST
set -euo pipefail
[ -d "${1:?usage: carry-build.sh BUILD_DIR DEST}" ] || { echo "carry-build.sh: no build folder '$1'" >&2; exit 1; }
src=$(cd "$1" && pwd)
dst=${2:?usage: carry-build.sh BUILD_DIR DEST}
[ -x "$src/bin/kiln" ] || { echo "carry-build.sh: $src/bin/kiln not found: build first" >&2; exit 1; }
rm -rf "$dst"
mkdir -p "$dst/bin" "$dst/lib/kiln/plugins"
cp "$src/CMakeCache.txt" "$dst/"
for f in "$src"/bin/*; do
  if [ -f "$f" ] && [ -x "$f" ]; then cp "$f" "$dst/bin/"; fi
done
cp -a "$src"/lib/*.so* "$dst/lib/"
cp -a "$src"/lib/kiln/plugins/*.so "$dst/lib/kiln/plugins/"
# LLVM stays behind (hundreds of MB), so the plugin that links it would fail every plugin load
# there: leave it out.
for p in "$dst"/lib/kiln/plugins/*.so; do
  # grep reads all of ldd's output: with -q it could quit early, and pipefail would take ldd's
  # SIGPIPE for "no match".
  if ldd "$p" 2>/dev/null | grep 'libLLVM' >/dev/null; then
    rm "$p"
    echo "carry-build.sh: left out $(basename "$p") (links LLVM)"
  fi
done
# Libraries from Debian packages a GPU image usually lacks (system and CUDA libraries stay out).
ldd "$dst"/bin/* "$dst"/lib/*.so* "$dst"/lib/kiln/plugins/*.so 2>/dev/null | awk '/=> \//{print $3}' | sort -u |
  while read -r so; do
    case "$so" in
      *tomlplusplus*|*libonnx*|*protobuf*) cp -L "$so" "$dst/lib/" ;;
    esac
  done
strip --strip-unneeded "$dst"/bin/* "$dst"/lib/*.so* "$dst"/lib/kiln/plugins/*.so 2>/dev/null || true
# The Python package is compiled there, for that machine's Python, by
# scripts/build-python-module.sh DEST PYTHON DEST/nanobind: carry nanobind's sources (no PyPI there).
root=$(cd "$(dirname "$0")/.." && pwd)
if nb=$("$root/.venv/bin/python" -c 'import nanobind, os; print(os.path.dirname(nanobind.__file__))' 2> /dev/null); then
  cp -r "$nb" "$dst/nanobind"
  rm -rf "$dst/nanobind/__pycache__"
fi
du -sh "$dst"
