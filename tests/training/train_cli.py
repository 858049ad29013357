#!/usr/bin/env python3
"""`kiln train`'s errors: each bad input gets a message naming the problem and exit status 1
(2 for a malformed command line), never a crash.

  train_cli.py KILN WORKDIR
"""
import os
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from train_curve import write_task  # noqa: E402

kiln, workdir = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
shutil.rmtree(workdir, ignore_errors=True)
os.makedirs(workdir)
_, kir, toml, data, _ = write_task(models.Mlp, 4, workdir)
failures = []


def expect(args, rc, text):
    r = subprocess.run([kiln, "train", kir, *args], capture_output=True, text=True, cwd=workdir)
    if r.returncode != rc or text not in r.stderr:
        failures.append(f"kiln train {' '.join(args)}: exit {r.returncode} (want {rc}), stderr:\n{r.stderr}\nwanted: {text}")
    return r


base = ["--pipeline", toml, "--data", data, "--steps", "4"]
ckpt = os.path.join(workdir, "c.ckpt")
r = expect(base + ["--checkpoint", ckpt], 0, "pipeline:")
if not os.path.exists(ckpt):
    sys.exit("FAIL: no checkpoint written:\n" + r.stdout + r.stderr + "\n".join(failures))
if len([l for l in r.stdout.splitlines() if l.startswith("step ") and "loss" in l and "samples/s" in l]) != 4:
    failures.append("expected 4 progress lines with loss and samples/s:\n" + r.stdout)
# A flipped byte anywhere is caught by the checksum.
raw = bytearray(open(ckpt, "rb").read())
raw[len(raw) // 2] ^= 0x40
bad = os.path.join(workdir, "bad.ckpt")
open(bad, "wb").write(raw)
expect(base + ["--resume", bad], 1, f"checkpoint '{bad}' is corrupt: checksum mismatch")
open(bad, "wb").write(b"hello")
expect(base + ["--resume", bad], 1, f"'{bad}' is not a kiln checkpoint")
expect(base + ["--resume", os.path.join(workdir, "none.ckpt")], 1, "cannot be opened")
# Resuming past --steps runs nothing and keeps the step count.
r = expect(base + ["--resume", ckpt], 0, "resumed from")
if "step " in r.stdout:
    failures.append("a run resumed at its last step ran steps:\n" + r.stdout)
os.remove(os.path.join(data, "y.npy"))
expect(base, 1, "no data for input 'y' (f32[16, 4])")
np.save(os.path.join(data, "y.npy"), np.zeros((3, 16), dtype=np.float32))
expect(base, 1, "a stacked batch file is [steps, ...] of f32[16, 4]")
expect(["--passes", "autodiff", "--data", data, "--steps", "2"], 1, "the graph keeps no state to train")
expect(["--passes", "autodiff", "--data", data, "--steps", "2", "--lr", "0.1"], 1, "--lr: the pipeline has no 'optimizer' pass")
expect(["--passes", "optimizer", "--data", data, "--steps", "2"], 1, "run autodiff before it")
# fp8-training: bad options are refused when the pipeline is read, and it must come before autodiff.
expect(["--passes", "fp8-training{algorithm=mean},autodiff,optimizer", "--data", data, "--steps", "2"], 1,
       "fp8-training: option 'algorithm' must be max or most_recent, got 'mean'")
expect(["--passes", "fp8-training{format=e5m2},autodiff,optimizer", "--data", data, "--steps", "2"], 1,
       "fp8-training: option 'format' must be hybrid or e4m3, got 'e5m2'")
expect(["--passes", "autodiff,fp8-training,optimizer", "--data", data, "--steps", "2"], 1,
       "run fp8-training before autodiff")
expect(["--passes", "autodiff,optimizer,fp8-training", "--data", data, "--steps", "2"], 1,
       "fp8-training: the graph already holds an optimizer step; run fp8-training before autodiff and optimizer")
expect(base[:-1] + ["0"], 2, "--steps must be at least 1")
expect(["--pipeline", toml, "--steps", "2"], 2, "--data DIR is required")
if failures:
    sys.exit("FAIL:\n" + "\n\n".join(failures))
print("PASS")
