#!/usr/bin/env python3
"""Two-GPU checks of Kiln's NCCL runtime (needs 2+ GPUs of one host; numpy).

1. Per-rank programs with every collective over 2 ranks (including the packing kernels of
   inner dims and local_shard of weights) run under `kiln launch -n 2` on a CUDA backend, and
   their whole outputs match the reference interpreter's whole-mesh run of the same program.
2. The watchdog: two ranks of a long `kiln bench` started by hand (torchrun's variables, no
   launcher to stop them), rank 1 killed mid-run; rank 0 must exit non-zero within
   --timeout + 10 s with an error naming the collective.

    python3 bench/parallel/check.py --build build [--backend cuda-sm90]
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

PROGRAMS = {
    "tp_mlp": """graph @mlp(%x: f32[16, 64]<R>, %w1: f32[64, 64]<S(0)>, %w2: f32[64, 64]<S(1)>) -> (f32[16, 64]<R>) mesh<tp = 2> per_rank {
  %h = linear(%x, %w1) : f32[16, 64]<S(1)>
  %a = relu(%h) : f32[16, 64]<S(1)>
  %p = linear(%a, %w2) : f32[16, 64]<P(sum)>
  %y = all_reduce(%p) {axis = "tp"} : f32[16, 64]<R>
  return %y
}
""",
    "gather_inner": """graph @g(%x: f32[4, 3, 5]<S(1)>) -> (f32[4, 6, 5]<R>) mesh<tp = 2> per_rank {
  %y = all_gather(%x) {axis = "tp", dim = 1} : f32[4, 6, 5]<R>
  return %y
}
""",
    "scatter_inner": """graph @s(%x: f32[3, 8]<R>) -> (f32[3, 4]<S(1)>) mesh<tp = 2> per_rank {
  %y = reduce_scatter(%x) {axis = "tp", dim = 1, reduce = "max"} : f32[3, 4]<S(1)>
  return %y
}
""",
    "all_to_all": """graph @a(%x: f32[4, 6]<S(0)>) -> (f32[8, 3]<S(1)>) mesh<tp = 2> per_rank {
  %y = all_to_all(%x) {axis = "tp", split_dim = 1, concat_dim = 0} : f32[8, 3]<S(1)>
  return %y
}
""",
    "broadcast_2d": """graph @b(%x: bf16[6]<R, R>) -> (bf16[6]<R, R>) mesh<dp = 1, tp = 2> per_rank {
  %y = broadcast(%x) {axis = "tp", root = 1} : bf16[6]<R, R>
  return %y
}
""",
    "local_shard_weight": """graph @l(%x: f32[5, 8]<R>) -> (f32[5, 2]<R>) mesh<tp = 2> per_rank {
  %w = constant() {value = dense<f32[8, 2]>[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]} : f32[8, 2]
  %ws = local_shard(%w) {axis = "tp", dim = 0} : f32[4, 2]
  %xs = local_shard(%x) {axis = "tp", dim = 1} : f32[5, 4]
  %p = matmul(%xs, %ws) : f32[5, 2]
  %y = all_reduce(%p) {axis = "tp"} : f32[5, 2]<R>
  return %y
}
""",
    "local_shard_activation": """graph @l(%x: f32[5, 8]<R>) -> (f32[5, 8]<R>) mesh<tp = 2> per_rank {
  %xs = local_shard(%x) {axis = "tp", dim = 1} : f32[5, 4]
  %y = all_gather(%xs) {axis = "tp", dim = 1} : f32[5, 8]<R>
  return %y
}
"""
}


def run(cmd, **kw):
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_programs(args, work):
    failures = 0
    for name, text in PROGRAMS.items():
        kir = os.path.join(work, name + ".kir")
        with open(kir, "w") as f:
            f.write(text)
        ref = os.path.join(work, name + "-reference.npy")
        got = os.path.join(work, name + "-cuda.npy")
        r = run([args.kiln, "run", kir, "--random-inputs", "--seed", "7", "--output", "y=@" + ref])
        c = run([args.kiln, "launch", "-n", "2", "--", args.kiln, "run", kir, "--backend", args.backend,
                 "--random-inputs", "--seed", "7", "--output", "y=@" + got])
        if r.returncode or c.returncode:
            print(f"FAIL {name}: reference rc {r.returncode}, cuda rc {c.returncode}\n{r.stderr}\n{c.stdout}\n{c.stderr}")
            failures += 1
            continue
        a, b = np.load(ref).astype(np.float64), np.load(got).astype(np.float64)
        err = np.max(np.abs(a - b)) / max(1e-30, np.max(np.abs(a)))
        ok = a.shape == b.shape and err < 1e-3
        print(f"{'PASS' if ok else 'FAIL'} {name}: shape {b.shape}, max relative error {err:.2e}")
        failures += 0 if ok else 1
    return failures


def check_watchdog(args, work):
    """Rank 1 killed mid-run: rank 0 must fail within the collective timeout + 10 s."""
    kir = os.path.join(work, "long.kir")
    with open(kir, "w") as f:  # a few milliseconds of GEMMs and a 64 MiB all_reduce per run
        f.write("""graph @mlp(%x: f32[4096, 4096]<R>, %w1: f32[2048, 4096]<S(0)>, %w2: f32[4096, 2048]<S(1)>) -> (f32[4096, 4096]<R>) mesh<tp = 2> per_rank {
  %h = linear(%x, %w1) : f32[4096, 2048]<S(1)>
  %a = relu(%h) : f32[4096, 2048]<S(1)>
  %p = linear(%a, %w2) : f32[4096, 4096]<P(sum)>
  %y = all_reduce(%p) {axis = "tp"} : f32[4096, 4096]<R>
  return %y
}
""")
    art = os.path.join(work, "long.kiln")
    c = run([args.kiln, "compile", kir, "--target", args.target, "-o", art])
    if c.returncode:
        print(f"FAIL watchdog: compile: {c.stderr}")
        return 1
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        procs.append(subprocess.Popen([args.kiln, "bench", art, "--iterations", "1000000", "--warmup", "0",
                                       "--collective-timeout", str(args.timeout)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    time.sleep(args.kill_after)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    try:
        out, err = procs[0].communicate(timeout=args.timeout + 10)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        print(f"FAIL watchdog: rank 0 still running {args.timeout + 10} s after rank 1 was killed")
        return 1
    took = time.time() - killed
    ok = procs[0].returncode != 0 and ("collective" in err or "NCCL" in err)
    print(f"{'PASS' if ok else 'FAIL'} watchdog: rank 0 exited {procs[0].returncode} {took:.1f} s after rank 1 was "
          f"killed (timeout {args.timeout} s):\n{err.strip()}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--backend", default="cuda-sm90")
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--timeout", type=int, default=30, help="collective timeout of the watchdog check, seconds")
    ap.add_argument("--kill-after", type=float, default=20, help="seconds before rank 1 is killed")
    args = ap.parse_args()
    args.kiln = os.path.abspath(os.path.join(args.build, "bin", "kiln"))
    with tempfile.TemporaryDirectory(prefix="kiln-check-") as work:
        failures = check_programs(args, work) + check_watchdog(args, work)
    print("PASS" if failures == 0 else f"FAIL: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
