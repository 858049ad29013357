#!/usr/bin/env python3
"""Runs a quantizing pipeline on one exported model with a backend and with the reference
interpreter, and checks that the two agree (SQNR of every output, the reference as signal).

    check_quantized.py KILN MODEL_DIR --pipeline FILE.toml [--backend NAME] [--floor DB] [--min-size N]
                       [--skip-without-gpu]

Both runs use the same pipeline, so the same quantization: what is measured is the backend's
kernels (fused quantize epilogues, FP8 GEMMs, INT4 dequantize-GEMMs) against the op definitions,
not the quantization error. A pipeline that reads static scales (scales=scales.json) gets them
from `kiln calibrate` over the model's saved inputs first, in a scratch folder.
A check that quantized nothing would pass trivially, so `kiln quant-report` counts the
quantized contractions first and none is a failure. A NaN, or an infinity the reference does not
have in the same place, fails (compare.py). --min-size N replaces the pipeline's
min-size (the small test models' weights are under the example pipelines' 65536 elements).
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from compare import sqnr_at_least
from model_dir import input_args, output_files, sym_args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kiln")
    ap.add_argument("model_dir")
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--floor", type=float, default=20.0, help="smallest SQNR in dB that passes")
    ap.add_argument("--min-size", type=int, help="use this min-size in place of the pipeline's")
    ap.add_argument("--skip-without-gpu", action="store_true",
                    help="exit 77 (ctest's skip) when the backend reports no CUDA device")
    a = ap.parse_args()
    kiln, model = os.path.abspath(a.kiln), os.path.abspath(os.path.join(a.model_dir, "model.onnx"))
    pipeline = os.path.abspath(a.pipeline)
    common, inputs = sym_args(a.model_dir), input_args(a.model_dir)
    outputs = [name for name, _ in output_files(a.model_dir)]
    with tempfile.TemporaryDirectory() as tmp:
        def run(cmd):
            print(" ".join(cmd), flush=True)
            p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            sys.stderr.write(p.stderr)
            return p

        text = open(pipeline).read()
        if a.min_size is not None:
            text = re.sub(r"(min-size\s*=\s*)\d+", rf"\g<1>{a.min_size}", text)
            pipeline = os.path.join(tmp, "pipeline.toml")
            with open(pipeline, "w") as f:
                f.write(text)
        # The saved inputs as one input set, for kiln calibrate and kiln quant-report.
        sets = os.path.join(tmp, "inputs")
        os.makedirs(sets)
        for path in glob.glob(os.path.join(a.model_dir, "input_*.npy")):
            os.symlink(os.path.abspath(path), os.path.join(sets, os.path.basename(path)))
        if "scales=" in text:
            calibrate = [kiln, "calibrate", model, "--pipeline", pipeline, "--inputs", sets, "-o", "scales.json"]
            if run(calibrate + common).returncode != 0:
                print("FAIL: kiln calibrate failed")
                return 1
        report = run([kiln, "quant-report", model, "--pipeline", pipeline, "--inputs", sets] + common)
        if report.returncode != 0:
            print("FAIL: kiln quant-report failed")
            return 1
        line = re.search(r"^contractions by op: (.*)$", report.stdout, re.M)
        counts = dict(re.findall(r"(\S+) (\d+)", line.group(1))) if line else {}
        quantized = sum(int(counts.get(op, 0)) for op in ("scaled_matmul", "matmul_int4"))
        print(f"quantized contractions: {quantized} of {sum(map(int, counts.values()))}")
        if quantized == 0:
            print("FAIL: the pipeline quantized no layer of this model, so the check would test nothing")
            return 1
        got = {}
        for backend in (a.backend, "reference"):
            outs = []
            for name in outputs:
                outs += ["--output", f"{name}=@{os.path.join(tmp, backend + '_' + name + '.npy')}"]
            p = run([kiln, "run", model, "--pipeline", pipeline, "--backend", backend] + common + inputs + outs)
            if p.returncode != 0:
                if a.skip_without_gpu and "no CUDA device" in p.stderr:
                    print(f"SKIP: backend {backend} found no CUDA device on this machine")
                    return 77
                print(f"FAIL: kiln run on {backend} failed")
                return 1
            got[backend] = {n: np.load(os.path.join(tmp, backend + "_" + n + ".npy")).astype(np.float64) for n in outputs}
    ok = True
    for name in outputs:
        v = sqnr_at_least(got["reference"][name], got[a.backend][name], a.floor)
        print(f"{name}: {a.backend} vs reference SQNR {v.measure:.1f} dB (floor {a.floor}): {v.ok}" +
              ("" if v.ok else f": {v.why}"))
        ok &= v.ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
