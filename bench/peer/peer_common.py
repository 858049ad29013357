"""What the kernel benchmarks under bench/peer/ share: timing a PyTorch callable with CUDA events,
and compiling + benchmarking a .kir text with the kiln CLI."""

import json
import os
import re
import statistics
import subprocess


# Cycles of torch.cuda._sleep queued ahead of each timed call (~100 us on an H200): longer than
# the host needs to dispatch the call, so the stream is busy when the start event is recorded.
PRIME_CYCLES = 200_000


def device_times_ms(torch, fn, iters, warmup, prime=None):
    """`iters` CUDA-event timings of fn() (ms, in order) after `warmup` untimed calls.

    With `prime`, each timing starts behind a short device sleep, so the start event and fn's
    kernels are all queued before the device reaches them: the span is device time alone, as in
    `kiln bench` (whose timed runs start behind a device wait of their own). Without it the device
    sits idle from the start event until the host has dispatched fn (Python, ATen, the library's
    heuristics), and that host time is counted as well. `prime` defaults to on unless
    KILN_PEER_TIMING=idle asks for the old method (for comparisons)."""
    if prime is None:
        prime = os.environ.get("KILN_PEER_TIMING") != "idle"
    # KILN_PEER_FLUSH_L2=1: read twice the L2 before each timing (cold L2 without dirty lines to
    # write back, as `kiln bench` with KILN_TIMING_FLUSH_L2=1).
    flush = None
    if os.environ.get("KILN_PEER_FLUSH_L2") == "1":
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        flush = torch.zeros(2 * l2 // 4, dtype=torch.int32, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if flush is not None:
            flush.sum()
        if prime:
            torch.cuda._sleep(PRIME_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def median_ms(torch, fn, iters, warmup, prime=None):
    """Median of device_times_ms(torch, fn, iters, warmup, prime)."""
    return statistics.median(device_times_ms(torch, fn, iters, warmup, prime))


def kiln_device_ms(kiln, artifact, report, iterations=None, warmup=None, quiet=True):
    """Benchmarks a compiled artifact with `kiln bench --graphs on` and returns (median ms, whether
    that is device time): CUDA events around the plan's steps, else host latency where the
    device time is not reported. A run that failed is an error."""
    cmd = [kiln, "bench", artifact, "--graphs", "on", "--report-json", report]
    if iterations is not None:
        cmd += ["--iterations", str(iterations)]
    if warmup is not None:
        cmd += ["--warmup", str(warmup)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else None)
    with open(report) as f:
        g = json.load(f)["graphs"]["on"]
    if "error" in g:
        raise RuntimeError(f"kiln bench {artifact}: {g['error']}")
    dev = g.get("device_ms")
    return (dev or g["latency_ms"])["median"], dev is not None


def kiln_bench(kiln, work, name, text, target, iterations, warmup, quiet=False):
    """Writes `text` to WORK/NAME.kir, compiles it for `target` and benchmarks it with CUDA graph
    replay. Returns (median device ms, kernel count from `kiln inspect` or -1, the inspect text)."""
    model = os.path.join(work, name + ".kir")
    with open(model, "w") as f:
        f.write(text)
    artifact, report = os.path.join(work, name + ".kiln"), os.path.join(work, name + ".json")
    subprocess.run([kiln, "compile", model, "--target", target, "-o", artifact], check=True)
    info = subprocess.run([kiln, "inspect", artifact], check=True, capture_output=True, text=True).stdout
    found = re.search(r"kernels (\d+)", info)
    ms, _ = kiln_device_ms(kiln, artifact, report, iterations, warmup, quiet)
    return ms, int(found.group(1)) if found else -1, info
