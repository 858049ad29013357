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
                      parallel=None, backend="reference", targets=(), loss_chunks=None, schedule_lookahead=None,
                      loss_align=None):
    """A training pipeline's TOML: [chunk-cross-entropy in `loss_chunks` row chunks, its vocabulary
    padded to a multiple of `loss_align` when given,] [fp8-training
    `fp8` (its options),] [autocast,] autodiff
    [with dynamic loss scaling from `loss_scale`,] accumulate-gemm, [remat `remat`,] the optimizer (`optimizer`,
    its options), [decompose-losses for what the CUDA backends do not lower (mse_loss; they lower
    cross_entropy and its gradient themselves),] Kiln's standard passes
    (schedule-memory looking `schedule_lookahead` nodes ahead when given), then `parallel` (the
    lines of a [parallel] section) and the backend."""
    t = 'frontend = "kir"\n'
    if loss_chunks:
        align = "" if loss_align is None else f", align = {loss_align}"
        t += f'\n[[passes]]\nname = "chunk-cross-entropy"\noptions = {{ chunks = {loss_chunks}{align} }}\n'
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
        t += '\n[[passes]]\nname = "decompose-losses"\noptions = { ops = ["mse_loss"] }\n'
    t += "".join(f'\n[[passes]]\nname = "{p}"\n' for p in PASSES_AFTER)
    if schedule_lookahead:
        t += f'options = {{ lookahead = {schedule_lookahead} }}\n'  # schedule-memory's, the last pass
    if parallel:
        t += "\n[parallel]\n" + parallel
    t += f'\n[backend]\nname = "{backend}"\n'
    if targets:
        t += "targets = [" + ", ".join(f'"{x}"' for x in targets) + "]\n"
    return t


def with_copies(optimizer):
    """The optimizer's options (a TOML inline table) with low-precision-copies on."""
    return optimizer.rstrip()[:-1].rstrip() + ", low-precision-copies = true }"


def write_task(task, steps, workdir, autocast=None, remat=None, decompose_losses=False, loss_scale=None, fp8=None,
               fp8_exclude=(), loss_chunks=None, loss_align=None, toml_name="train.toml", copies=False):
    """The model .kir, its training pipeline and the data folder; returns their paths. With
    `autocast` (bf16 or f16) the pipeline starts with the autocast pass; with `remat` (a policy)
    the remat pass follows autodiff; `decompose_losses` adds that pass (for the CUDA backends,
    which lower no loss op); `loss_scale` (an initial scale) turns on dynamic loss scaling;
    `loss_chunks` puts chunk-cross-entropy first."""
    model = task()
    kir = os.path.join(workdir, "model.kir")
    with open(kir, "w") as f:
        f.write(model.kir())
    toml = os.path.join(workdir, toml_name)
    fp8_options = None
    if fp8:
        exclude = ", ".join(f'"{e}"' for e in fp8_exclude)
        fp8_options = f'{{ format = "{fp8}", exclude = [{exclude}] }}'
    with open(toml, "w") as f:
        f.write(training_pipeline(with_copies(task.PIPELINE_OPTIMIZER) if copies else task.PIPELINE_OPTIMIZER,
                                  fp8=fp8_options, autocast=autocast, loss_scale=loss_scale,
                                  remat=remat, decompose_losses=decompose_losses, loss_chunks=loss_chunks,
                                  loss_align=loss_align))
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


def gemm_steps(artifact):
    """The plan's cuBLASLt GEMM steps, each a dict of its fields (m, n, k, lda, dtype, ...)."""
    steps = []
    for line in open(artifact, "rb").read().split(b"\n"):
        if line.startswith(b"step gemm "):
            steps.append(dict(f.split("=", 1) for f in line.decode().split()[2:] if "=" in f))
    return steps


def plan_lines(artifact):
    return [l.decode(errors="replace") for l in open(artifact, "rb").read().split(b"\n")
            if l.startswith((b"step ", b"buffer ", b"variable "))]


def check_copies_fused(lines, plain_lines):
    """Every low-precision copy of the plan is written in place by the kernel that writes its
    weight (its optimizer update), and the plan casts that many fewer weights than the plan
    without copies."""
    base = {}
    for l in lines:
        if l.startswith("buffer "):
            f = l.split()
            attrs = dict(x.split("=", 1) for x in f[2:] if "=" in x)
            base["b" + f[1]] = "b" + attrs["base"] if attrs.get("kind") == "alias" else "b" + f[1]

    def root(b):
        while base.get(b, b) != b:
            b = base[b]
        return b

    variables = {}
    for l in lines:
        if l.startswith("variable "):
            f = l.split()
            attrs = dict(x.split("=", 1) for x in f[2:])
            variables[f[1]] = ("b" + attrs["buffer"], attrs.get("copy_of"))
    copies = {name: v for name, v in variables.items() if v[1]}
    if not copies:
        sys.exit("FAIL: the plan declares no low-precision copy (variable ... copy_of=)")
    launches = []
    for l in lines:
        if l.startswith("step launch "):
            args = next((x.split("=", 1)[1] for x in l.split() if x.startswith("args=")), "")
            launches.append({root(b) for b in args.split(",") if b})
        if l.startswith("step copy ") and any(f"dst={b}" in l.split() for b, _ in copies.values()):
            sys.exit(f"FAIL: a copy step writes a low-precision copy instead of its update's kernel: {l}")
    for name, (buf, master) in copies.items():
        if not any(buf in a and variables[master][0] in a for a in launches):
            sys.exit(f"FAIL: no kernel writes '{name}' with its weight '{master}'")
    casts = lambda ls: sum(1 for l in ls if l.startswith("step launch kernel=") and l.split()[2].endswith("_cast"))
    print(f"  low-precision copies: {len(copies)} written by their weights' update kernels; cast launches "
          f"{casts(plain_lines)} -> {casts(lines)}, steps {sum(l.startswith('step ') for l in plain_lines)} -> "
          f"{sum(l.startswith('step ') for l in lines)}")
    if casts(plain_lines) - casts(lines) < len(copies):
        sys.exit("FAIL: the plan with copies does not cast fewer weights")


def check_head_alignment(kiln, kir, pipelines, backend, target, vocab, workdir):
    """Compiles the step with the vocabulary padded (pipelines["padded"]) and not; every head GEMM
    (one with the vocabulary, or its padding, as m, n or k) of the padded plan must have leading
    dimensions of a multiple of 16 bytes, and none may still span the odd vocabulary."""
    size = {"f32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
    padded_vocab = -(-vocab // 64) * 64
    found = {}
    for mode, toml in pipelines.items():
        out = os.path.join(workdir, f"step-{mode}.kiln")
        cmd = [kiln, "compile", kir, "--pipeline", toml, "--backend", backend, "--target", target, "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"FAIL: {' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
        head, unaligned = [], []
        for s in gemm_steps(out):
            if not {vocab, padded_vocab} & {int(s["m"]), int(s["n"]), int(s["k"])}:
                continue
            head.append(s)
            elem = {"lda": s.get("a_dtype", s["dtype"]), "ldb": s.get("b_dtype", s["dtype"]), "ldd": s["dtype"],
                    "ldc": s["dtype"]}
            if any(ld in s and int(s[ld]) * size[t] % 16 for ld, t in elem.items()) or vocab in (int(s["m"]), int(s["n"]), int(s["k"])):
                unaligned.append(s)
        os.remove(out)
        shapes = sorted({f"{s['m']}x{s['n']}x{s['k']} lda={s['lda']} ldb={s['ldb']} ldd={s['ldd']}" for s in head})
        print(f"  {mode}: {len(head)} head GEMMs, {len(unaligned)} unaligned or {vocab} wide: " + "; ".join(shapes))
        found[mode] = (head, unaligned)
    if not found["unpadded"][1]:
        sys.exit("FAIL: the unpadded plan has no unaligned head GEMM: the check proves nothing")
    head, unaligned = found["padded"]
    if unaligned or len(head) < len(found["unpadded"][0]):
        sys.exit(f"FAIL: the padded plan's head GEMMs: {len(unaligned)} of {len(head)} unaligned")


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
    ap.add_argument("--loss-align", type=int, help="chunk-cross-entropy's option 'align' (0: never pad the vocabulary)")
    ap.add_argument("--vocab", type=int, help="the gpt task with this vocabulary (an odd one gets a padded head)")
    ap.add_argument("--batch", type=int, help="the gpt task with this batch size")
    ap.add_argument("--against-unpadded", type=float, metavar="RTOL",
                    help="train again with align = 0 and require the same losses within RTOL")
    ap.add_argument("--check-head-alignment", action="store_true",
                    help="with --compile-only: the head GEMMs of the padded plan have aligned leading dimensions")
    ap.add_argument("--loss-scale", type=float, help="dynamic loss scaling from this initial scale (fp16)")
    ap.add_argument("--low-precision-copies", action="store_true",
                    help="the optimizer keeps the weights' low-precision copies; the losses must equal those without, "
                         "and a checkpoint saved without them must resume with them")
    ap.add_argument("--compile-only", metavar="TARGET", help="only build the training step for a CUDA target (no GPU needed)")
    ap.add_argument("--skip-without-gpu", action="store_true", help="exit 77 (ctest's skip) when there is no CUDA device")
    args = ap.parse_args()
    global SKIP_WITHOUT_GPU
    SKIP_WITHOUT_GPU = args.skip_without_gpu
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"kiln-train-{args.task}-")
    os.makedirs(workdir, exist_ok=True)
    task = models.TASKS[args.task]
    if args.vocab or args.batch:
        task = type(task.__name__, (task,), {**({"V": args.vocab} if args.vocab else {}),
                                             **({"B": args.batch} if args.batch else {})})
    if args.compile_only and args.check_head_alignment:
        pipelines = {}
        for mode, align in (("padded", args.loss_align), ("unpadded", 0)):
            _, kir, pipelines[mode], _, _ = write_task(task, 1, workdir, args.autocast, args.remat, True,
                                                       loss_chunks=args.loss_chunks, loss_align=align,
                                                       toml_name=f"train-{mode}.toml")
        check_head_alignment(args.kiln, kir, pipelines, args.backend, args.compile_only, task.V, workdir)
        print("PASS")
        return
    if args.compile_only:
        _, kir, toml, _, _ = write_task(task, 1, workdir, args.autocast, args.remat, True, fp8=args.fp8,
                                        fp8_exclude=args.fp8_exclude, loss_chunks=args.loss_chunks,
                                        copies=args.low_precision_copies)
        out = os.path.join(workdir, "step.kiln")
        cmd = [args.kiln, "compile", kir, "--pipeline", toml, "--backend", args.backend, "--target", args.compile_only, "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(r.stdout + r.stderr)
        if r.returncode != 0 or os.path.getsize(out) == 0:
            sys.exit(f"FAIL: {' '.join(cmd)} exited {r.returncode}")
        if args.low_precision_copies:
            _, _, toml0, _, _ = write_task(task, 1, workdir, args.autocast, args.remat, True, fp8=args.fp8,
                                           fp8_exclude=args.fp8_exclude, loss_chunks=args.loss_chunks,
                                           toml_name="train-no-copies.toml")
            out0 = os.path.join(workdir, "step-no-copies.kiln")
            cmd0 = [args.kiln, "compile", kir, "--pipeline", toml0, "--backend", args.backend, "--target",
                    args.compile_only, "-o", out0]
            r0 = subprocess.run(cmd0, capture_output=True, text=True)
            if r0.returncode != 0:
                sys.exit(f"FAIL: {' '.join(cmd0)} exited {r0.returncode}\n{r0.stderr}")
            check_copies_fused(plan_lines(out), plan_lines(out0))
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
                                                 args.fp8_exclude, args.loss_chunks, args.loss_align,
                                                 copies=args.low_precision_copies)

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
    if args.against_unpadded is not None:
        # The padded head's logits never reach the loss: the same curve as the unpadded head's.
        _, _, toml0, _, _ = write_task(task, args.steps, workdir, args.autocast, args.remat,
                                       args.backend.startswith("cuda"), args.loss_scale, args.fp8, args.fp8_exclude,
                                       args.loss_chunks, 0, toml_name="train-unpadded.toml")
        # ... and it was padded: the pass gives the head a weight of the padded vocabulary.
        padded = -(-task.V // (args.loss_align or 64)) * (args.loss_align or 64)
        align = f",align={args.loss_align}" if args.loss_align else ""
        r = subprocess.run([args.kiln, "opt", kir, "--passes", f"chunk-cross-entropy{{chunks={args.loss_chunks or 1}{align}}}"],
                           capture_output=True, text=True)
        if f"pad(%wte) {{pads = [0, 0, {padded - task.V}, 0]}}" not in r.stdout:
            sys.exit(f"FAIL: chunk-cross-entropy did not pad the head's weight to {padded} rows\n{r.stderr}")
        plain, _ = train(args.kiln, kir, toml0, data, args.backend, args.steps, workdir)
        diff = np.abs(got - plain) / np.abs(plain)
        print(f"  against the unpadded head: worst relative difference {diff.max():.2e} (tolerance {args.against_unpadded})")
        if diff.max() > args.against_unpadded:
            sys.exit(f"FAIL: the padded head's losses leave the unpadded one's at step {int(diff.argmax()) + 1}")

    def same_losses(a, b):
        """Equal; on a CUDA backend within 1e-4 (scatter_add, the embedding gradient, adds with
        atomics on the GPU: sums in another order from one run to the next)."""
        return np.array_equal(a, b) or (args.backend.startswith("cuda") and np.allclose(a, b, rtol=1e-4, atol=0))

    def resumed(first_toml, then_toml, name):
        """Half the steps with `first_toml` saving a checkpoint, then the rest from it with `then_toml`."""
        half = max(1, min(args.steps // 2, 20))
        ckpt = os.path.join(workdir, name)
        first, _ = train(args.kiln, kir, first_toml, data, args.backend, half, workdir, ["--checkpoint", ckpt])
        rest, _ = train(args.kiln, kir, then_toml, data, args.backend, 2 * half, workdir, ["--resume", ckpt])
        return half, np.concatenate([first, rest])

    if args.low_precision_copies:
        # The copies hold what the casts computed: every step's loss is the same, bit for bit.
        _, _, toml0, _, _ = write_task(task, args.steps, workdir, args.autocast, args.remat,
                                       args.backend.startswith("cuda"), args.loss_scale, args.fp8, args.fp8_exclude,
                                       args.loss_chunks, args.loss_align, toml_name="train-no-copies.toml")
        plain, _ = train(args.kiln, kir, toml0, data, args.backend, args.steps, workdir)
        if not same_losses(got, plain):
            bad = int(np.argmax(got != plain))
            sys.exit(f"FAIL: with low-precision copies the loss of step {bad + 1} is {got[bad]!r}, without {plain[bad]!r}")
        print(f"  low-precision copies: the {args.steps} losses equal those of the step without them")
        # A checkpoint saved without the copies (an older run's) resumes with them: they are
        # computed from the weights it holds, and the losses go on as the uninterrupted run's.
        half, losses = resumed(toml0, toml, "no-copies.ckpt")
        if not same_losses(losses, got[: 2 * half]):
            sys.exit(f"FAIL: resuming a checkpoint without copies changed the losses:\n{losses}\n{got[: 2 * half]}")
        print(f"  a checkpoint without the copies resumed at step {half}: the losses equal the uninterrupted run's")

    # Resuming: half the steps with a checkpoint, then the rest from it, repeat the losses exactly
    # (on a CUDA backend the checkpoint is read from and written to the device's variables).
    half, losses = resumed(toml, toml, "half.ckpt")
    if not same_losses(losses, got[: 2 * half]):
        sys.exit(f"FAIL: the resumed run's losses differ:\n{losses}\n{got[:2 * half]}")
    print(f"  resumed at step {half}: the {2 * half} losses equal the uninterrupted run's" +
          ("" if np.array_equal(losses, got[: 2 * half]) else " within 1e-4"))
    print("PASS")


if __name__ == "__main__":
    main()
