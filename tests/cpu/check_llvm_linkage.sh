#!/usr/bin/env bash
# Checks that only the cpu backend plugin has libLLVM in its NEEDED entries, in a build or
# install tree (both lay out bin/, lib/ and lib/kiln/plugins/ alike).
set -euo pipefail
tree=${1:?usage: check_llvm_linkage.sh TREE}
found_plugin=0
bad=()
for f in "$tree"/bin/* "$tree"/lib/*.so* "$tree"/lib/kiln/plugins/*.so; do
  [ -f "$f" ] || continue
  readelf -h "$f" >/dev/null 2>&1 || continue
  if readelf -d "$f" | grep -q 'NEEDED.*libLLVM'; then
    case "$(basename "$f")" in
      kiln-plugin-backend-cpu.so) found_plugin=1 ;;
      *) bad+=("$f") ;;
    esac
  fi
done
if [ ${#bad[@]} -ne 0 ]; then
  echo "check_llvm_linkage: these need libLLVM but only the cpu plugin may: ${bad[*]}" >&2
  exit 1
fi
if [ $found_plugin -ne 1 ]; then
  echo "check_llvm_linkage: $tree/lib/kiln/plugins/kiln-plugin-backend-cpu.so is missing or does not link libLLVM" >&2
  exit 1
fi
echo "check_llvm_linkage: only kiln-plugin-backend-cpu.so needs libLLVM"
