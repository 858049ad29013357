#!/usr/bin/env python3
"""Runs one exported model through `kiln run` and compares with onnxruntime's saved outputs.

    check_model.py KILN MODEL_DIR [--backend NAME] [--passes LIST | --pipeline P.toml] [--rtol R] [--atol A]

MODEL_DIR holds model.onnx, input_<name>.npy and output_<name>.npy (written by
bench/models/export.py on a machine with PyTorch and onnxruntime). A NaN, or an infinity that
onnxruntime's output does not have in the same place, fails (compare.py).
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

from compare import allclose
from model_dir import input_args, output_files, sym_args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kiln")
    ap.add_argument("model_dir")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--passes", default="canonicalize,cse,dce")
    ap.add_argument("--pipeline", help="a pipeline TOML (its passes and backend options) instead of --passes")
    a = ap.parse_args()

    how = ["--pipeline", a.pipeline] if a.pipeline else ["--passes", a.passes]
    cmd = [a.kiln, "run", os.path.join(a.model_dir, "model.onnx"), "--backend", a.backend] + how + \
        sym_args(a.model_dir) + input_args(a.model_dir)
    expected = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in output_files(a.model_dir):
            expected[name] = (np.load(path), os.path.join(tmp, name + ".npy"))
            cmd += ["--output", f"{name}=@{expected[name][1]}"]
        print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            print(f"FAIL: kiln exited with {proc.returncode}")
            return 1
        ok = True
        for name, (want, got_path) in expected.items():
            v = allclose(want, np.load(got_path), a.rtol, a.atol)
            print(f"{name}: {want.dtype}{list(want.shape)} max abs err {v.measure:.3g}, "
                  f"within rtol={a.rtol} atol={a.atol}: {v.ok}" + ("" if v.ok else f": {v.why}"))
            ok &= v.ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
