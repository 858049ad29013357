#!/usr/bin/env python3
"""Trains the tasks of tests/training/models.py in PyTorch from the same initial weights and the
same batches as `kiln train`, and compares the loss curves step by step (and with the NumPy
float64 reference the CI test uses). Run it where torch is installed (the GPU machine):

  python3 bench/training/torch_reference.py --kiln build/bin/kiln --task gpt --backend cpu
  python3 bench/training/torch_reference.py --task mlp            # PyTorch vs NumPy only

Exit status 1 when a curve leaves PyTorch's by more than --tolerance (relative, default 1%).
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tests", "training"))
import models  # noqa: E402
from train_curve import train, write_task  # noqa: E402


def gpt_logits(p, task, tokens):
    """models.Gpt's forward in PyTorch (parameters `p` by name): the logits."""
    B, T, d, H = task.B, task.T, task.D, task.H
    h = p["wte"][tokens] + p["wpe"]
    for i in range(task.LAYERS):
        a = F.layer_norm(h, (d,), p[f"l{i}.ln1.g"], p[f"l{i}.ln1.b"], 1e-5)
        q, k, v = F.linear(a, p[f"l{i}.qkv.w"], p[f"l{i}.qkv.b"]).split(d, dim=-1)
        heads = lambda x: x.view(B, T, H, d // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        h = h + F.linear(y.transpose(1, 2).reshape(B, T, d), p[f"l{i}.proj.w"], p[f"l{i}.proj.b"])
        m = F.layer_norm(h, (d,), p[f"l{i}.ln2.g"], p[f"l{i}.ln2.b"], 1e-5)
        f = F.gelu(F.linear(m, p[f"l{i}.fc.w"], p[f"l{i}.fc.b"]), approximate="tanh")
        h = h + F.linear(f, p[f"l{i}.out.w"], p[f"l{i}.out.b"])
    return F.linear(F.layer_norm(h, (d,), p["lnf.g"], p["lnf.b"], 1e-5), p["wte"])


def torch_gpt(task, data, steps, device):
    p = {k: torch.tensor(v, dtype=torch.float32, device=device, requires_grad=True) for k, v in task.params.items()}
    opt = torch.optim.AdamW(p.values(), lr=task.LR, weight_decay=task.WD, foreach=False)
    losses = []
    for s in range(steps):
        tokens = torch.tensor(data["tokens"][s % len(data["tokens"])], device=device)
        targets = torch.tensor(data["targets"][s % len(data["targets"])], device=device)
        logits = gpt_logits(p, task, tokens)
        loss = F.cross_entropy(logits.reshape(-1, task.V), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(p.values(), task.CLIP)
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def torch_mlp(task, data, steps, device):
    p = {k: torch.tensor(v, dtype=torch.float32, device=device, requires_grad=True) for k, v in task.params.items()}
    opt = torch.optim.SGD(p.values(), lr=task.LR, momentum=task.MOMENTUM, nesterov=True, weight_decay=task.WD)
    losses = []
    for s in range(steps):
        x = torch.tensor(data["x"][s % len(data["x"])], device=device)
        y = torch.tensor(data["y"][s % len(data["y"])], device=device)
        out = F.linear(torch.tanh(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])
        loss = F.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=sorted(models.TASKS), default="gpt")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kiln", help="also run `kiln train` and compare it with PyTorch")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--device", default="cpu", help="PyTorch's device (cpu keeps TF32 out of the comparison)")
    ap.add_argument("--tolerance", type=float, default=0.01)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    workdir = tempfile.mkdtemp(prefix=f"kiln-torch-{args.task}-")
    cls = models.TASKS[args.task]
    model, kir, toml, data_dir, data = write_task(cls, args.steps, workdir,
                                                decompose_losses=args.backend.startswith("cuda"))
    curves = {"torch": (torch_gpt if args.task == "gpt" else torch_mlp)(cls(), data, args.steps, args.device),
              "numpy-f64": model.reference_losses(data, args.steps)}
    if args.kiln:
        curves[f"kiln-{args.backend}"] = train(args.kiln, kir, toml, data_dir, args.backend, args.steps, workdir)[0]
    ref = curves["torch"]
    ok = True
    for name, c in curves.items():
        rel = np.abs(c - ref) / np.abs(ref)
        worst = int(rel.argmax())
        print(f"{name:>12}: step 1 {c[0]:.5f}, step {args.steps} {c[-1]:.5f}; worst relative difference from torch "
              f"{rel[worst]:.2e} at step {worst + 1}")
        ok &= bool(rel[worst] <= args.tolerance)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
