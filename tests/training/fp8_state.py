#!/usr/bin/env python3
"""FP8 training's delayed scaling against a NumPy implementation of Transformer Engine's recipe.

Two linear layers y1 = x @ w1^T, y = y1 @ w2^T with loss = sum(y * r) (so dy = r) train with
fp8-training, autodiff and plain SGD on the reference backend. NumPy repeats every step: E4M3
rounding of x, y1, w1 and w2 with the scales of earlier steps, the E5M2 rounding of dy and of
dy1 (itself an FP8 GEMM of the rounded dy and w2), the SGD updates, the amax histories and the
next scales. The test compares every step's loss and, from a checkpoint, each history, scale
and weight. Several recipes: algorithm max and most_recent, history lengths, a margin, the
e4m3-only format, a step whose input is all zero (the scales must stay), tiny gradients that
only a scale keeps from flushing to zero, and both initial scales: the first step's own amaxes
(initial-scale=current, the default) or 1 (initial-scale=one).

  fp8_state.py KILN WORKDIR
"""
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import read_checkpoint  # noqa: E402

B, K, H, N, STEPS, LR = 8, 16, 32, 8, 7, 0.5
FORMATS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}


def round_f8(v, fmt):
    """Round to nearest even into an f8 format, saturating (as Kiln's quantize)."""
    mbits, emin, top = FORMATS[fmt]
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    with np.errstate(divide="ignore"):
        e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), emin)
    quantum = np.exp2(e - mbits)
    r = np.minimum(np.round(a / quantum) * quantum, top)
    return np.where(a > 0, np.sign(v) * r, 0.0)


def quantize(x, scale, fmt):
    """x / scale as an f32 division, rounded to f8; returns the real values (q * scale)."""
    q = round_f8(np.float32(x) / np.float32(scale), fmt)
    return q * np.float64(np.float32(scale))


class Recipe:
    def __init__(self, history, algorithm, margin, fmt, initial="current"):
        self.history, self.algorithm, self.margin, self.fmt, self.initial = history, algorithm, margin, fmt, initial

    def update(self, state, amax):
        hist, scale = state
        hist = np.concatenate([[amax], hist[:-1]]).astype(np.float32)
        m = hist.max() if self.algorithm == "max" else np.float32(amax)
        if 0 < m <= np.finfo(np.float32).max:
            scale = np.float32(np.float32(m) * np.float32(2.0 ** self.margin / FORMATS[self.fmt][2]))
        return hist, scale

    def scale_now(self, state, amax):
        """The scale this step quantizes with: the delayed one, or while the history holds no positive
        amax (initial-scale=current) the one this step's amax gives."""
        if self.initial == "current" and not state[0].max() > 0:
            return self.update(state, amax)[1]
        return state[1]


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (STEPS, B, K)).astype(np.float32)
    x[:, :, 0] *= np.linspace(1, 40, STEPS)[:, None]  # the activation's range grows
    x[3] = 0                                            # an all-zero step: its scales must stay
    r = (rng.normal(0, 1, (STEPS, B, N)) * 1e-6).astype(np.float32)  # below e5m2's subnormals
    w1 = rng.normal(0, 0.3, (H, K)).astype(np.float32)
    w2 = rng.normal(0, 0.3, (N, H)).astype(np.float32)
    return x, r, w1, w2


def numpy_run(recipe, x, r, w1, w2):
    grad_fmt = "e4m3" if recipe.fmt == "e4m3" else "e5m2"
    fwd = Recipe(recipe.history, recipe.algorithm, recipe.margin, "e4m3", recipe.initial)
    bwd = Recipe(recipe.history, recipe.algorithm, recipe.margin, grad_fmt, recipe.initial)
    st = {k: (np.zeros(recipe.history, np.float32), np.float32(1)) for k in ("x", "w1", "y1", "w2", "y1.grad", "y.grad")}
    losses = []

    def q(v, k, rec, fmt):
        return quantize(v, rec.scale_now(st[k], np.abs(v).max()), fmt)

    for t in range(STEPS):
        xd, w1d, w2d = (q(v, k, fwd, "e4m3") for v, k in ((x[t], "x"), (w1, "w1"), (w2, "w2")))
        y1 = (xd @ w1d.T).astype(np.float32)
        y1d = q(y1, "y1", fwd, "e4m3")
        y = (y1d @ w2d.T).astype(np.float32)
        losses.append(float(np.sum(y.astype(np.float64) * r[t])))
        gd = q(r[t], "y.grad", bwd, grad_fmt)
        dw2 = (gd.T @ y1d).astype(np.float32)
        dy1 = (gd @ w2d).astype(np.float32)  # an FP8 GEMM too: the rounded dy and w2
        g1d = q(dy1, "y1.grad", bwd, grad_fmt)
        dw1 = (g1d.T @ xd).astype(np.float32)
        for k, v, rec in (("x", x[t], fwd), ("w1", w1, fwd), ("y1", y1, fwd), ("w2", w2, fwd),
                          ("y.grad", r[t], bwd), ("y1.grad", dy1, bwd)):
            st[k] = rec.update(st[k], np.abs(v).max())
        w1 = (w1 - np.float32(LR) * dw1).astype(np.float32)
        w2 = (w2 - np.float32(LR) * dw2).astype(np.float32)
    return np.array(losses), st, {"w1": w1, "w2": w2}


def kir(w1, w2):
    def const(name, w):
        values = ", ".join(repr(float(v)) for v in w.reshape(-1))
        return f"  %{name} = constant() {{value = dense<f32[{w.shape[0]}, {w.shape[1]}]>[{values}]}} : f32[{w.shape[0]}, {w.shape[1]}]\n"
    return (f"graph @fp8(%x: f32[{B}, {K}], %r: f32[{B}, {N}]) -> (%loss: f32[]) {{\n" + const("w1", w1) + const("w2", w2) +
            f"""  %y1 = linear(%x, %w1) : f32[{B}, {H}]
  %y = linear(%y1, %w2) : f32[{B}, {N}]
  %p = mul(%y, %r) : f32[{B}, {N}]
  %loss = reduce_sum(%p) {{keepdims = 0}} : f32[]
  return %loss
}}
""")


def check(kiln, workdir, recipe):
    os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
    x, r, w1, w2 = data(recipe.history * 7 + recipe.margin)
    np.save(os.path.join(workdir, "data", "x.npy"), x)
    np.save(os.path.join(workdir, "data", "r.npy"), r)
    with open(os.path.join(workdir, "model.kir"), "w") as f:
        f.write(kir(w1, w2))
    with open(os.path.join(workdir, "train.toml"), "w") as f:
        f.write(f"""frontend = "kir"

[[passes]]
name = "fp8-training"
options = {{ history = {recipe.history}, algorithm = "{recipe.algorithm}", margin = {recipe.margin}, format = "{"e4m3" if recipe.fmt == "e4m3" else "hybrid"}", initial-scale = "{recipe.initial}" }}

[[passes]]
name = "autodiff"

[[passes]]
name = "optimizer"
options = {{ algorithm = "sgd", lr = {LR} }}

[backend]
name = "reference"
""")
    ckpt, losses = os.path.join(workdir, "run.ckpt"), os.path.join(workdir, "losses.npy")
    cmd = [kiln, "train", os.path.join(workdir, "model.kir"), "--pipeline", os.path.join(workdir, "train.toml"),
           "--data", os.path.join(workdir, "data"), "--steps", str(STEPS), "--checkpoint", ckpt, "--loss-file", losses]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    want_losses, want, want_w = numpy_run(recipe, x, r, w1, w2)
    got = read_checkpoint(ckpt)
    label = (f"history={recipe.history} algorithm={recipe.algorithm} margin={recipe.margin} format={recipe.fmt} "
             f"initial-scale={recipe.initial}")
    np.testing.assert_allclose(np.load(losses), want_losses, rtol=1e-5, atol=1e-12, err_msg=label + ": losses")
    for name, (hist, scale) in want.items():
        np.testing.assert_allclose(got[name + ".amax_history"], hist, rtol=1e-6, err_msg=f"{label}: {name}.amax_history")
        np.testing.assert_allclose(got[name + ".fp8_scale"], scale, rtol=1e-6, err_msg=f"{label}: {name}.fp8_scale")
    for name, w0 in (("w1", w1), ("w2", w2)):
        np.testing.assert_allclose(got[name], want_w[name], rtol=1e-5, atol=1e-7, err_msg=f"{label}: {name}")
        if not np.any(want_w[name] != w0):
            sys.exit(f"FAIL: {label}: {name} never moved: its gradient flushed to zero")
    print(f"  {label}: {STEPS} steps, losses, 6 histories and scales, both weights match NumPy "
          f"(x.fp8_scale {float(got['x.fp8_scale']):.4g}, y1.grad.fp8_scale {float(got['y1.grad.fp8_scale']):.4g})")


def main():
    kiln, workdir = sys.argv[1], sys.argv[2]
    recipes = [Recipe(4, "max", 0, "hybrid"), Recipe(3, "most_recent", 0, "hybrid"), Recipe(1, "max", 2, "hybrid"),
               Recipe(16, "max", -1, "e4m3"), Recipe(4, "max", 0, "hybrid", "one")]
    for i, recipe in enumerate(recipes):
        check(kiln, os.path.join(workdir, str(i)), recipe)
    print("PASS")


if __name__ == "__main__":
    main()
