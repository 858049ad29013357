#!/usr/bin/env python3
"""RMSNorm + residual (h = x + r; y = rms_norm(h) * w), bf16, against the copy bandwidth of the
same GPU measured in the same run: PyTorch's device-to-device copy (clone of a tensor as large
as the bytes read), torch.compile, and Kiln's fused row kernel (`kiln compile` + `kiln bench`).

Bytes moved per run: x and r read, y and h written (w is negligible), the same read/write mix as
a copy. GB/s = bytes / median device time. Writes a Markdown table to OUT/<date>-rmsnorm.md.

    /opt/torch/.venv/bin/python3 bench/peer/rmsnorm.py --kiln build/bin/kiln [--rows 16384] [--dim 4096]
"""
import argparse
import datetime
import os
import subprocess
import sys
import tempfile

from peer_common import kiln_bench, median_ms

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KIR = """graph @rmsnorm_residual(%x: bf16[{R}, {D}], %r: bf16[{R}, {D}], %w: bf16[{D}]) -> (bf16[{R}, {D}], bf16[{R}, {D}]) {{
  %h = add(%x, %r) : bf16[{R}, {D}]
  %y = rms_norm(%h, %w) {{epsilon = 1e-5}} : bf16[{R}, {D}]
  return %y, %h
}}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default=os.path.join(REPO, "build", "bin", "kiln"))
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    a = ap.parse_args()

    import torch
    torch.manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(a.rows, a.dim, device="cuda", dtype=bf)
    r = torch.randn(a.rows, a.dim, device="cuda", dtype=bf)
    w = torch.randn(a.dim, device="cuda", dtype=bf)
    moved = 4 * a.rows * a.dim * 2 + a.dim * 2

    # A copy reads and writes as many bytes as the norm reads: 2 * R * D bf16 each way.
    src = torch.empty(2 * a.rows * a.dim, device="cuda", dtype=bf)
    copy_ms = median_ms(torch, lambda: src.clone(), a.iterations, a.warmup)
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6

    def rmsnorm_residual(x, r, w):
        h = x + r
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(bf), h

    compiled = torch.compile(rmsnorm_residual)
    compiled(x, r, w)
    torch_ms = median_ms(torch, lambda: compiled(x, r, w), a.iterations, a.warmup)

    rows = [("device-to-device copy (torch clone)", copy_ms, copy_gbs), ("torch.compile", torch_ms, moved / torch_ms / 1e6)]
    note = ""
    with tempfile.TemporaryDirectory() as work:
        try:
            k_ms, kernels, _ = kiln_bench(a.kiln, work, "rmsnorm", KIR.format(R=a.rows, D=a.dim), a.target, a.iterations, a.warmup)
            rows.append((f"Kiln ({kernels} kernel{'s' if kernels != 1 else ''})", k_ms, moved / k_ms / 1e6))
        except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as e:
            note = f"Kiln failed: {e}"

    date = datetime.date.today().isoformat()
    lines = [f"# RMSNorm + residual, {a.rows}x{a.dim} bf16 ({torch.cuda.get_device_name()}, {date})", "",
             f"Bytes per run: {moved / 1e6:.1f} MB (x, r read; y, h written). Median device times.", "",
             "| what | ms | GB/s | % of copy |", "| --- | ---: | ---: | ---: |"]
    for name, ms, gbs in rows:
        lines.append(f"| {name} | {ms:.4f} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f}% |")
    if note:
        lines += ["", note]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{date}-rmsnorm.md"), "w") as f:
        f.write(text)
    return 0 if not note else 1


if __name__ == "__main__":
    sys.exit(main())
