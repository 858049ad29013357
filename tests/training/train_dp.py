#!/usr/bin/env python3
"""Data-parallel training with `kiln train`: a task of models.py trained on 2 and 4 ranks (the
reference backend runs every rank in this process) must give the loss curve of the 1-rank run on
the full batch within fp32 tolerance, and end with the same weights; each rank's replicated
weights must hold the same bits (the mesh's checkpoint refuses replicas that differ); a
checkpoint written once by a run on one mesh resumes on another; a batch the ranks do not
divide, and a one-process-per-rank backend started without the right launcher, are clear errors.

  train_dp.py KILN TASK [--ranks 2 4] [--zero] [--steps N] [--workdir DIR]

--zero shards the optimizer state (data-parallel's shard-optimizer-state, ZeRO-1).
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from models import read_checkpoint  # noqa: E402
from train_curve import training_pipeline  # noqa: E402


FP8 = None  # --fp8: the fp8-training pass's options


def write_pipeline(path, task, ranks, zero, options=""):
    """autodiff, the optimizer and Kiln's standard passes; with `ranks`, the data-parallel
    strategy at its default place (after autodiff)."""
    parallel = None
    if ranks:
        parallel = f'strategy = "data-parallel"\nmesh = "dp={ranks}"\n'
        opts = ", ".join(o for o in ("shard-optimizer-state = true" if zero else "", options) if o)
        if opts:
            parallel += f"options = {{ {opts} }}\n"
    with open(path, "w") as f:
        f.write(training_pipeline(task.PIPELINE_OPTIMIZER, fp8=FP8, parallel=parallel))


def kiln_train(kiln, kir, toml, data, steps, workdir, tag, extra=(), expect_ok=True):
    losses = os.path.join(workdir, f"losses-{tag}.npy")
    cmd = [kiln, "train", kir, "--pipeline", toml, "--data", data, "--steps", str(steps), "--loss-file", losses,
           "--reproducer-dir", workdir, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if expect_ok and r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    if not expect_ok:
        return r
    return np.load(losses)


def compare(what, got, want, rtol):
    worst = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30))
    print(f"  {what}: worst relative difference {worst:.2e} (tolerance {rtol:g})")
    if not np.all(np.isfinite(got)) or worst > rtol:
        sys.exit(f"FAIL: {what} differs from the 1-rank run: {worst:.3e} > {rtol:g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kiln")
    ap.add_argument("task", choices=sorted(models.TASKS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--zero", action="store_true", help="shard the optimizer state (ZeRO-1)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rtol", type=float, default=1e-5, help="loss curves and weights against the 1-rank run")
    # AdamW moves a weight whose true gradient is 0 (GPT's key biases: softmax ignores a shift
    # of the keys) by lr per step in the direction of rounding noise, which differs with the
    # order of the sums; such weights agree to about 1e-4 of their size, the others to 1e-6.
    ap.add_argument("--weight-tol", type=float, default=1e-5,
                    help="final weights and optimizer state against the 1-rank run's, relative to each tensor's largest value")
    ap.add_argument("--fp8", action="store_true", help="FP8 training (hybrid, the head excluded) before autodiff")
    ap.add_argument("--workdir")
    args = ap.parse_args()
    global FP8
    if args.fp8:
        FP8 = '{ format = "hybrid", exclude = ["logits"] }'
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"kiln-dp-{args.task}-")
    os.makedirs(workdir, exist_ok=True)
    task = models.TASKS[args.task]
    model = task()
    kir = os.path.join(workdir, "model.kir")
    with open(kir, "w") as f:
        f.write(model.kir())
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    for name, array in task.batches(args.steps).items():
        np.save(os.path.join(data, name + ".npy"), array)
    steps, half = args.steps, args.steps // 2

    # The 1-rank run on the full batch: no parallel strategy at all.
    single = os.path.join(workdir, "single.toml")
    write_pipeline(single, task, 0, False)
    ckpt1 = os.path.join(workdir, "single.ckpt")
    want = kiln_train(args.kiln, kir, single, data, steps, workdir, "single", ["--checkpoint", ckpt1])
    if not want[-1] < want[0]:
        sys.exit(f"FAIL: the 1-rank run did not learn ({want[0]} -> {want[-1]}): the comparison proves nothing")
    state1 = read_checkpoint(ckpt1)
    mode = "ZeRO-1 (sharded optimizer state)" if args.zero else "all-reduced gradients"
    print(f"{args.task}, {steps} steps, batch {task.B}, {mode}: 1 rank loss {want[0]:.5f} -> {want[-1]:.5f}")

    for n in args.ranks:
        toml = os.path.join(workdir, f"dp{n}.toml")
        write_pipeline(toml, task, n, args.zero)
        ckpt = os.path.join(workdir, f"dp{n}.ckpt")
        got = kiln_train(args.kiln, kir, toml, data, steps, workdir, f"dp{n}", ["--checkpoint", ckpt])
        print(f" {n} ranks (batch {task.B // n} each): loss {got[0]:.5f} -> {got[-1]:.5f}")
        compare(f"{n}-rank loss curve", got, want, args.rtol)
        # Written once, from every rank's state: replicated weights equal bit for bit on every
        # rank (else the checkpoint is refused), sharded optimizer state joined.
        state = read_checkpoint(ckpt)
        if sorted(state) != sorted(state1):
            sys.exit(f"FAIL: the {n}-rank checkpoint holds {sorted(state)}, the 1-rank one {sorted(state1)}")
        worst, where = max((np.max(np.abs(state[k] - v)) / max(np.max(np.abs(v)), 1e-30), k) for k, v in state1.items())
        print(f"  {n}-rank checkpoint: {len(state)} tensors, worst difference to the 1-rank run's {worst:.2e} "
              f"of the tensor's largest value ({where}; tolerance {args.weight_tol:g})")
        if worst > args.weight_tol:
            sys.exit(f"FAIL: the {n}-rank run's '{where}' leaves the 1-rank run's ({worst:.3e})")
        # Across meshes: half the steps on n ranks, the rest on 1 rank from its checkpoint.
        mid = os.path.join(workdir, f"dp{n}-half.ckpt")
        first = kiln_train(args.kiln, kir, toml, data, half, workdir, f"dp{n}-half", ["--checkpoint", mid])
        rest = kiln_train(args.kiln, kir, single, data, steps, workdir, f"dp{n}-rest", ["--resume", mid])
        compare(f"{n} ranks for {half} steps, then 1 rank from the checkpoint", np.concatenate([first, rest]), want,
                args.rtol)
        # ... and 1 rank first, n ranks from its checkpoint.
        mid1 = os.path.join(workdir, f"single-half-{n}.ckpt")
        first = kiln_train(args.kiln, kir, single, data, half, workdir, f"single-half-{n}", ["--checkpoint", mid1])
        rest = kiln_train(args.kiln, kir, toml, data, steps, workdir, f"dp{n}-resumed", ["--resume", mid1])
        compare(f"1 rank for {half} steps, then {n} ranks from the checkpoint", np.concatenate([first, rest]), want,
                args.rtol)

    # Gradient buckets: every gradient of these small models fits one, so the step all-reduces
    # once for the gradients (plus the loss and its count of targets); bucket-mb = 0 once each.
    if not args.zero:
        n = args.ranks[0]
        counts = {}
        for bucket in (25, 0):
            toml = os.path.join(workdir, f"dp{n}-bucket{bucket}.toml")
            write_pipeline(toml, task, n, False, f"bucket-mb = {bucket}")
            r = subprocess.run([args.kiln, "opt", kir, "--pipeline", toml], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                sys.exit(f"FAIL: kiln opt with bucket-mb = {bucket} exited {r.returncode}\n{r.stderr}")
            counts[bucket] = r.stdout.count("= all_reduce(")
            # Data parallelism moves gradients (and losses, counts, FP8 amaxes), never activations.
            moved = [op for op in ("all_gather", "all_to_all", "local_shard", "reduce_scatter") if f"= {op}(" in r.stdout]
            if moved:
                sys.exit(f"FAIL: the data-parallel step moves activations: it has {moved}")
        grads = sum(1 for k in state1 if k.endswith((".exp_avg", ".momentum_buffer")))  # one per trained weight
        print(f"  all-reduces per step: {counts[25]} with 25 MiB buckets, {counts[0]} with one per gradient ({grads} weights)")
        if not counts[0] - counts[25] == grads - 1:
            sys.exit(f"FAIL: bucketing should turn {grads} gradient all-reduces into 1: {counts}")

    # A batch the ranks do not divide.
    bad = task.B + 1 if task.B % (task.B + 1) else task.B - 1
    toml = os.path.join(workdir, f"dp{bad}.toml")
    write_pipeline(toml, task, bad, args.zero)
    r = kiln_train(args.kiln, kir, toml, data, 1, workdir, "bad", expect_ok=False)
    if r.returncode == 0 or "does not split evenly over" not in r.stderr:
        sys.exit(f"FAIL: batch {task.B} on {bad} ranks: expected a clear error, got exit {r.returncode}\n{r.stderr}")
    print(f"  batch {task.B} on {bad} ranks: {r.stderr.strip().splitlines()[-1]}")
    # A backend that runs one rank per process, started without a launcher or with too few ranks.
    toml = os.path.join(workdir, f"dp{args.ranks[0]}.toml")
    launched = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    r = subprocess.run([args.kiln, "train", kir, "--pipeline", toml, "--data", data, "--steps", "1"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, **launched})
    if r.returncode == 0 or "runs every rank of mesh" not in r.stderr:
        sys.exit(f"FAIL: backend reference under a launcher: expected a refusal, got exit {r.returncode}\n{r.stderr}")
    print(f"  backend reference under a launcher: {r.stderr.strip().splitlines()[-1]}")
    for env, want in (({}, "no launcher started the ranks"),
                      ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
                       "torchrun started 3")):
        r = subprocess.run([args.kiln, "train", kir, "--pipeline", toml, "--data", data, "--steps", "1", "--backend", "null"],
                           capture_output=True, text=True, timeout=60, env={**os.environ, **env})
        if r.returncode == 0 or want not in r.stderr or "kiln launch -n" not in r.stderr:
            sys.exit(f"FAIL: backend null, {env or 'no launcher'}: expected '{want}', got exit {r.returncode}\n{r.stderr}")
        print(f"  backend null, {env or 'no launcher'}: {r.stderr.strip().splitlines()[-1]}")
    print("PASS")


if __name__ == "__main__":
    main()
