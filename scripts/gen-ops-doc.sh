#!/usr/bin/env bash
# Regenerates docs/ops.md, the catalogue of Kiln's core ops, from the op table:
# `kiln ops --markdown --core`. Run it after adding or changing an op (`make docs` does).
#   scripts/gen-ops-doc.sh [KILN]      KILN defaults to build/bin/kiln
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kiln=${1:-$root/build/bin/kiln}
if [ ! -x "$kiln" ]; then
  echo "gen-ops-doc: no kiln binary at $kiln; build it first (cmake --build build --target kiln)" >&2
  exit 1
fi
tmp=$(mktemp "$root/docs/ops.md.XXXXXX")
trap 'rm -f "$tmp"' EXIT
"$kiln" ops --markdown --core > "$tmp"
mv "$tmp" "$root/docs/ops.md"
trap - EXIT
echo "wrote $root/docs/ops.md"
