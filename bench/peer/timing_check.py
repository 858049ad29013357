#!/usr/bin/env python3
"""How much of a per-call CUDA-event timing is the host's dispatch: times the peers of the INT4 and
FP8 benchmarks (cuBLAS bf16 GEMMs at M = 1 and 16 over 8192x8192 weights, torch._scaled_mm
8192^3) and two PyTorch reductions three ways: events around each call on an idle stream (the
method the peer benchmarks used up to 2026-12-02), events around each call behind a device sleep
(peer_common.median_ms now), one call captured in a CUDA graph and replayed behind a device sleep
(the structure of `kiln bench`'s device time: events around one graph launch on a busy stream),
and a CUDA graph of 20 back-to-back calls replayed (per call). Writes a Markdown table to --out.

    /opt/torch/.venv/bin/python3 bench/peer/timing_check.py --out timing.md
"""
import argparse

import torch

from peer_common import median_ms


def graph_ms(fn, reps=20, iters=50):
    """Per-call device time of `reps` back-to-back calls captured in one CUDA graph, each replay
    timed behind a device sleep."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return median_ms(torch, g.replay, iters, 1, prime=True) / reps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=100)
    a = p.parse_args()
    torch.manual_seed(0)
    cases = []
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for m in (1, 16):
        x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
        cases.append((f"torch.matmul bf16 M={m}, 8192x8192 weights (INT4 peer)", lambda x=x: torch.matmul(x, w.t())))
    xq = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    cases.append(("torch._scaled_mm fp8 8192^3 (FP8 peer)",
                  lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)))
    for mb in (32, 128):
        v = torch.randn(mb * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
        cases.append((f"x.sum() bf16 {mb} MB", lambda v=v: v.sum()))
    rows = ["| call | idle-stream events (ms) | primed events (ms) | graph of 1, primed (ms) | graph of 20, per call (ms) |",
            "|---|---:|---:|---:|---:|"]
    for name, fn in cases:
        idle = median_ms(torch, fn, a.iters, 10, prime=False)
        primed = median_ms(torch, fn, a.iters, 10, prime=True)
        rows.append(f"| {name} | {idle:.4f} | {primed:.4f} | {graph_ms(fn, reps=1, iters=a.iters):.4f} | {graph_ms(fn):.4f} |")
    text = f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + "\n".join(rows) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
