#!/usr/bin/env python3
"""Writes a Llama-style decoder block as .kir with its weights in a side file: RMSNorm, q/k/v
projections, causal attention (grouped-query when --kv-heads < --heads), the output projection
and residual, RMSNorm, a SwiGLU MLP and residual. The tensor-parallel scaling benchmark
(bench/parallel/scaling.sh) runs it on one GPU and split over two; the default sizes are the
ones it measures (d 4096, ff 11008, T 2048, bf16).

    python3 bench/parallel/llama_block.py OUT_DIR [--d 4096] [--ff 11008] [--heads 32]
        [--kv-heads 32] [--seq 2048] [--batch 1] [--dtype bf16] [--seed 0]

Writes OUT_DIR/block.kir and OUT_DIR/block.kir.bin (random weights, scaled like a trained
model's: N(0, 1/sqrt(fan_in))).
"""
import argparse
import os

import numpy as np


def to_storage(a, dtype):
    """Little-endian bytes of `a` (float32) in `dtype`: bf16 rounds to nearest even."""
    if dtype == "f32":
        return a.astype("<f4").tobytes()
    if dtype == "f16":
        return a.astype("<f2").tobytes()
    bits = a.astype("<f4").view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return rounded.tobytes()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    d, ff, h, kvh, t, b, dt = a.d, a.ff, a.heads, a.kv_heads, a.seq, a.batch, a.dtype
    hd = d // h
    if d % h or h % kvh:
        raise SystemExit("d must divide into heads, heads into kv-heads")
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    side = open(os.path.join(a.out, "block.kir.bin"), "wb")
    offset = 0

    def weight(name, shape, fan_in):
        nonlocal offset
        pad = (-offset) % 64
        side.write(b"\0" * pad)
        offset += pad
        data = to_storage(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in), dt)
        side.write(data)
        dims = ", ".join(map(str, shape))
        line = (f'  %{name} = constant() {{value = dense<{dt}[{dims}]>(file "block.kir.bin", offset {offset})}}'
                f" : {dt}[{dims}]")
        offset += len(data)
        return line

    def norm_scale(name):
        nonlocal offset
        pad = (-offset) % 64
        side.write(b"\0" * pad)
        offset += pad
        data = to_storage(np.ones(d, np.float32), dt)
        side.write(data)
        line = f'  %{name} = constant() {{value = dense<{dt}[{d}]>(file "block.kir.bin", offset {offset})}} : {dt}[{d}]'
        offset += len(data)
        return line

    x = f"{dt}[{b}, {t}, {d}]"
    lines = [
        f"// A Llama-style decoder block (bench/parallel/llama_block.py): d {d}, ff {ff}, {h} heads"
        f" ({kvh} for k/v), T {t}, batch {b}, {dt}.",
        f"graph @llama_block(%x: {x}) -> ({x}) {{",
        norm_scale("attn_norm"), norm_scale("mlp_norm"),
        weight("wq", [d, d], d), weight("wk", [kvh * hd, d], d), weight("wv", [kvh * hd, d], d),
        weight("wo", [d, d], d), weight("w_gate", [ff, d], d), weight("w_up", [ff, d], d),
        weight("w_down", [d, ff], ff),
        f"  %h = rms_norm(%x, %attn_norm) {{axis = -1, epsilon = 1e-5}} : {x}",
        f"  %q = linear(%h, %wq) : {x}",
        f"  %k = linear(%h, %wk) : {dt}[{b}, {t}, {kvh * hd}]",
        f"  %v = linear(%h, %wv) : {dt}[{b}, {t}, {kvh * hd}]",
        f"  %q4 = reshape(%q) {{shape = [{b}, {t}, {h}, {hd}]}} : {dt}[{b}, {t}, {h}, {hd}]",
        f"  %k4 = reshape(%k) {{shape = [{b}, {t}, {kvh}, {hd}]}} : {dt}[{b}, {t}, {kvh}, {hd}]",
        f"  %v4 = reshape(%v) {{shape = [{b}, {t}, {kvh}, {hd}]}} : {dt}[{b}, {t}, {kvh}, {hd}]",
        f"  %qh = transpose(%q4) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {h}, {t}, {hd}]",
        f"  %kh = transpose(%k4) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {kvh}, {t}, {hd}]",
        f"  %vh = transpose(%v4) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {kvh}, {t}, {hd}]",
        f"  %ctx = attention(%qh, %kh, %vh) {{causal = 1, scale = {float(1 / np.sqrt(hd))!r}}} : {dt}[{b}, {h}, {t}, {hd}]",
        f"  %ctx_t = transpose(%ctx) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {t}, {h}, {hd}]",
        f"  %merged = reshape(%ctx_t) {{shape = [{b}, {t}, {d}]}} : {x}",
        f"  %attn = linear(%merged, %wo) : {x}",
        f"  %x1 = add(%x, %attn) : {x}",
        f"  %h2 = rms_norm(%x1, %mlp_norm) {{axis = -1, epsilon = 1e-5}} : {x}",
        f"  %gate = linear(%h2, %w_gate) : {dt}[{b}, {t}, {ff}]",
        f"  %up = linear(%h2, %w_up) : {dt}[{b}, {t}, {ff}]",
        f"  %act = silu(%gate) : {dt}[{b}, {t}, {ff}]",
        f"  %hidden = mul(%act, %up) : {dt}[{b}, {t}, {ff}]",
        f"  %mlp = linear(%hidden, %w_down) : {x}",
        f"  %y = add(%x1, %mlp) : {x}",
        "  return %y",
        "}",
    ]
    side.close()
    with open(os.path.join(a.out, "block.kir"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}/block.kir and block.kir.bin ({offset} bytes of weights)")


if __name__ == "__main__":
    main()
