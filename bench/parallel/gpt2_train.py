#!/usr/bin/env python3
"""Writes a GPT-2-small-sized training task for `kiln train` on GPUs: the decoder of
tests/training/models.py (token + position embeddings, 12 pre-norm blocks of causal attention and
a tanh-gelu MLP, head tied to the token embedding; cross-entropy, AdamW with clipping) at GPT-2
small's sizes (V 50257, d 768, 12 heads, 12 layers, T 512), one .kir per global batch size
sharing one weights file, the token batches, and the training pipelines for one GPU and for
data parallelism over N GPUs.

  gpt2_train.py OUT [--batch 8 16] [--steps 30] [--ranks 2] [--autocast bf16] [--target sm_90a]

OUT/model-b{B}.kir, OUT/weights.bin, OUT/data-b{B}/{tokens,targets}.npy, OUT/train-1gpu.toml,
OUT/train-dp{N}.toml.
"""
import argparse
import os
import sys

import numpy as np

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tests", "training"))
import models  # noqa: E402
from train_curve import training_pipeline  # noqa: E402


class Gpt2Small(models.Gpt):
    V, T, D, H, LAYERS = 50257, 512, 768, 12, 12
    LR, WD, CLIP = 3e-4, 0.1, 1.0
    PIPELINE_OPTIMIZER = f'{{ algorithm = "adamw", lr = {LR}, weight-decay = {WD}, max-grad-norm = {CLIP} }}'


class SideFileKir(models.Kir):
    """A models.Kir whose constants refer to weights.bin: the weights in the order the model
    emits them, raw little-endian f32 (write_weights writes it)."""

    def __init__(self, name):
        super().__init__(name)
        self.offset = 0

    def const(self, name, value):
        value = np.asarray(value, dtype="<f4")
        t = models.fmt_type("f32", value.shape)
        self.lines.append(f'  %{name} = constant() {{value = dense<{t}>(file "weights.bin", offset {self.offset})}} : {t}')
        self.offset += value.nbytes
        return name


def write_weights(model, path):
    with open(path, "wb") as f:
        for value in model.params.values():  # the order kir() emits them in
            f.write(np.ascontiguousarray(value, dtype="<f4").tobytes())


def pipeline(path, target, autocast, ranks):
    parallel = f'strategy = "data-parallel"\nmesh = "dp={ranks}"\n' if ranks else None
    with open(path, "w") as f:
        f.write(training_pipeline(Gpt2Small.PIPELINE_OPTIMIZER, autocast=autocast, decompose_losses=True,
                                  parallel=parallel, backend="cuda-sm90", targets=[target]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16], help="global batch sizes (one model each)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--autocast", choices=["bf16", "f16"], help="low-precision contractions (default: fp32)")
    ap.add_argument("--target", default="sm_90a")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = Gpt2Small()
    write_weights(model, os.path.join(args.out, "weights.bin"))
    rng = np.random.default_rng(1)
    for b in args.batch:
        model.B = b
        with open(os.path.join(args.out, f"model-b{b}.kir"), "w") as f:
            f.write(model.kir(SideFileKir))
        data = os.path.join(args.out, f"data-b{b}")
        os.makedirs(data, exist_ok=True)
        toks = rng.integers(0, model.V, (args.steps, b, model.T + 1), dtype=np.int64)
        np.save(os.path.join(data, "tokens.npy"), toks[:, :, :-1])
        np.save(os.path.join(data, "targets.npy"), toks[:, :, 1:])
    pipeline(os.path.join(args.out, "train-1gpu.toml"), args.target, args.autocast, 0)
    pipeline(os.path.join(args.out, f"train-dp{args.ranks}.toml"), args.target, args.autocast, args.ranks)
    n = sum(v.size for v in model.params.values())
    print(f"gpt2_train.py: {n / 1e6:.1f}M parameters, T {model.T}, batches {args.batch}, {args.steps} steps -> {args.out}")


if __name__ == "__main__":
    main()
