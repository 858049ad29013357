#!/usr/bin/env python3
"""All-reduce and all-gather bus bandwidth through Kiln against raw NCCL, on 2+ GPUs of one host.

Kiln: for each op and size, a per-rank program that only does the collective (f32, mesh of
--gpus ranks) is compiled with `kiln compile` and timed by `kiln bench` under `kiln launch`:
the device time of the plan (its one collective step, replayed as a CUDA graph), median over
--iterations runs, from rank 0's report. Raw NCCL: `kiln-nccl-bench` (bench/parallel/
nccl_bench.cpp) under `kiln launch`: the same collective issued --iterations times back to back
on one stream. Bus bandwidth as nccl-tests defines it: all_reduce moves 2 (n - 1) / n of the
buffer per rank, all_gather (n - 1) / n of the gathered buffer. Writes a Markdown table with
the ratio Kiln / NCCL (goal: >= 0.97 from 64 MiB) and the same as JSON.

    python3 bench/parallel/run.py --build build --gpus 2 --out bench/results/parallel-busbw.md
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

MIB = 1 << 20


def program(op, total_bytes, ranks):
    """A per-rank .kir program of one collective: all_reduce of the whole buffer, or all_gather
    of one rank's share into the whole buffer."""
    n = total_bytes // 4
    if op == "all_reduce":
        return (f"graph @all_reduce(%x: f32[{n}]<P(sum)>) -> (f32[{n}]<R>) mesh<tp = {ranks}> per_rank {{\n"
                f"  %y = all_reduce(%x) {{axis = \"tp\"}} : f32[{n}]<R>\n  return %y\n}}\n")
    local = n // ranks
    return (f"graph @all_gather(%x: f32[{local}]<S(0)>) -> (f32[{n}]<R>) mesh<tp = {ranks}> per_rank {{\n"
            f"  %y = all_gather(%x) {{axis = \"tp\", dim = 0}} : f32[{n}]<R>\n  return %y\n}}\n")


def busbw(op, total_bytes, ms, ranks):
    algbw = total_bytes / (ms * 1e-3) / 1e9
    return algbw * (2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks)


def run(cmd, **kw):
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def kiln_ms(args, op, size, work):
    kir = os.path.join(work, f"{op}-{size}.kir")
    art = os.path.join(work, f"{op}-{size}.kiln")
    report = os.path.join(work, f"{op}-{size}.json")
    with open(kir, "w") as f:
        f.write(program(op, size, args.gpus))
    run([args.kiln, "compile", kir, "--target", args.target, "--passes", "", "-o", art])
    run([args.kiln, "launch", "-n", str(args.gpus), "--", args.kiln, "bench", art, "--iterations",
         str(args.iterations), "--warmup", str(args.warmup), "--report-json", report])
    with open(report) as f:
        r = json.load(f)
    dev = r["graphs"]["on"]["device_ms"]
    if dev is None:
        sys.exit(f"kiln bench reported no device time for {op} {size}: {r['graphs']['on']}")
    return dev["median"]


def nccl_ms(args, op, size):
    out = run([args.kiln, "launch", "-n", str(args.gpus), "--", args.nccl_bench, "--op", op, "--min-bytes", str(size),
               "--max-bytes", str(size), "--iterations", str(args.iterations), "--warmup", str(args.warmup)])
    for line in out.splitlines():
        m = re.match(r"^\[rank 0\] (\{.*\})$", line)
        if m:
            return json.loads(m.group(1))["ms"]
    sys.exit(f"no result from kiln-nccl-bench for {op} {size}:\n{out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="the build folder (bin/kiln, bin/kiln-nccl-bench)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--min-mib", type=int, default=1)
    ap.add_argument("--max-mib", type=int, default=1024)
    ap.add_argument("--step", type=int, default=4, help="size factor between measurements")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="parallel-busbw.md")
    args = ap.parse_args()
    args.kiln = os.path.abspath(os.path.join(args.build, "bin", "kiln"))
    args.nccl_bench = os.path.abspath(os.path.join(args.build, "bin", "kiln-nccl-bench"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-parallel-") as work:
        for op in ("all_reduce", "all_gather"):
            size = args.min_mib * MIB
            while size <= args.max_mib * MIB:
                k = kiln_ms(args, op, size, work)
                n = nccl_ms(args, op, size)
                rows.append({"op": op, "bytes": size, "kiln_ms": k, "nccl_ms": n,
                             "kiln_busbw_gbs": busbw(op, size, k, args.gpus),
                             "nccl_busbw_gbs": busbw(op, size, n, args.gpus), "ratio": n / k})
                print(json.dumps(rows[-1]), flush=True)
                size *= args.step
    lines = [f"# Collective bus bandwidth: Kiln vs raw NCCL, {args.gpus} GPUs, f32",
             "", f"median of {args.iterations} runs after {args.warmup} warm-up runs; "
             "Kiln: `kiln bench` device time of a plan holding one collective step (CUDA graph); "
             "NCCL: back-to-back calls timed with CUDA events. Goal: ratio >= 0.97 from 64 MiB.", "",
             "| op | size | Kiln ms | Kiln busbw GB/s | NCCL ms | NCCL busbw GB/s | Kiln / NCCL |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        goal = "" if r["bytes"] < 64 * MIB else (" ok" if r["ratio"] >= 0.97 else " **below goal**")
        lines.append(f"| {r['op']} | {r['bytes'] // MIB} MiB | {r['kiln_ms']:.4f} | {r['kiln_busbw_gbs']:.1f} | "
                     f"{r['nccl_ms']:.4f} | {r['nccl_busbw_gbs']:.1f} | {r['ratio']:.3f}{goal} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
