#!/usr/bin/env python3
"""Fused causal attention, Kiln vs PyTorch SDPA's fastest backend, on the GPU machine.

For B=1, 32 heads, head dim 128, causal, bf16 and seq 2048/4096/8192, times
torch.nn.functional.scaled_dot_product_attention under each backend that runs (flash,
efficient, cudnn, via torch.nn.attention.sdpa_kernel; CUDA events, median of N) and takes
the fastest; Kiln compiles a one-node .kir graph (`kiln compile --target sm_90a`) and times it
with `kiln bench --report-json` (device time of the plan, median). Writes attention.md (a
Markdown table with TFLOP/s and the Kiln/torch ratio) and attention.json to --out.
With --layout bshd Kiln's graph takes q/k/v as [B, S, H, D] and returns [B, S, H, D] through the
transposes exporters write (the CUDA lowering reads and writes those layouts in place; torch
still times SDPA alone).

    /opt/torch/.venv/bin/python3 bench/peer/attention.py --kiln build/bin/kiln --out bench/results
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from peer_common import kiln_device_ms, median_ms


def kir_text(b, h, s, d, layout="bhsd"):
    t = f"bf16[{b}, {h}, {s}, {d}]"
    attn = f"attention(%q, %k, %v) {{scale = {1 / math.sqrt(d)!r}, causal = 1}} : {t}"
    if layout == "bhsd":
        return f"graph @attention(%q: {t}, %k: {t}, %v: {t}) -> ({t}) {{\n  %y = {attn}\n  return %y\n}}\n"
    # The result stays [B, S, H, D]: a reshaped output would be a view, which the plan copies.
    x = f"bf16[{b}, {s}, {h}, {d}]"
    body = "".join(f"  %{n} = transpose(%{n}x) {{perm = [0, 2, 1, 3]}} : {t}\n" for n in "qkv")
    return (f"graph @attention(%qx: {x}, %kx: {x}, %vx: {x}) -> ({x}) {{\n{body}  %a = {attn}\n"
            f"  %y = transpose(%a) {{perm = [0, 2, 1, 3]}} : {x}\n  return %y\n}}\n")


def causal_flops(b, h, s, d):
    # Two GEMMs of 2·s·s·d each, half of the score matrix visible.
    return 4 * b * h * s * s * d / 2


def time_torch(torch, b, h, s, d, iters):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                out[name] = median_ms(torch, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters, 5)
        except Exception as e:  # a backend that does not run here is left out, and said so
            out[name] = None
            print(f"torch {name} s={s}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
    return out


def time_kiln(kiln, work, b, h, s, d, iters, target, layout):
    kir = os.path.join(work, f"attn_{s}.kir")
    art = os.path.join(work, f"attn_{s}.kiln")
    rep = os.path.join(work, f"attn_{s}.json")
    with open(kir, "w") as f:
        f.write(kir_text(b, h, s, d, layout))
    subprocess.run([kiln, "compile", kir, "--target", target, "-o", art], check=True)
    return kiln_device_ms(kiln, art, rep, iters)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kiln", required=True, help="the kiln binary (with the cuda-sm90 plugin beside it)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                    help="Kiln's q/k/v/result layout: [B, H, S, D], or [B, S, H, D] through transposes")
    a = ap.parse_args()
    import torch
    os.makedirs(a.out, exist_ok=True)
    b, h, d = 1, a.heads, a.head_dim
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for s in [int(x) for x in a.seqs.split(",")]:
            t = time_torch(torch, b, h, s, d, a.iterations)
            runs = {k: v for k, v in t.items() if v is not None}
            best = min(runs, key=runs.get) if runs else None
            k_ms, k_dev = time_kiln(a.kiln, work, b, h, s, d, a.iterations, a.target, a.layout)
            fl = causal_flops(b, h, s, d)
            row = {"seq": s, "torch_ms": t, "torch_best": best, "kiln_ms": k_ms, "kiln_device_time": k_dev,
                   "kiln_tflops": fl / k_ms / 1e9,
                   "torch_tflops": fl / runs[best] / 1e9 if best else None,
                   "ratio": runs[best] / k_ms if best else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    fmt = lambda v, p=3: "n/a" if v is None else f"{v:.{p}f}"
    lines = [f"# Fused attention: Kiln vs PyTorch SDPA (B=1, {h} heads, head dim {d}, causal, bf16, "
             f"Kiln layout {a.layout})", "",
             f"torch {torch.__version__}, {torch.cuda.get_device_name()}; Kiln: `kiln bench` device time of the "
             "plan (CUDA events, graphs on), median; torch: CUDA events around one SDPA call queued behind a device sleep (host dispatch not counted), median. "
             "TFLOP/s count the visible half of the causal score matrix (4·B·H·S²·D/2). "
             "Ratio = torch's fastest / Kiln (≥ 1 means Kiln is faster).", "",
             "| seq | flash ms | efficient ms | cudnn ms | best torch | torch TFLOP/s | Kiln ms | Kiln TFLOP/s | ratio |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        t = r["torch_ms"]
        lines.append(f"| {r['seq']} | {fmt(t['flash'])} | {fmt(t['efficient'])} | {fmt(t['cudnn'])} | "
                     f"{r['torch_best']} | {fmt(r['torch_tflops'], 1)} | {fmt(r['kiln_ms'])} | "
                     f"{fmt(r['kiln_tflops'], 1)} | {fmt(r['ratio'], 2)} |")
    with open(os.path.join(a.out, "attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "attention.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
