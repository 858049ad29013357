#!/usr/bin/env python3
"""Measures what the parallelism planner's cost model needs on this machine and writes it as the
probe TOML `kiln plan --probe` and `[parallel] strategy = "auto"` (option `probe`) read:
sustained matmul FLOP/s per dtype, HBM bandwidth, and, with two or more GPUs, the NCCL
all-reduce bus bandwidth and per-step latency between them. Needs PyTorch with CUDA.

    python3 bench/parallel/probe.py -o probe.toml [--gpus N] [--size 8192]

With one GPU there is no link to measure: the [link] section says `measured = false` and
carries the documented defaults (docs/parallel.md), which the planner then reports as unmeasured.
"""
import argparse
import os
import sys
import time

DEFAULT_LINK_BW = 360e9     # NVLink 4 at the ~80% NCCL rings reach (docs/parallel.md)
DEFAULT_LINK_LAT = 1.5e-6   # seconds a ring step


def timed(fn, iters, torch):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def matmul_rates(torch, n):
    rates = {}
    for name, dt in (("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32)):
        a = torch.randn(n, n, device="cuda", dtype=dt)
        b = torch.randn(n, n, device="cuda", dtype=dt)
        if dt == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False  # Kiln's f32 matmuls are true fp32
        rates[name] = 2 * n ** 3 / timed(lambda: a @ b, 10, torch)
    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device="cuda")
        rates["fp8"] = 2 * n ** 3 / timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                                     out_dtype=torch.bfloat16), 10, torch)
    except Exception as e:  # no fp8 GEMM on this GPU or torch
        print(f"probe: fp8 matmul not measured ({e})", file=sys.stderr)
    return rates


def hbm_bandwidth(torch):
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), 20, torch)  # read + write


def link_worker(rank, world, port, out):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    small = torch.empty(8, dtype=torch.uint8, device="cuda")
    t_big = timed(lambda: dist.all_reduce(big), 20, torch)
    t_small = timed(lambda: dist.all_reduce(small), 200, torch)
    if rank == 0:
        p = world
        bus = 2 * (p - 1) / p * big.numel() / t_big  # nccl-tests' bus bandwidth
        with open(out, "w") as f:
            f.write(f"{bus} {t_small / (2 * (p - 1))}\n")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--gpus", type=int, default=0, help="GPUs for the link test (default: all)")
    ap.add_argument("--size", type=int, default=8192, help="matmul size n (n x n x n)")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("probe: no CUDA device")
    name = torch.cuda.get_device_name(0)
    rates = matmul_rates(torch, a.size)
    hbm = hbm_bandwidth(torch)
    gpus = a.gpus or torch.cuda.device_count()
    link = None
    if gpus >= 2:
        import tempfile
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "link.txt")
            mp.spawn(link_worker, args=(gpus, 29500 + os.getpid() % 1000, out), nprocs=gpus)
            bw, lat = map(float, open(out).read().split())
            link = (bw, lat)
    lines = [f"# bench/parallel/probe.py on {name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "[device]", f'name = "{name}"', f"gpus = {gpus}",
             "[matmul]  # sustained FLOP/s, n = %d" % a.size]
    lines += [f"{k} = {v:.4g}" for k, v in rates.items()]
    lines += ["[memory]", f"bandwidth = {hbm:.4g}  # bytes read + written per second"]
    if link:
        lines += ["[link]", "measured = true", f"bandwidth = {link[0]:.4g}  # all-reduce bus bandwidth over {gpus} GPUs, 256 MiB",
                  f"latency = {link[1]:.4g}  # seconds a ring step (8-byte all-reduce / 2(p-1))"]
    else:
        lines += ["[link]", "measured = false  # one GPU: no link to measure; documented defaults",
                  f"bandwidth = {DEFAULT_LINK_BW:.4g}", f"latency = {DEFAULT_LINK_LAT:.4g}"]
    with open(a.output, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(open(a.output).read(), end="")


if __name__ == "__main__":
    main()
