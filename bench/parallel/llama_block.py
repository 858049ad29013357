#!/usr/bin/env python3
"""Writes a Llama-style decoder as .kir with its weights in a side file: per layer RMSNorm, q/k/v
projections, causal attention (grouped-query when --kv-heads < --heads), the output projection
and residual, RMSNorm, a SwiGLU MLP and residual. By default one block on an activation input
(what bench/parallel/scaling.sh measures: d 4096, ff 11008, T 2048, bf16); --layers and --vocab
make a whole model (token embedding, the blocks, a final norm and the LM head).

    python3 bench/parallel/llama_block.py OUT_DIR [--d 4096] [--ff 11008] [--heads 32]
        [--kv-heads 32] [--seq 2048] [--batch 1] [--dtype bf16] [--seed 0]
        [--layers 1] [--vocab 0] [--symbolic] [--planning-only] [--name block]

Writes OUT_DIR/NAME.kir and OUT_DIR/NAME.kir.bin (random weights, scaled like a trained
model's: N(0, 1/sqrt(fan_in))). --symbolic makes the batch and sequence the symbols B and T.
--planning-only writes a sparse side file instead (a tag per weight, the rest zeros, no disk
used): enough for `kiln plan`, which reads only shapes, for models too big to write.
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
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=0, help="0: one block on an activation input, no embedding or head")
    ap.add_argument("--symbolic", action="store_true", help="batch and sequence as the symbols B and T")
    ap.add_argument("--planning-only", action="store_true", help="a sparse side file: shapes only, for kiln plan")
    ap.add_argument("--name", default="block")
    a = ap.parse_args()
    d, ff, h, kvh, dt = a.d, a.ff, a.heads, a.kv_heads, a.dtype
    b, t = ("B", "T") if a.symbolic else (a.batch, a.seq)
    lead = "0, 0" if a.symbolic else f"{b}, {t}"  # reshape: 0 keeps a (symbolic) dim
    hd = d // h
    if d % h or h % kvh:
        raise SystemExit("d must divide into heads, heads into kv-heads")
    if a.layers < 1:
        raise SystemExit("--layers must be >= 1")
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    side_name = f"{a.name}.kir.bin"
    side = open(os.path.join(a.out, side_name), "wb")
    offset = 0

    def place(data_fn, nbytes):
        """Writes a tensor's bytes 64-aligned (or, planning only, a tag) and returns its offset."""
        nonlocal offset
        offset += (-offset) % 64
        at = offset
        side.seek(at)
        if a.planning_only:
            side.write(at.to_bytes(8, "little"))  # distinct bytes per weight: cse keeps them apart
        else:
            side.write(data_fn())
        offset += nbytes
        return at

    elem = {"bf16": 2, "f16": 2, "f32": 4}[dt]

    def weight(name, shape, fan_in):
        dims = ", ".join(map(str, shape))
        at = place(lambda: to_storage(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in), dt),
                   int(np.prod(shape)) * elem)
        return f'  %{name} = constant() {{value = dense<{dt}[{dims}]>(file "{side_name}", offset {at})}} : {dt}[{dims}]'

    def norm_scale(name):
        at = place(lambda: to_storage(np.ones(d, np.float32), dt), d * elem)
        return f'  %{name} = constant() {{value = dense<{dt}[{d}]>(file "{side_name}", offset {at})}} : {dt}[{d}]'

    x = f"{dt}[{b}, {t}, {d}]"
    whole = a.layers > 1 or a.vocab > 0
    what = (f"{a.layers} layers, vocab {a.vocab}, " if whole else "") + f"d {d}, ff {ff}, {h} heads ({kvh} for k/v)"
    if a.vocab:
        signature = f"graph @llama(%tokens: i64[{b}, {t}]) -> ({dt}[{b}, {t}, {a.vocab}]) {{"
    else:
        signature = f"graph @llama_block(%x: {x}) -> ({x}) {{"
    lines = [f"// A Llama-style {'decoder' if whole else 'decoder block'} (bench/parallel/llama_block.py): {what},"
             f" T {t}, batch {b}, {dt}.", signature]
    body = []
    if a.vocab:
        lines.append(weight("embed", [a.vocab, d], 1))
        body.append(f"  %x = gather(%embed, %tokens) {{axis = 0}} : {x}")
    cur = "x"
    for layer in range(a.layers):
        p = f"l{layer}_" if whole else ""
        lines += [norm_scale(f"{p}attn_norm"), norm_scale(f"{p}mlp_norm"),
                  weight(f"{p}wq", [d, d], d), weight(f"{p}wk", [kvh * hd, d], d), weight(f"{p}wv", [kvh * hd, d], d),
                  weight(f"{p}wo", [d, d], d), weight(f"{p}w_gate", [ff, d], d), weight(f"{p}w_up", [ff, d], d),
                  weight(f"{p}w_down", [d, ff], ff)]
        y = f"{p}y" if whole else "y"
        body += [
            f"  %{p}h = rms_norm(%{cur}, %{p}attn_norm) {{axis = -1, epsilon = 1e-5}} : {x}",
            f"  %{p}q = linear(%{p}h, %{p}wq) : {x}",
            f"  %{p}k = linear(%{p}h, %{p}wk) : {dt}[{b}, {t}, {kvh * hd}]",
            f"  %{p}v = linear(%{p}h, %{p}wv) : {dt}[{b}, {t}, {kvh * hd}]",
            f"  %{p}q4 = reshape(%{p}q) {{shape = [{lead}, {h}, {hd}]}} : {dt}[{b}, {t}, {h}, {hd}]",
            f"  %{p}k4 = reshape(%{p}k) {{shape = [{lead}, {kvh}, {hd}]}} : {dt}[{b}, {t}, {kvh}, {hd}]",
            f"  %{p}v4 = reshape(%{p}v) {{shape = [{lead}, {kvh}, {hd}]}} : {dt}[{b}, {t}, {kvh}, {hd}]",
            f"  %{p}qh = transpose(%{p}q4) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {h}, {t}, {hd}]",
            f"  %{p}kh = transpose(%{p}k4) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {kvh}, {t}, {hd}]",
            f"  %{p}vh = transpose(%{p}v4) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {kvh}, {t}, {hd}]",
            f"  %{p}ctx = attention(%{p}qh, %{p}kh, %{p}vh) {{causal = 1, scale = {float(1 / np.sqrt(hd))!r}}}"
            f" : {dt}[{b}, {h}, {t}, {hd}]",
            f"  %{p}ctx_t = transpose(%{p}ctx) {{perm = [0, 2, 1, 3]}} : {dt}[{b}, {t}, {h}, {hd}]",
            f"  %{p}merged = reshape(%{p}ctx_t) {{shape = [{lead}, {d}]}} : {x}",
            f"  %{p}attn = linear(%{p}merged, %{p}wo) : {x}",
            f"  %{p}x1 = add(%{cur}, %{p}attn) : {x}",
            f"  %{p}h2 = rms_norm(%{p}x1, %{p}mlp_norm) {{axis = -1, epsilon = 1e-5}} : {x}",
            f"  %{p}gate = linear(%{p}h2, %{p}w_gate) : {dt}[{b}, {t}, {ff}]",
            f"  %{p}up = linear(%{p}h2, %{p}w_up) : {dt}[{b}, {t}, {ff}]",
            f"  %{p}act = silu(%{p}gate) : {dt}[{b}, {t}, {ff}]",
            f"  %{p}hidden = mul(%{p}act, %{p}up) : {dt}[{b}, {t}, {ff}]",
            f"  %{p}mlp = linear(%{p}hidden, %{p}w_down) : {x}",
            f"  %{y} = add(%{p}x1, %{p}mlp) : {x}",
        ]
        cur = y
    if a.vocab:
        lines += [norm_scale("final_norm"), weight("lm_head", [a.vocab, d], d)]
        body += [f"  %hf = rms_norm(%{cur}, %final_norm) {{axis = -1, epsilon = 1e-5}} : {x}",
                 f"  %logits = linear(%hf, %lm_head) : {dt}[{b}, {t}, {a.vocab}]"]
        cur = "logits"
    lines += body + [f"  return %{cur}", "}"]
    side.truncate(offset)
    side.close()
    with open(os.path.join(a.out, f"{a.name}.kir"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}/{a.name}.kir and {side_name} ({offset} bytes of weights"
          f"{', sparse: planning only' if a.planning_only else ''})")


if __name__ == "__main__":
    main()
