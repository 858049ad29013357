#!/usr/bin/env python3
"""Checks one parallel strategy on one model for meshes of 1, 2, 4 and 8 ranks: the per-rank
program `kiln run` simulates on the reference backend (every rank in one process) must give the
unsharded run's outputs, and for more than one rank the strategy must really have split
something (a sharded input or weight), so a strategy that silently replicates everything fails.

    check_parallel.py KILN MODEL STRATEGY [--ranks 1,2,4,8] [--batch B] [--sym NAME=SIZE]...
                      [--seed N] [--rtol R] [--atol A]

MODEL is a tests/models folder (model.onnx, input_*.npy, dims.txt) or a .kir file (random
inputs). STRATEGY is one of:
  dp        data-parallel, the batch split over the whole mesh
  dp-seq    data-parallel along dim 1 (the sequence), for models exported with batch 1
  dp-rows   data-parallel along dim 2 (image rows), for image models exported with batch 1
  tp        tensor-parallel (Megatron column/row projections)
  tp-sp     tensor-parallel with sequence parallelism
  dp-tp     a 2 x N/2 mesh: batch over dp, tensor-parallel over tp (meshes of 4 and more)
  dp-tp-seq the same with the dp split along dim 1
  auto      the planner's choice for the mesh's device count (objective throughput)
  auto-memory  the planner's choice for the smallest memory per rank
  pp        pipeline stages, one per rank, as many microbatches as stages (GPipe)
  pp-mb1    pipeline stages without microbatches
  pp-dp     2 pipeline stages, each split data-parallel over N/2 ranks (meshes of 4 and more)
  pp-tp     2 pipeline stages, each split tensor-parallel over N/2 ranks (meshes of 4 and more)
  pp-dp-tp  2 pipeline stages, each over a 2 x N/4 dp x tp mesh (meshes of 8)
  pp-tp-sp  pp-tp with sequence parallelism inside each stage
  FILE.toml a pipeline with a [parallel] section (and fusion passes), run on reference
--require TEXT fails a mesh of more than one rank whose per-rank program lacks TEXT (e.g. the
name suffix a rule gives the values it adds); --forbid TEXT fails one that holds it (e.g.
" all_gather(": the logits of a vocab-parallel loss are never gathered).
--before PASSES runs these passes (e.g. "autodiff") before the strategy, in the unsharded run too.
--batch B widens a model folder's saved inputs to batch B (rows rolled, so every row differs)
and binds the folder's `batch` dim to B.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from compare import allclose  # noqa: E402
from model_dir import output_files  # noqa: E402

CLEANUP = "canonicalize,cse"


def strategy_spec(name, ranks, syms=()):
    """The pass-list entry for `name` on a mesh of `ranks`, or None where it does not apply.
    A pipeline file (NAME.toml, its own mesh) runs once, as the mesh of 2 ranks. `syms`
    (NAME=SIZE) bind a .kir model's symbols for strategies that need static shapes."""
    if name.endswith(".toml"):
        return name if ranks == 2 else None
    if name in ("pp", "pp-mb1"):
        dims = ",dims=[" + ",".join(f'"{s}"' for s in syms) + "]" if syms else ""
        micro = ",microbatches=1" if name == "pp-mb1" else ""
        return f'pipeline{{mesh="pp={ranks}"{micro}{dims},print-stages=false}}'
    if name in ("pp-dp", "pp-tp", "pp-dp-tp", "pp-tp-sp"):
        if ranks < (8 if name == "pp-dp-tp" else 4):
            return None
        dims = ",dims=[" + ",".join(f'"{s}"' for s in syms) + "]" if syms else ""
        inner = {"pp-dp": f"dp={ranks // 2}", "pp-tp": f"tp={ranks // 2}", "pp-tp-sp": f"tp={ranks // 2}",
                 "pp-dp-tp": f"dp=2, tp={ranks // 4}"}[name]
        sp = ",sequence-parallel=true" if name == "pp-tp-sp" else ""
        return f'pipeline{{mesh="pp=2, {inner}"{sp}{dims},print-stages=false}}'
    if name == "dp":
        return f'data-parallel{{mesh="dp={ranks}"}}'
    if name == "dp-seq":
        return f'data-parallel{{mesh="dp={ranks}",batch-dim=1}}'
    if name == "dp-rows":
        return f'data-parallel{{mesh="dp={ranks}",batch-dim=2}}'
    if name == "tp":
        return f'tensor-parallel{{mesh="tp={ranks}"}}'
    if name == "tp-sp":
        return f'tensor-parallel{{mesh="tp={ranks}",sequence-parallel=true}}'
    if name == "auto":
        return f'auto{{devices={ranks}}}'
    if name == "auto-memory":
        return f'auto{{devices={ranks},objective="memory"}}'
    if name in ("dp-tp", "dp-tp-seq"):
        if ranks < 4:
            return None
        dim = ",batch-dim=1" if name == "dp-tp-seq" else ""
        return f'tensor-parallel{{mesh="dp=2, tp={ranks // 2}",data-axis="dp"{dim}}}'
    raise SystemExit(f"unknown strategy '{name}'")


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # the command and the end of what it said (IR dumps are long)
        sys.stderr.write(" ".join(cmd) + "\n" + (proc.stdout + proc.stderr)[-3000:])
    return proc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kiln")
    ap.add_argument("model")
    ap.add_argument("strategy")
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--sym", action="append", default=[])
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--outputs", default="", help="output names of a .kir model, comma-separated")
    ap.add_argument("--require", action="append", default=[], help="text the per-rank program must hold")
    ap.add_argument("--forbid", action="append", default=[], help="text the per-rank program must not hold")
    ap.add_argument("--before", default="", help="passes before the strategy (and in the unsharded run)")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-5)
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        common = []
        if os.path.isdir(a.model):
            model = os.path.join(a.model, "model.onnx")
            syms = dict(s.split("=", 1) for s in a.sym)
            dims = os.path.join(a.model, "dims.txt")
            if os.path.exists(dims):
                for line in open(dims):
                    if line.strip():
                        k, v = line.strip().split("=", 1)
                        syms.setdefault(k, v)
            if a.batch:
                syms["batch"] = str(a.batch)
            for k, v in syms.items():
                common += ["--sym", f"{k}={v}"]
            for path in sorted(os.listdir(a.model)):
                if not (path.startswith("input_") and path.endswith(".npy")):
                    continue
                x = np.load(os.path.join(a.model, path))
                if a.batch and x.shape[0] != a.batch:
                    rows = [np.roll(x, k, axis=-1) for k in range(a.batch)]
                    x = np.concatenate(rows, axis=0)[: a.batch]
                    path_out = os.path.join(tmp, path)
                    np.save(path_out, x)
                else:
                    path_out = os.path.abspath(os.path.join(a.model, path))
                common += ["--input", f"{path[len('input_'):-len('.npy')]}=@{path_out}"]
            names = [n for n, _ in output_files(a.model)]
        else:
            model = a.model
            for s in a.sym:
                common += ["--sym", s]
            common += ["--random-inputs", "--seed", str(a.seed)]
            names = [n for n in a.outputs.split(",") if n]
        if not names:
            print("FAIL: no output names (a .kir model needs --outputs)")
            return 1

        def outputs_of(tag, passes, extra=()):
            files = {n: os.path.join(tmp, f"{tag}-{n}.npy") for n in names}
            how = ["--pipeline", passes, "--backend", "reference"] if passes.endswith(".toml") else ["--passes", passes]
            cmd = [a.kiln, "run", model] + how + common + list(extra)
            for n, f in files.items():
                cmd += ["--output", f"{n}=@{f}"]
            proc = run(cmd)
            if proc.returncode != 0:
                return None, proc
            return {n: np.load(f) for n, f in files.items()}, proc

        cleanup = CLEANUP + ("," + a.before if a.before else "")
        want, proc = outputs_of("whole", cleanup)
        if want is None:
            print("FAIL: the unsharded run failed")
            return 1
        ok = True
        for ranks in [int(r) for r in a.ranks.split(",")]:
            spec = strategy_spec(a.strategy, ranks, [] if os.path.isdir(a.model) else a.sym)
            if spec is None:
                continue
            passes = spec if spec.endswith(".toml") else f"{cleanup},{spec}"
            got, proc = outputs_of(f"r{ranks}", passes, ["--print-ir-after-all"])
            if got is None:
                print(f"FAIL {a.strategy} on {ranks} ranks: kiln run exited {proc.returncode}")
                ok = False
                continue
            # The per-rank program right after the strategy: how much it split.
            strategy = spec.split("{")[0] if not spec.endswith(".toml") else ""
            text = proc.stderr.split(f"// ----- IR after {strategy}")[-1].split("// ----- IR after")[0]
            signature = text.split(") ->")[0]
            split_inputs = len(re.findall(r"<[^>]*S\(", signature))
            counts = {op: text.count(f" {op}(") for op in
                      ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_shard", "send")}
            for n in names:
                v = allclose(want[n], got[n], a.rtol, a.atol)
                status = "ok" if v.ok else "FAIL"
                print(f"{status} {a.strategy} {ranks} ranks: {n} max |diff| {v.measure:.3g}"
                      f"{'' if v.ok else ' ' + v.why}")
                ok &= v.ok
            print(f"   per-rank program: {split_inputs} split inputs, " +
                  ", ".join(f"{c} {op}" for op, c in counts.items()))
            if ranks > 1:
                data_only = a.strategy.startswith("dp") and "tp" not in a.strategy
                split = split_inputs if data_only else counts["local_shard"]
                if a.strategy.endswith(".toml") or a.strategy.startswith("auto"):
                    split = split_inputs + counts["local_shard"] + counts["send"]
                if a.strategy.startswith("pp"):  # stages pass activations on
                    split = counts["send"]
                    if "tp" in a.strategy:  # and split their weights
                        split = min(split, counts["local_shard"])
                    if "dp" in a.strategy:  # and their batch
                        split = min(split, split_inputs)
                for want_text in a.require:
                    if want_text not in text:
                        print(f"FAIL {a.strategy} on {ranks} ranks: the per-rank program has no '{want_text}'")
                        ok = False
                for bad_text in a.forbid:
                    if bad_text in text:
                        print(f"FAIL {a.strategy} on {ranks} ranks: the per-rank program holds '{bad_text}'")
                        ok = False
                if split == 0:
                    print(f"FAIL {a.strategy} on {ranks} ranks split nothing: every rank computes the whole model")
                    ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
