#!/usr/bin/env python3
"""Kiln's `cpu` backend vs onnxruntime (CPU) vs Kiln's `reference` backend, same threads, one run.

Builds the models with bench/cpu/models.py (random weights), compiles time_backend.cpp against
a Kiln build, times each engine in-process (compile once, warm up, then median of N runs) and
writes a Markdown table to OUT/<date>-cpu.md. The reference backend is slow, so it gets one
timed run after one warm-up.

    python3 bench/cpu/run.py --build /work/build-cpurel [--threads 2] [--iters 20] [--out bench/results]
                             [--passes P1,P2,...] [--note "why a goal is missed"]...
Needs: pip install onnxruntime onnx numpy. The table records the load average before and
after (the numbers mean little on a busy machine) and checks the goals: Kiln `cpu` at least
20x faster than `reference` and within 1.2x of onnxruntime.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MODELS = [("mlp", "8 x Linear(512)+ReLU, batch 1"), ("gpt2", "GPT-2 small, batch 1, seq 128"),
          ("resnet18", "ResNet-18, batch 1, 3x224x224")]
PASSES = "canonicalize,cse,dce,fuse-pointwise"
GOAL_REF, GOAL_ORT = 20.0, 1.2


def loadavg():
    return " ".join(open("/proc/loadavg").read().split()[:3])


def inputs_for(name, rng):
    if name == "gpt2":
        return {"input_ids": rng.integers(0, 50257, (1, 128), dtype=np.int64)}
    if name == "mlp":
        return {"input": rng.standard_normal((1, 512)).astype(np.float32)}
    return {"input": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}


def time_ort(path, feeds, threads, warmup, iters):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for _ in range(warmup):
        out = s.run(None, feeds)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        out = s.run(None, feeds)
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[len(ts) // 2], out[0]


def time_kiln(tool, build, path, backend, npys, threads, warmup, iters, out_npy, passes=PASSES):
    env = dict(os.environ, TIME_BACKEND_OUT=out_npy, OPENBLAS_NUM_THREADS=str(threads))
    r = subprocess.run([tool, os.path.join(build, "lib/kiln/plugins"), path, backend, passes, str(threads),
                        str(warmup), str(iters)] + npys, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed")
    return json.loads(r.stdout.strip().splitlines()[-1]), np.load(out_npy)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="a Kiln build folder (Release)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--work", default="/tmp/kiln-cpu-bench")
    ap.add_argument("--out", default=os.path.join(REPO, "bench/results"))
    ap.add_argument("--only", default=",".join(m for m, _ in MODELS))
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--passes", default=PASSES, help="Kiln passes before the backend")
    ap.add_argument("--note", action="append", default=[], help="a line for the table's notes (repeatable)")
    a = ap.parse_args()
    a.load_before = loadavg()
    os.makedirs(a.work, exist_ok=True)
    # The models are seeded, hence the same each time: built once per work folder.
    missing = [m for m in a.only.split(",") if not os.path.exists(os.path.join(a.work, f"{m}.onnx"))]
    if missing:
        subprocess.run([sys.executable, os.path.join(HERE, "models.py"), a.work, "--only", ",".join(missing)], check=True)
    tool = os.path.join(a.work, "time_backend")
    inc = [f"-I{REPO}/{d}/include" for d in ("core", "ir", "sdk")] + [f"-I{a.build}/include"]
    subprocess.run(["c++", "-O2", "-std=c++20", os.path.join(HERE, "time_backend.cpp"), "-o", tool] + inc +
                   [f"-L{a.build}/lib", "-lkiln_core", "-lkiln_ir", f"-Wl,-rpath,{a.build}/lib"], check=True)
    rows = []
    for name, desc in MODELS:
        if name not in a.only.split(","):
            continue
        path = os.path.join(a.work, f"{name}.onnx")
        feeds = inputs_for(name, np.random.default_rng(0))
        npys = []
        for k, v in feeds.items():
            npys.append(os.path.join(a.work, f"{name}-{k}.npy"))
            np.save(npys[-1], v)
        ort_ms, ort_out = time_ort(path, feeds, a.threads, 3, a.iters)
        row = {"model": name, "desc": desc, "ort": ort_ms}
        for be, (w, n) in [("cpu", (3, a.iters)), ("reference", (0, 1))]:
            if be == "reference" and a.skip_reference:
                continue
            try:
                r, out = time_kiln(tool, a.build, path, be, npys, a.threads, w, n,
                                   os.path.join(a.work, f"{name}-{be}.npy"), a.passes)
                row[be] = r["median_ms"]
                row[be + "_first"] = r["first_ms"]
                row[be + "_err"] = float(np.max(np.abs(out - ort_out)) / (np.max(np.abs(ort_out)) + 1e-30))
            except RuntimeError as e:
                row[be + "_error"] = str(e)
        rows.append(row)
        print(json.dumps(row), flush=True)
    a.load_after = loadavg()
    write_table(a, rows)


def write_table(a, rows):
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    f = lambda v: "—" if v is None else f"{v:.2f}"
    lines = [f"# Kiln `cpu` vs onnxruntime vs Kiln `reference` ({date})", "",
             f"- commit: `{commit}` (plus the working tree's uncommitted cpu backend)",
             f"- machine: {cpu}, {os.cpu_count()} cores; threads: {a.threads} for every engine",
             f"- load average (1, 5, 15 min) before: {a.load_before}; after: {a.load_after} "
             "(the machine is shared: other builds add noise)",
             f"- onnxruntime {ort.__version__} (CPUExecutionProvider, intra-op threads {a.threads}); Kiln build `{a.build}`",
             f"- command: `python3 bench/cpu/run.py --build {a.build} --threads {a.threads} --iters {a.iters}`",
             "- models: built by `bench/cpu/models.py` with onnx's helper and seeded random weights "
             "(full-size architectures; no torch on this machine)",
             f"- Kiln passes: `{a.passes}`; times are medians of in-process runs after compiling "
             f"(cpu: {a.iters} runs after 3 warm-ups; reference: 1 run); max rel. error is against onnxruntime's output",
             f"- goals: Kiln cpu ≥ {GOAL_REF:g}× faster than reference, and cpu / ort ≤ {GOAL_ORT:g}", "",
             "| model | shape | onnxruntime ms | Kiln cpu ms | Kiln reference ms | cpu / ort | reference / cpu | cpu max rel. err | goals |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        c, o, ref = r.get("cpu"), r["ort"], r.get("reference")
        verdict = []
        if c:
            verdict.append(("✓" if c / o <= GOAL_ORT else "✗") + f" ≤{GOAL_ORT:g}× ort")
            if ref:
                verdict.append(("✓" if ref / c >= GOAL_REF else "✗") + f" ≥{GOAL_REF:g}× ref")
        lines.append(f"| {r['model']} | {r['desc']} | {f(o)} | {f(c) if c else r.get('cpu_error', '—')} | "
                     f"{f(ref) if ref else r.get('reference_error', '—')} | {f(c / o) + '×' if c else '—'} | "
                     f"{f(ref / c) + '×' if c and ref else '—'} | {r.get('cpu_err', float('nan')):.1e} | "
                     f"{', '.join(verdict) or '—'} |")
    if a.note:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in a.note]
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{date}-cpu.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    main()
