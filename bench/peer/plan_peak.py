#!/usr/bin/env python3
"""What is live at the peak of a .kiln artifact's static memory plan (no GPU).

    python3 bench/peer/plan_peak.py step.kiln [--top 25]

Reads the plan text, takes each input/output/activation buffer's first..last step (aliases count
for their base), and prints the arena, the step where the live bytes peak, and the largest
buffers live there (dtype, shape, name, the steps that first and last touch them).
"""
import argparse
import collections
import re
import sys


def plan_text(path):
    data = open(path, "rb").read()
    start = data.find(b"kiln-plan 1\n")
    if start < 0:
        sys.exit(f"plan_peak: {path} holds no plan text")
    end = start
    # The plan ends where its lines stop: at the first byte that is not printable text.
    while end < len(data) and (32 <= data[end] < 127 or data[end] in (9, 10)):
        end += 1
    return data[start:end].decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    bufs, steps, arena = {}, [], 0
    for line in plan_text(a.artifact).splitlines():
        if line.startswith("arena bytes="):
            arena = int(line.split("=")[1].split()[0])
        elif line.startswith("buffer "):
            f = line.split()
            kv = dict(x.split("=", 1) for x in f[2:] if "=" in x)
            bufs[int(f[1])] = kv
        elif line.startswith("step "):
            steps.append(line)
    root = {i: int(b["base"]) if b["kind"] == "alias" else i for i, b in bufs.items()}
    first, last = {}, {}
    for s, line in enumerate(steps):
        for ref in re.findall(r"\bb(\d+)\b", line):
            r = root[int(ref)]
            first.setdefault(r, s)
            last[r] = s
    n = len(steps)
    delta = [0] * (n + 3)
    spans = {}
    for i, b in bufs.items():
        k = b["kind"]
        if k not in ("input", "output", "activation") or i not in first and k == "activation":
            continue
        f = -1 if k == "input" else first.get(i, -1)
        l = n if k == "output" else last.get(i, f)
        spans[i] = (f, l)
        delta[f + 1] += int(b["bytes"])
        delta[l + 2] -= int(b["bytes"])
    live, peak, at = 0, 0, 0
    for s in range(n + 1):
        live += delta[s]
        if live > peak:
            peak, at = live, s - 1
    print(f"arena {arena / 2**20:.1f} MiB; live peak {peak / 2**20:.1f} MiB at step {at} of {n}")
    here = [(int(bufs[i]["bytes"]), i) for i, (f, l) in spans.items() if f <= at <= l]
    here.sort(reverse=True)
    groups = collections.Counter()
    for size, i in here:
        b = bufs[i]
        groups[(b["dtype"], b["shape"])] += size
    print("by dtype and shape (MiB):")
    for (dt, shape), size in groups.most_common(a.top):
        print(f"  {size / 2**20:8.1f}  {dt}[{shape}]")
    print("largest buffers:")
    for size, i in here[:a.top]:
        b = bufs[i]
        f, l = spans[i]
        print(f"  {size / 2**20:8.1f}  b{i} {b['kind']} {b['dtype']}[{b['shape']}] {b.get('name', '')} steps {f}..{l}")


if __name__ == "__main__":
    main()
