#!/bin/sh
# One artifact for every rank of a pipeline: kiln compile without --rank writes each distinct
# rank program once (ranks of a stage share theirs), kiln inspect lists which rank runs which,
# and a run started with another number of ranks is refused before any device is touched.
#   check_pipeline_artifact.sh KILN MODEL.kir OUTDIR MESH RANKS PROGRAMS
set -eu
kiln=$1 model=$2 out=$3 mesh=$4 ranks=$5 programs=$6
art="$out/pipeline-$(echo "$mesh" | tr -c 'a-z0-9' '_').kiln"
passes="canonicalize,cse,pipeline{mesh=\"$mesh\",dims=[\"B=8\"],print-stages=false}"
"$kiln" compile "$model" --sym B=8 --passes "$passes" --backend cuda-sm90 --target sm_90a -o "$art" >/dev/null
info=$("$kiln" inspect "$art")
echo "$info" | grep -q "per-rank programs: $programs for $ranks ranks" || { echo "FAIL: inspect says:"; echo "$info" | head -5; exit 1; }
json=$("$kiln" inspect "$art" --json)
echo "$json" | grep -q '"rank_programs": \[' || { echo "FAIL: no rank_programs in the JSON"; exit 1; }
wrong=$((ranks + 1))
if msg=$(env RANK=0 WORLD_SIZE=$wrong LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "$kiln" bench "$art" 2>&1); then
  echo "FAIL: kiln bench ran with $wrong ranks"; exit 1
fi
echo "$msg" | grep -q "holds the programs of $ranks ranks (each rank runs its own), but torchrun started $wrong ranks: start exactly $ranks processes" ||
  { echo "FAIL: kiln bench said: $msg"; exit 1; }
if msg=$("$kiln" bench "$art" 2>&1); then echo "FAIL: kiln bench ran without a launcher"; exit 1; fi
echo "$msg" | grep -q "but this run started 1 rank: start exactly $ranks processes" || { echo "FAIL: kiln bench said: $msg"; exit 1; }
# --rank K still writes one rank's program alone.
"$kiln" compile "$model" --sym B=8 --passes "$passes" --backend cuda-sm90 --target sm_90a --rank 1 -o "$out/rank1.kiln" >/dev/null
"$kiln" inspect "$out/rank1.kiln" | grep -q "^mesh: " || { echo "FAIL: --rank 1 did not write a plain artifact"; exit 1; }
echo PASS
