#!/usr/bin/env bash
# Checks that ir/ and core/ stay small enough to read in an afternoon: at most
# KILN_LINE_BUDGET (default 12000) lines of C++ that are neither blank nor comments.
set -euo pipefail
root=${1:-$(dirname "$0")/..}
budget=${KILN_LINE_BUDGET:-12000}
count=$(find "$root/ir" "$root/core" -name '*.cpp' -o -name '*.h' | xargs cat |
        grep -vE '^\s*($|//)' | wc -l)
echo "ir/ + core/: $count lines of C++ (budget $budget)"
[ "$count" -le "$budget" ]
