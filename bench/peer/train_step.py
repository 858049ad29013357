#!/usr/bin/env python3
"""GPT-2 small training step: Kiln (`kiln train`) against PyTorch eager and torch.compile in one
run, and what activation checkpointing (the remat pass) saves.

The model is tests/training/models.py's GPT (GPT-2's architecture: learned positions, pre-norm
blocks, tanh GELU, tied head, cross-entropy, AdamW with global-norm clipping) at GPT-2 small's
sizes, B 8, T 512, from the same random weights and token batches on both sides, with bf16
autocast (f32 master weights) by default.

For every remat policy (--remat, default none,selective) Kiln's training step is compiled for
--target and its plan's arena (the activation memory the static planner lays out: every
intermediate of the forward and backward, the optimizer's temporaries) is read from
`kiln compile`; that part needs no GPU. With --run (on the GPU machine) each policy also trains
--steps steps and its median step time (steps after --warmup, from the progress lines) is
compared with PyTorch's, whose peak memory is torch.cuda.max_memory_allocated over the timed
steps.

    # on the GPU machine (PyTorch with CUDA), the issue's measurement:
    python3 bench/peer/train_step.py --kiln build/bin/kiln --run --out bench/results/train-step.json
    # anywhere: only the memory of each remat policy, for sm_90a (NVRTC; no GPU)
    python3 bench/peer/train_step.py --kiln build/bin/kiln --size tiny

Goals (issue 30): Kiln's step ≤ 0.9x torch.compile's; remat=selective's memory ≤ 0.7x of no remat
at ≤ 1.25x its step time. --check turns a missed goal into exit status 1.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "training"))
import models  # noqa: E402
from train_curve import training_pipeline, with_copies  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "bench", "parallel"))
from gpt2_train import SideFileKir, write_weights  # noqa: E402

SIZES = {
    "gpt2-small": dict(V=50257, T=512, B=8, D=768, H=12, LAYERS=12),
    "tiny": dict(V=64, T=16, B=2, D=32, H=2, LAYERS=2),
    # GPT-2 small's proportions (T = D, 4 heads of 32, V ~ 16 D) at 1/6 of its width: CI's check of
    # the remat memory ratio (--max-remat-ratio) in seconds.
    "small": dict(V=2048, T=128, B=8, D=128, H=4, LAYERS=6),
}


def write_task(task, workdir, steps):
    """model.kir (+ weights.bin) and data/{tokens,targets}.npy."""
    kir = os.path.join(workdir, "model.kir")
    with open(kir, "w") as f:
        f.write(task.kir(SideFileKir))
    write_weights(task, os.path.join(workdir, "weights.bin"))
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    batches = type(task).batches(steps)
    for name, array in batches.items():
        np.save(os.path.join(data, name + ".npy"), array)
    return kir, data, batches


def write_pipeline(workdir, task, remat, dtype, backend, target, args):
    """The step's pipeline; `remat` names the file and, before any '-', is the policy."""
    path = os.path.join(workdir, f"train-{remat}.toml")
    policy = remat.split("-")[0]
    with open(path, "w") as f:
        # The optimizer writes each weight's bf16 copy with its update (no cast of the f32 weights
        # at the start of the step).
        optimizer = with_copies(task.PIPELINE_OPTIMIZER) if args.low_precision_copies == "on" else task.PIPELINE_OPTIMIZER
        f.write(training_pipeline(optimizer, autocast=None if dtype == "f32" else dtype,
                                  remat=None if policy == "none" else policy,
                                  decompose_losses=backend.startswith("cuda"), backend=backend,
                                  targets=[target] if target else (), loss_chunks=args.loss_chunks,
                                  schedule_lookahead=args.schedule_lookahead))
    return path


def run(cmd, timeout):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def kiln_memory(kiln, kir, toml, backend, target, workdir, remat):
    out = run([kiln, "compile", kir, "--pipeline", toml, "--backend", backend, "--target", target,
               "-o", os.path.join(workdir, f"step-{remat}.kiln")], 3600)
    m = re.search(r"arena bytes=(\d+)", out)
    if not m:
        raise RuntimeError(f"kiln compile printed no plan arena:\n{out[-2000:]}")
    return {"plan_arena_mib": int(m.group(1)) / 2 ** 20,
            "compile_report": [l.strip() for l in out.splitlines() if l.startswith("remat:") or "peak activation" in l]}


def kiln_steps(kiln, kir, toml, data, backend, steps, warmup):
    t0 = time.time()
    out = run([kiln, "train", kir, "--pipeline", toml, "--data", data, "--steps", str(steps), "--backend", backend], 3600)
    times = [float(m.group(1)) for m in re.finditer(r"^step \d+/\d+ .*? time ([0-9.]+) ms", out, re.M)]
    losses = [float(m.group(1)) for m in re.finditer(r"^step \d+/\d+\s+loss ([-0-9.eE+naif]+)", out, re.M)]
    if len(times) != steps:
        raise RuntimeError(f"kiln train printed {len(times)} step times for {steps} steps:\n{out[-2000:]}")
    return {"step_ms": statistics.median(times[warmup:]), "wall_s": time.time() - t0, "loss_first": losses[0],
            "loss_last": losses[-1], "losses": losses}


def torch_steps(task, batches, steps, warmup, dtype, compiled, device):
    """Median step time (ms) and peak memory (MiB) of the same model in PyTorch."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    # f32 master weights as Kiln's: the task's parameters are float64 arrays, and autocast leaves
    # float64 tensors alone (every GEMM would run in f64).
    p = {k: torch.tensor(v, dtype=torch.float32, device=device, requires_grad=True) for k, v in task.params.items()}
    opt = torch.optim.AdamW(p.values(), lr=task.LR, weight_decay=task.WD, **({"fused": True} if device == "cuda" else {}))
    sys.path.insert(0, os.path.join(REPO, "bench", "training"))
    from torch_reference import gpt_logits

    def loss_fn(tokens, targets):
        return F.cross_entropy(gpt_logits(p, task, tokens).float().reshape(-1, task.V), targets.reshape(-1))

    fwd = torch.compile(loss_fn) if compiled else loss_fn
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16) if dtype == "bf16" else None
    cuda = device == "cuda"
    times, losses = [], []
    for s in range(steps):
        tokens = torch.tensor(batches["tokens"][s], device=device)
        targets = torch.tensor(batches["targets"][s], device=device)
        if cuda and s == warmup:
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if amp is not None:
            with amp:
                loss = fwd(tokens, targets)
        else:
            loss = fwd(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(p.values(), task.CLIP, foreach=True)
        opt.step()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    return {"step_ms": statistics.median(times[warmup:]),
            "peak_mib": torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None,
            "loss_first": losses[0], "loss_last": losses[-1], "losses": losses}


def curve_difference(a, b):
    """The largest relative difference between two loss curves, and its step."""
    worst = max(range(min(len(a), len(b))), key=lambda i: abs(a[i] - b[i]) / abs(b[i]))
    return abs(a[worst] - b[worst]) / abs(b[worst]), worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="gpt2-small")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--remat", default="none,selective", help="comma-separated remat policies (none, selective, full)")
    ap.add_argument("--backend", default="cuda-sm90", help="the backend that trains (with --run)")
    ap.add_argument("--memory-backend", default="cuda-sm90", help="the backend whose plan gives the memory")
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--run", action="store_true", help="train and time (needs the backend's device and PyTorch)")
    ap.add_argument("--loss-chunks", type=int, default=8,
                    help="chunk-cross-entropy: the head and its loss in this many row chunks (1: off)")
    ap.add_argument("--schedule-lookahead", type=int, default=16,
                    help="schedule-memory's lookahead: enough to finish one head chunk before the next")
    ap.add_argument("--low-precision-copies", choices=["on", "off"], default="on",
                    help="the optimizer's low-precision-copies: the bf16 weights the forward reads come from the update")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--workdir")
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument("--max-remat-ratio", type=float,
                    help="exit 1 when remat=selective's plan arena is above this fraction of none's")
    ap.add_argument("--max-full-ratio", type=float,
                    help="exit 1 when remat=full's plan arena is above this fraction of none's, or not below "
                         "selective's when both run")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        sys.exit("train_step: --steps must exceed --warmup")
    policies = a.remat.split(",")
    for pol in policies:
        if pol not in ("none", "selective", "full"):
            sys.exit(f"train_step: unknown remat policy '{pol}' (none, selective, full)")
    cls = type("Gpt_" + a.size.replace("-", "_"), (models.Gpt,), dict(SIZES[a.size]))
    task = cls()
    workdir = a.workdir or tempfile.mkdtemp(prefix="kiln-train-step-")
    os.makedirs(workdir, exist_ok=True)
    kir, data, batches = write_task(task, workdir, a.steps)
    res = {"size": a.size, "shape": SIZES[a.size], "dtype": a.dtype, "backend": a.backend, "target": a.target,
           "steps": a.steps, "warmup": a.warmup, "kiln": {}, "torch": {}}

    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    for pol in policies:
        # The memory is the plan of --target's CUDA backend, whichever backend runs the steps.
        toml = write_pipeline(workdir, task, pol, a.dtype, a.memory_backend, a.target, a)
        r = kiln_memory(a.kiln, kir, toml, a.memory_backend, a.target, workdir, pol)
        if a.run:
            if a.backend != a.memory_backend:
                toml = write_pipeline(workdir, task, pol + "-" + a.backend, a.dtype, a.backend, None, a)
            r.update(kiln_steps(a.kiln, kir, toml, data, a.backend, a.steps, a.warmup))
        res["kiln"][pol] = r
        print(f"kiln remat={pol}: plan arena {r['plan_arena_mib']} MiB" +
              (f", step {r['step_ms']:.2f} ms, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}" if a.run else ""))
        save()
    if a.run and not a.no_torch:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for mode, compiled in (("eager", False), ("compile", True)):
            r = torch_steps(task, batches, a.steps, a.warmup, a.dtype, compiled, device)
            res["torch"][mode] = r
            print(f"torch {mode}: step {r['step_ms']:.2f} ms, peak {r['peak_mib']} MiB, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
            save()
        # The same init and batches: Kiln's loss curve should follow eager PyTorch's (both bf16
        # autocast, so they part by rounding, more as the steps go on).
        for pol, r in res["kiln"].items():
            if "losses" in r and "eager" in res["torch"]:
                diff, step = curve_difference(r["losses"], res["torch"]["eager"]["losses"])
                r["loss_vs_eager"] = {"worst_relative": diff, "step": step}
                print(f"kiln remat={pol} vs torch eager loss: worst {100 * diff:.2f}% at step {step}")
        save()

    ok = True
    k = res["kiln"]
    if "none" in k and "selective" in k and k["none"]["plan_arena_mib"] and k["selective"]["plan_arena_mib"]:
        mem = k["selective"]["plan_arena_mib"] / k["none"]["plan_arena_mib"]
        res["remat_selective_memory_ratio"] = mem
        line = f"remat=selective: {mem:.2f}x the memory of none (goal <= 0.7)"
        ok &= mem <= 0.7
        if a.max_remat_ratio is not None and mem > a.max_remat_ratio:
            print(line)
            sys.exit(f"FAIL: remat=selective's plan arena is {mem:.3f}x of none's, above --max-remat-ratio {a.max_remat_ratio}")
        if a.run:
            tr = k["selective"]["step_ms"] / k["none"]["step_ms"]
            res["remat_selective_time_ratio"] = tr
            line += f", {tr:.2f}x its step time (goal <= 1.25)"
            ok &= tr <= 1.25
        print(line)
    for mode, r in res["torch"].items():
        # Same weights and batches: the first losses agree unless the two models differ.
        kiln_first = next(iter(k.values()))["loss_first"] if k else None
        if kiln_first is not None and abs(r["loss_first"] - kiln_first) > 0.01 * abs(kiln_first):
            print(f"FAIL: torch {mode}'s first loss {r['loss_first']:.5f} is not Kiln's {kiln_first:.5f}: not the same model")
            ok = False
    if "none" in k and "full" in k:
        full = k["full"]["plan_arena_mib"] / k["none"]["plan_arena_mib"]
        res["remat_full_memory_ratio"] = full
        line = f"remat=full: {full:.2f}x the memory of none"
        if "selective" in k:
            line += f", {k['full']['plan_arena_mib'] / k['selective']['plan_arena_mib']:.2f}x selective's"
        if a.run:
            res["remat_full_time_ratio"] = k["full"]["step_ms"] / k["none"]["step_ms"]
            line += f", {res['remat_full_time_ratio']:.2f}x none's step time"
        print(line)
        if a.max_full_ratio is not None:
            if full > a.max_full_ratio:
                sys.exit(f"FAIL: remat=full's plan arena is {full:.3f}x of none's, above --max-full-ratio {a.max_full_ratio}")
            if "selective" in k and k["full"]["plan_arena_mib"] >= k["selective"]["plan_arena_mib"]:
                sys.exit("FAIL: remat=full's plan arena is not below selective's "
                         f"({k['full']['plan_arena_mib']:.1f} >= {k['selective']['plan_arena_mib']:.1f} MiB)")
    if a.run and "compile" in res["torch"] and "none" in k:
        ratio = k["none"]["step_ms"] / res["torch"]["compile"]["step_ms"]
        res["kiln_over_compile"] = ratio
        print(f"Kiln / torch.compile step time: {ratio:.2f}x (goal <= 0.9)")
        ok &= ratio <= 0.9
    save()
    if a.check and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
