#!/usr/bin/env python3
"""`kiln checkpoint` end to end: weights saved from a tensor-parallel run over 2 ranks load into
a model of the same shapes (other weights) on 4 ranks and on one, directly and after
`kiln checkpoint reshard`, and the outputs match the original model's; bad uses fail clearly.

    check_checkpoint.py KILN
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def dense(shape, rng):
    vals = ", ".join(f"{v:.6f}" for v in rng.standard_normal(int(np.prod(shape))) / np.sqrt(shape[-1]))
    return f"dense<f32[{', '.join(map(str, shape))}]>[{vals}]"


def write_mlp(path, seed, ff=32):
    rng = np.random.default_rng(seed)
    text = f"""graph @mlp(%x: f32[B, 16]) -> (f32[B, 16]) {{
  %w1 = constant() {{value = {dense((ff, 16), rng)}}} : f32[{ff}, 16]
  %b1 = constant() {{value = {dense((ff,), rng)}}} : f32[{ff}]
  %w2 = constant() {{value = {dense((16, ff), rng)}}} : f32[16, {ff}]
  %h = linear(%x, %w1, %b1) : f32[B, {ff}]
  %a = relu(%h) : f32[B, {ff}]
  %y = linear(%a, %w2) : f32[B, 16]
  return %y
}}
"""
    with open(path, "w") as f:
        f.write(text)


def kiln(*args):
    return subprocess.run([KILN, *args], capture_output=True, text=True)


def run(model, out, passes, *extra):
    p = kiln("run", model, "--passes", passes, "--random-inputs", "--seed", "3", "--sym", "B=8",
             "--output", f"y=@{out}", *extra)
    if p.returncode != 0:
        print(p.stderr[-2000:])
        return None
    return np.load(out)


def main():
    global KILN
    KILN = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        trained, fresh, other = (os.path.join(tmp, n) for n in ("trained.kir", "fresh.kir", "other.kir"))
        write_mlp(trained, 1)
        write_mlp(fresh, 2)
        write_mlp(other, 3, ff=24)
        want = run(trained, os.path.join(tmp, "want.npy"), "canonicalize,cse")
        check(want is not None, "the trained model runs")

        tp = 'canonicalize,cse,tensor-parallel{mesh="tp=%d"}'
        ck2 = os.path.join(tmp, "ck2")
        p = kiln("checkpoint", "save", trained, ck2, "--passes", tp % 2, "--sym", "B=8")
        check(p.returncode == 0 and os.path.exists(os.path.join(ck2, "checkpoint.toml")), "save from tp=2: " + p.stderr.strip())
        p = kiln("checkpoint", "info", ck2)
        check(p.returncode == 0 and "mesh <tp = 2>" in p.stdout and "w1: f32[32, 16]<S(0)>, rank 0 holds f32[16, 16]" in p.stdout
              and "w2: f32[16, 32]<S(1)>" in p.stdout, "info shows the placements:\n" + p.stdout)

        other_out = run(fresh, os.path.join(tmp, "fresh.npy"), "canonicalize,cse")
        check(other_out is not None and not np.allclose(other_out, want), "the fresh model's own weights give other outputs")
        for ranks in (1, 2, 4):
            passes = tp % ranks if ranks > 1 else "canonicalize,cse"
            got = run(fresh, os.path.join(tmp, f"got{ranks}.npy"), passes, "--weights", ck2)
            check(got is not None and np.allclose(got, want, rtol=1e-4, atol=1e-5),
                  f"tp=2 checkpoint, run on {ranks} rank(s): outputs match")

        ck4 = os.path.join(tmp, "ck4")
        p = kiln("checkpoint", "reshard", ck2, ck4, "--mesh", "tp=4")
        check(p.returncode == 0, "reshard to tp=4: " + p.stderr.strip())
        p = kiln("checkpoint", "info", ck4)
        check("w1: f32[32, 16]<S(0)>, rank 0 holds f32[8, 16]" in p.stdout, "tp=4 pieces are a quarter:\n" + p.stdout)
        check(len([f for f in os.listdir(ck4) if f.startswith("0-w1")]) == 4, "four files for w1")
        got = run(fresh, os.path.join(tmp, "got-r4.npy"), tp % 4, "--weights", ck4)
        check(got is not None and np.allclose(got, want, rtol=1e-4, atol=1e-5), "resharded tp=4 checkpoint: outputs match")

        p = kiln("run", other, "--weights", ck2, "--random-inputs", "--sym", "B=8")
        check(p.returncode == 1 and "weights: 'w1' is f32[32, 16], the model's %w1 is f32[24, 16]" in p.stderr,
              "a checkpoint of other shapes: " + p.stderr.strip())
        p = kiln("checkpoint", "reshard", ck2, os.path.join(tmp, "bad"), "--mesh", "tp=64")
        check(p.returncode == 1 and "reshard: tensor 'w1' on mesh <tp = 64>" in p.stderr, "indivisible mesh: " + p.stderr.strip())
        p = kiln("checkpoint", "info", os.path.join(tmp, "none"))
        check(p.returncode == 1 and "has no checkpoint.toml" in p.stderr, "missing checkpoint: " + p.stderr.strip())
        p = kiln("checkpoint", "frobnicate")
        check(p.returncode == 2 and "unknown action 'frobnicate'" in p.stderr, "unknown action: usage error")
    print("PASS" if not FAILURES else f"FAIL ({len(FAILURES)})")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
