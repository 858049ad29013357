#!/usr/bin/env python3
"""Memory-bound kernels of a Llama block (bf16) against the copy bandwidth of the same GPU
measured in the same run: SwiGLU (silu(gate) * up over S x F), RoPE on q ([1, S, H*D] viewed as
[1, S, H, D], transposed to [1, H, S, D], rotate-half, times cos and sin) and a standalone
transpose [1, S, H, D] -> [1, H, S, D].

Each case is compiled with `kiln compile` (standard passes: the RoPE ops become one fused
group) and timed with `kiln bench` (median device time, CUDA graph replay). Its bytes (every
input read once, every output written once) over that time are compared with a PyTorch
device-to-device copy (clone) moving as many bytes, timed in the same run; PyTorch eager is
listed for reference. Writes a Markdown table to OUT/<date>-pointwise.md.

    /opt/torch/.venv/bin/python3 bench/peer/pointwise.py --kiln build/bin/kiln [--seq 2048] [--ffn 11008]
"""
import argparse
import datetime
import os
import subprocess
import sys
import tempfile

from peer_common import kiln_bench, median_ms

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SWIGLU = """graph @swiglu(%g: bf16[{S}, {F}], %u: bf16[{S}, {F}]) -> (bf16[{S}, {F}]) {{
  %s = silu(%g) : bf16[{S}, {F}]
  %y = mul(%s, %u) : bf16[{S}, {F}]
  return %y
}}
"""

ROPE = """graph @rope(%q: bf16[1, {S}, {HD}], %cos: bf16[1, 1, {S}, {D}], %sin: bf16[1, 1, {S}, {D}]) -> (bf16[1, {H}, {S}, {D}]) {{
  %v = reshape(%q) {{shape = [1, {S}, {H}, {D}]}} : bf16[1, {S}, {H}, {D}]
  %t = transpose(%v) {{perm = [0, 2, 1, 3]}} : bf16[1, {H}, {S}, {D}]
  %lo = slice(%t) {{axes = [3], starts = [0], ends = [{D2}]}} : bf16[1, {H}, {S}, {D2}]
  %hi = slice(%t) {{axes = [3], starts = [{D2}], ends = [{D}]}} : bf16[1, {H}, {S}, {D2}]
  %n = neg(%hi) : bf16[1, {H}, {S}, {D2}]
  %rot = concat(%n, %lo) {{axis = -1}} : bf16[1, {H}, {S}, {D}]
  %a = mul(%t, %cos) : bf16[1, {H}, {S}, {D}]
  %b = mul(%rot, %sin) : bf16[1, {H}, {S}, {D}]
  %y = add(%a, %b) : bf16[1, {H}, {S}, {D}]
  return %y
}}
"""

TRANSPOSE = """graph @transpose(%x: bf16[1, {S}, {H}, {D}]) -> (bf16[1, {H}, {S}, {D}]) {{
  %y = transpose(%x) {{perm = [0, 2, 1, 3]}} : bf16[1, {H}, {S}, {D}]
  return %y
}}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default=os.path.join(REPO, "build", "bin", "kiln"))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    a = ap.parse_args()

    import torch
    torch.manual_seed(0)
    bf = torch.bfloat16
    S, F, H, D = a.seq, a.ffn, a.heads, a.head_dim
    dims = dict(S=S, F=F, H=H, D=D, HD=H * D, D2=D // 2)
    gate, up = (torch.randn(S, F, device="cuda", dtype=bf) for _ in range(2))
    q = torch.randn(1, S, H * D, device="cuda", dtype=bf)
    cos, sin = (torch.randn(1, 1, S, D, device="cuda", dtype=bf) for _ in range(2))

    def rope_eager():
        t = q.view(1, S, H, D).transpose(1, 2)
        rot = torch.cat((-t[..., D // 2:], t[..., :D // 2]), dim=-1)
        return t * cos + rot * sin

    # name, .kir text, bytes moved (inputs read + outputs written), PyTorch eager
    cases = [
        (f"SwiGLU {S}x{F}", "swiglu", SWIGLU, 3 * S * F * 2, lambda: torch.nn.functional.silu(gate) * up),
        (f"RoPE [1,{S},{H},{D}] -> [1,{H},{S},{D}]", "rope", ROPE, (2 * S * H * D + 2 * S * D) * 2, rope_eager),
        (f"transpose [1,{S},{H},{D}] -> [1,{H},{S},{D}]", "transpose", TRANSPOSE, 2 * S * H * D * 2,
         lambda: q.view(1, S, H, D).transpose(1, 2).contiguous()),
    ]
    date = datetime.date.today().isoformat()
    lines = [f"# Memory-bound Llama kernels, bf16 ({torch.cuda.get_device_name()}, {date})", "",
             "Bytes: inputs read once + outputs written once. Copy: torch clone moving the same bytes "
             "(half read, half written) in the same run. Median device times.", "",
             "| case | MB | copy ms | copy GB/s | Kiln ms | Kiln GB/s | Kiln % of copy | torch eager ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    failed = []
    with tempfile.TemporaryDirectory() as work:
        for title, name, kir, moved, eager in cases:
            src = torch.empty(moved // 4, device="cuda", dtype=bf)  # read moved/2 bytes, write moved/2
            copy_ms = median_ms(torch, lambda: src.clone(), a.iterations, a.warmup)
            copy_gbs = moved / copy_ms / 1e6
            eager_ms = median_ms(torch, eager, a.iterations, a.warmup)
            try:
                k_ms, kernels, _ = kiln_bench(a.kiln, work, name, kir.format(**dims), a.target, a.iterations, a.warmup, quiet=True)
                k_gbs = moved / k_ms / 1e6
                lines.append(f"| {title} ({kernels} kernel{'s' if kernels != 1 else ''}) | {moved / 1e6:.1f} | "
                             f"{copy_ms:.4f} | {copy_gbs:.0f} | {k_ms:.4f} | {k_gbs:.0f} | {100 * k_gbs / copy_gbs:.1f}% | "
                             f"{eager_ms:.4f} |")
            except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as e:
                failed.append(f"{name}: {e}")
                lines.append(f"| {title} | {moved / 1e6:.1f} | {copy_ms:.4f} | {copy_gbs:.0f} | failed | | | {eager_ms:.4f} |")
    if failed:
        lines += [""] + [f"Kiln failed: {f}" for f in failed]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{date}-pointwise.md"), "w") as f:
        f.write(text)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
