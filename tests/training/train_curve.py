#!/usr/bin/env python3
"""Trains a small task with `kiln train` and checks every step's loss against a NumPy float64
implementation of the same model, loss and optimizer from the same initial weights and data
(tests/training/models.py). Also checks that a run resumed from a checkpoint repeats the
uninterrupted run's losses exactly.

  train_curve.py KILN TASK BACKEND [--steps N] [--tolerance 0.01] [--workdir DIR]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

SKIP_WITHOUT_GPU = False  # --skip-without-gpu: a CUDA backend without a device exits 77 (ctest's skip)
PASSES_AFTER = ["canonicalize", "cse", "fold-layout", "fuse-attention", "fuse-horizontal", "fuse-rows",
                "fuse-pointwise", "dce", "schedule-memory"]


def training_pipeline(optimizer, fp8=None, autocast=None, loss_scale=None, remat=None, decompose_losses=False,
                      parallel=None, backend="reference", targets=(), loss_chunks=None, schedule_lookahead=None):
    """A training pipeline's TOML: [chunk-cross-entropy in `loss_chunks` row chunks,] [fp8-training
    `fp8` (its options),] [autocast,] autodiff
    [with dynamic loss scaling from `loss_scale`,] accumulate-gemm, [remat `remat`,] the optimizer (`optimizer`,
    its options), [decompose-losses, which the CUDA backends need,] Kiln's standard passes
    (schedule-memory looking `schedule_lookahead` nodes ahead when given), then `parallel` (the
    lines of a [parallel] section) and the backend."""
    t = 'frontend = "kir"\n'
    if loss_chunks:
        t += f'\n[[passes]]\nname = "chunk-cross-entropy"\noptions = {{ chunks = {loss_chunks} }}\n'
    if fp8:
        t += f'\n[[passes]]\nname = "fp8-training"\noptions = {fp8}\n'
    if autocast:
        t += f'\n[[passes]]\nname = "autocast"\noptions = {{ dtype = "{autocast}" }}\n'
    t += '\n[[passes]]\nname = "autodiff"\n'
    if loss_scale:
        t += f'options = {{ loss-scale = "dynamic", init-scale = {loss_scale} }}\n'
    t += '\n[[passes]]\nname = "accumulate-gemm"\n'
    if remat:
        t += f'\n[[passes]]\nname = "remat"\noptions = {{ policy = "{remat}" }}\n'
    t += f'\n[[passes]]\nname = "optimizer"\noptions = {optimizer}\n'
    if decompose_losses:
        t += '\n[[passes]]\nname = "decompose-losses"\n'
    t += "".join(f'\n[[passes]]\nname = "{p}"\n' for p in PASSES_AFTER)
    if schedule_lookahead:
        t += f'options = {{ lookahead = {schedule_lookahead} }}\n'  # schedule-memory's, the last pass
    if parallel:
        t += "\n[parallel]\n" + parallel
    t += f'\n[backend]\nname = "{backend}"\n'
    if targets:
        t += "targets = [" + ", ".join(f'"{x}"' for x in targets) + "]\n"
    return t


def write_task(task, steps, workdir, autocast=None, remat=None, decompose_losses=False, loss_scale=None, fp8=None,
               fp8_exclude=(), loss_chunks=None):
    """The model .kir, its training pipeline and the data folder; returns their paths. With
    `autocast` (bf16 or f16) the pipeline starts with the autocast pass; with `remat` (a policy)
    the remat pass follows autodiff; `decompose_losses` adds that pass (for the CUDA backends,
    which lower no loss op); `loss_scale` (an initial scale) turns on dynamic loss scaling;
    `loss_chunks` puts chunk-cross-entropy first."""
    model = task()
    kir = os.path.join(workdir, "model.kir")
    with open(kir, "w") as f:
        f.write(model.kir())
    toml = os.path.join(workdir, "train.toml")
    fp8_options = None
    if fp8:
        exclude = ", ".join(f'"{e}"' for e in fp8_exclude)
        fp8_options = f'{{ format = "{fp8}", exclude = [{exclude}] }}'
    with open(toml, "w") as f:
        f.write(training_pipeline(task.PIPELINE_OPTIMIZER, fp8=fp8_options, autocast=autocast, loss_scale=loss_scale,
                                  remat=remat, decompose_losses=decompose_losses, loss_chunks=loss_chunks))
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    batches = task.batches(steps)
    for name, array in batches.items():
        np.save(os.path.join(data, name + ".npy"), array)
    return model, kir, toml, data, batches


def train(kiln, kir, toml, data, backend, steps, workdir, extra=()):
    out = os.path.join(workdir, f"losses-{backend}-{len(extra)}.npy")
    cmd = [kiln, "train", kir, "--pipeline", toml, "--data", data, "--steps", str(steps), "--backend", backend,
           "--loss-file", out, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        if SKIP_WITHOUT_GPU and "no CUDA device" in r.stderr:
            print(f"SKIP: backend {backend} found no CUDA device on this machine")
            sys.exit(77)
        sys.exit(f"FAIL: {' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    lines = [l for l in r.stdout.splitlines() if l.startswith("step ")]
    for l in r.stderr.splitlines():
        if l.startswith("remat:") and not extra:
            print("  " + l)
    return np.load(out), lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kiln")
    ap.add_argument("task", choices=sorted(models.TASKS))
    ap.add_argument("backend")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--workdir")
    ap.add_argument("--remat", choices=["none", "selective", "full"], help="add the remat pass after autodiff")
    ap.add_argument("--autocast", choices=["bf16", "f16"], help="contractions in low precision (vs the f64 reference)")
    ap.add_argument("--fp8", choices=["hybrid", "e4m3"], help="FP8 training (fp8-training pass) in this format")
    ap.add_argument("--fp8-exclude", action="append", default=[], help="contractions fp8-training leaves alone")
    ap.add_argument("--loss-chunks", type=int, help="chunk-cross-entropy: the head's loss in this many row chunks")
    ap.add_argument("--loss-scale", type=float, help="dynamic loss scaling from this initial scale (fp16)")
    ap.add_argument("--compile-only", metavar="TARGET", help="only build the training step for a CUDA target (no GPU needed)")
    ap.add_argument("--skip-without-gpu", action="store_true", help="exit 77 (ctest's skip) when there is no CUDA device")
    args = ap.parse_args()
    global SKIP_WITHOUT_GPU
    SKIP_WITHOUT_GPU = args.skip_without_gpu
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"kiln-train-{args.task}-")
    os.makedirs(workdir, exist_ok=True)
    task = models.TASKS[args.task]
    if args.compile_only:
        _, kir, toml, _, _ = write_task(task, 1, workdir, args.autocast, args.remat, True, fp8=args.fp8,
                                        fp8_exclude=args.fp8_exclude, loss_chunks=args.loss_chunks)
        out = os.path.join(workdir, "step.kiln")
        cmd = [args.kiln, "compile", kir, "--pipeline", toml, "--backend", args.backend, "--target", args.compile_only, "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(r.stdout + r.stderr)
        if r.returncode != 0 or os.path.getsize(out) == 0:
            sys.exit(f"FAIL: {' '.join(cmd)} exited {r.returncode}")
        if args.fp8:
            # The GEMM steps of the plan name their FP8 operand types: forward GEMMs read e4m3
            # activations, backward GEMMs the e5m2 gradient (hybrid).
            plan = open(out, "rb").read()
            fwd, bwd = plan.count(b"a_dtype=f8e4m3fn"), plan.count(b"a_dtype=f8e5m2")
            print(f"  cuBLASLt FP8 GEMMs: {fwd} with an e4m3 first operand, {bwd} with an e5m2 gradient")
            if fwd == 0 or (args.fp8 == "hybrid" and bwd == 0):
                sys.exit("FAIL: the training step has no FP8 GEMM")
            # Backward GEMMs (dx and dw of each layer) promote their sums to f32; forward ones
            # keep the fast accumulator.
            fast, precise = plan.count(b"fast_accum=1"), plan.count(b"fast_accum=0")
            print(f"  accumulation: {fast} fast (forward), {precise} in f32 (backward)")
            if args.fp8 == "hybrid" and (precise != 2 * fast or fast == 0):
                sys.exit("FAIL: expected two f32-accumulating backward GEMMs for each forward FP8 GEMM")
        print("PASS")
        return
    model, kir, toml, data, batches = write_task(task, args.steps, workdir, args.autocast, args.remat,
                                                 args.backend.startswith("cuda"), args.loss_scale, args.fp8,
                                                 args.fp8_exclude, args.loss_chunks)

    t0 = time.time()
    ref = model.reference_losses(batches, args.steps)
    t1 = time.time()
    got, lines = train(args.kiln, kir, toml, data, args.backend, args.steps, workdir)
    t2 = time.time()
    print(f"{args.task}{' fp8 ' + args.fp8 if args.fp8 else ''}{' autocast ' + args.autocast if args.autocast else ''}{' remat ' + args.remat if args.remat else ''} on {args.backend}: {args.steps} steps in {t2 - t1:.1f} s (numpy reference {t1 - t0:.1f} s)")
    print(f"  loss: step 1 {got[0]:.5f} (reference {ref[0]:.5f}), step {args.steps} {got[-1]:.5f} (reference {ref[-1]:.5f})")
    if len(lines) != args.steps:
        sys.exit(f"FAIL: expected {args.steps} progress lines, got {len(lines)}")
    rel = np.abs(got - ref) / np.abs(ref)
    worst = int(rel.argmax())
    print(f"  worst relative difference {rel[worst]:.2e} at step {worst + 1} (tolerance {args.tolerance})")
    if not np.all(np.isfinite(got)) or rel[worst] > args.tolerance:
        sys.exit(f"FAIL: the loss curve leaves the reference at step {worst + 1}: {got[worst]} vs {ref[worst]}")
    if not ref[-1] < 0.8 * ref[0] or not got[-1] < 0.8 * got[0]:
        sys.exit(f"FAIL: no learning ({ref[0]} -> {ref[-1]}, Kiln {got[0]} -> {got[-1]}): the task proves nothing")
    if args.fp8 and rel[worst] < 1e-4:
        sys.exit("FAIL: the FP8 run tracks the reference as closely as f32 does: nothing was quantized")

    # Resuming: half the steps with a checkpoint, then the rest from it, repeat the losses exactly
    # (on a CUDA backend the checkpoint is read from and written to the device's variables).
    half = max(1, min(args.steps // 2, 20))
    ckpt = os.path.join(workdir, "half.ckpt")
    first, _ = train(args.kiln, kir, toml, data, args.backend, half, workdir, ["--checkpoint", ckpt])
    rest, _ = train(args.kiln, kir, toml, data, args.backend, 2 * half, workdir, ["--resume", ckpt])
    resumed = np.concatenate([first, rest])
    if np.array_equal(resumed, got[: 2 * half]):
        print(f"  resumed at step {half}: the {2 * half} losses equal the uninterrupted run's")
    elif args.backend.startswith("cuda") and np.allclose(resumed, got[: 2 * half], rtol=1e-4, atol=0):
        # scatter_add (the embedding gradient) adds with atomics on the GPU: sums in another order.
        print(f"  resumed at step {half}: the {2 * half} losses match the uninterrupted run's within 1e-4")
    else:
        sys.exit(f"FAIL: the resumed run's losses differ:\n{resumed}\n{got[:2 * half]}")
    print("PASS")


if __name__ == "__main__":
    main()
