#!/usr/bin/env python3
"""INT4 weight-only GEMM: cuBLAS bf16 (torch.matmul) against Kiln's matmul_int4, on the GPU machine.

For weights N x K = 8192 x 8192 and M = 1, 2, 4, 8, 16, 32, 64 (--m to change), times
torch.matmul(x, W^T) in bf16 with CUDA events (peer_common.median_ms: device time, the host's
dispatch not counted), and Kiln's one-node graph
    %y = matmul_int4(%x, %w, %s) {group_size = G}
(x bf16[M, K], w u8[N, K/2], s f16[N, K/G], graph inputs, or with --constants the weights,
scales and zeros as constants read from a .bin beside the .kir, as a quantized model holds them) through
`kiln compile X.kir --target sm_90a` and `kiln bench X.kiln --report-json F` (device time of the
plan's steps, CUDA graphs on, median). Writes a Markdown table of device times, speedups and the
weight bytes (packed + scales, + zeros) per second to --out; --group 32,64,128 writes one table per
group size, --asymmetric uses zero points.

--roofline BUILD/bin/kiln-read-roofline also measures, in the same run, the fastest this GPU reads
each table's weight bytes and cuBLAS's bf16 weights once from cold L2 (bench/roofline): the floor
under any kernel that streams them. cuBLAS / (INT4 read floor) bounds the speedup any INT4 kernel
can show where cuBLAS takes that long.

    /opt/torch/.venv/bin/python3 bench/peer/int4.py --kiln BUILD/bin/kiln --out bench/results/int4.md
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from peer_common import kiln_device_ms, median_ms


def torch_ms(m, n, k, iters):
    import torch
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return median_ms(torch, lambda: torch.matmul(x, w.t()), iters, 10)


WRITTEN = {}  # .bin name -> write_constants' layout, one file per weight set


def write_constants(path, n, k, g, symmetric):
    """Random packed weights, f16 scales in [0.002, 0.02) and zeros 0..15 into `path`; returns
    each tensor's (offset, .kir type)."""
    import torch
    gen = torch.Generator().manual_seed(7)
    parts = [("w", f"u8[{n}, {k // 2}]", torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)),
             ("s", f"f16[{n}, {k // g}]", (torch.rand(n, k // g, generator=gen) * 0.018 + 0.002).half())]
    if not symmetric:
        parts.append(("z", f"f16[{n}, {k // g}]", torch.randint(0, 16, (n, k // g), generator=gen).half()))
    out, at = {}, 0
    with open(path, "wb") as f:
        for name, ty, t in parts:
            data = t.numpy().tobytes()
            f.write(data)
            out[name] = (at, ty)
            at += len(data)
    return out


def kiln_ms(kiln, m, n, k, g, symmetric, work, constants=False):
    sg = f"f16[{n}, {k // g}]"
    base = os.path.join(work, f"int4-m{m}-g{g}-{'sym' if symmetric else 'asym'}")
    names = ["w", "s"] + ([] if symmetric else ["z"])
    types = {"w": f"u8[{n}, {k // 2}]", "s": sg, "z": sg}  # as graph inputs
    attrs = f"group_size = {g}"
    if not symmetric:
        attrs += ", asymmetric = 1"
    body = ""
    if constants:
        bin_name = f"int4-n{n}-k{k}-g{g}-{'sym' if symmetric else 'asym'}.bin"
        if bin_name not in WRITTEN:
            WRITTEN[bin_name] = write_constants(os.path.join(work, bin_name), n, k, g, symmetric)
        for v, (at, ty) in WRITTEN[bin_name].items():
            body += f'  %{v} = constant() {{value = dense<{ty}>(file "{bin_name}", offset {at})}} : {ty}\n'
        args = f"%x: bf16[{m}, {k}]"
    else:
        args = f"%x: bf16[{m}, {k}], " + ", ".join(f"%{v}: {types[v]}" for v in names)
    ops = "%x, " + ", ".join(f"%{v}" for v in names)
    text = (f"graph @int4({args}) -> (bf16[{m}, {n}]) {{\n{body}  %y = matmul_int4({ops}) {{{attrs}}} : bf16[{m}, {n}]\n"
            f"  return %y\n}}\n")
    with open(base + ".kir", "w") as f:
        f.write(text)
    subprocess.run([kiln, "compile", base + ".kir", "--target", "sm_90a", "-o", base + ".kiln"], check=True)
    return kiln_device_ms(kiln, base + ".kiln", base + ".json")[0]


def read_floor_ms(tool, sizes, iters, work):
    """{bytes: fastest cold-L2 read, ms} from kiln-read-roofline's sweep."""
    out = os.path.join(work, "roofline.json")
    subprocess.run([tool, "--bytes", ",".join(str(b) for b in sizes), "--iters", str(iters), "--json", out],
                   check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return {e["bytes"]: min(r["ms"] for r in e["results"]) for e in json.load(f)["sizes"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kiln", required=True, help="path to the kiln binary")
    p.add_argument("--out", required=True, help="Markdown file to write")
    p.add_argument("--m", default="1,2,4,8,16,32,64")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--group", default="128", help="group size, or a comma list (one table each), e.g. 32,64,128")
    p.add_argument("--asymmetric", action="store_true")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--constants", action="store_true",
                   help="weights, scales and zeros as constants (the compiler may pack or reorder them), not inputs")
    p.add_argument("--roofline", help="path to kiln-read-roofline: add the cold-L2 read floors of both weight sets")
    p.add_argument("--cold-l2", action="store_true",
                   help="flush L2 before each timing, on both sides (the packed weights, 34 MB at 8192², "
                        "would otherwise partly stay in H200's L2, 60 MiB as the device reports it, after `kiln bench`'s input copies)")
    a = p.parse_args()
    if a.cold_l2:
        os.environ["KILN_PEER_FLUSH_L2"] = "1"
        os.environ["KILN_TIMING_FLUSH_L2"] = "1"
    ms = [int(v) for v in a.m.split(",")]
    kind = "asymmetric" if a.asymmetric else "symmetric"
    lines = []
    groups = [int(v) for v in a.group.split(",")]
    wbytes_of = {g: a.n * a.k // 2 + a.n * (a.k // g) * 2 * (2 if a.asymmetric else 1) for g in groups}
    bf16_bytes = a.n * a.k * 2
    with tempfile.TemporaryDirectory() as work:
        torch_times = {m: torch_ms(m, a.n, a.k, a.iters) for m in ms}
        floors = read_floor_ms(a.roofline, sorted(set(wbytes_of.values()) | {bf16_bytes}), a.iters, work) \
            if a.roofline else {}
        for g in groups:
            rows = []
            for m in ms:
                t = torch_times[m]
                try:
                    kms = kiln_ms(a.kiln, m, a.n, a.k, g, not a.asymmetric, work, a.constants)
                    rows.append((m, t, kms, t / kms))
                except (subprocess.CalledProcessError, RuntimeError, KeyError, TypeError) as e:
                    rows.append((m, t, None, None))
                    print(f"M={m} group={g}: kiln failed: {e}", file=sys.stderr)
                print(g, rows[-1], flush=True)
            lines += [f"# INT4 weight-only GEMM vs cuBLAS bf16, weights {a.n}x{a.k}, group {g}, {kind}"
                      f"{', L2 flushed before each timing' if a.cold_l2 else ''}"
                      f"{', constant weights' if a.constants else ''}", "",
                      "Device time, median (ms). Speedup = cuBLAS / Kiln; the issue asks M=1 >= 3.0x, M=16 >= 2.5x, "
                      "and >= 1.0x for all M <= 64.", "",
                      "| M | cuBLAS bf16 (torch.matmul) | Kiln matmul_int4 | speedup | Kiln weight GB/s |"
                      + (" Kiln / INT4 read floor | cuBLAS / INT4 read floor |" if floors else ""),
                      "|---|---|---|---|---|" + ("---|---|" if floors else "")]
            wbytes = wbytes_of[g]
            for m, t, k, s in rows:
                bw = "-" if k is None else f"{wbytes / (k * 1e-3) / 1e9:.0f}"
                extra = ""
                if floors:
                    f4 = floors[wbytes]
                    extra = f" {'-' if k is None else f'{k / f4:.2f}'} | {t / f4:.2f}x |"
                lines.append(f"| {m} | {t:.4f} | {'failed' if k is None else f'{k:.4f}'} | "
                             f"{'-' if s is None else f'{s:.2f}x'} | {bw} |" + extra)
            lines.append("")
            if floors:
                f4, f16 = floors[wbytes], floors[bf16_bytes]
                lines += [f"Read floors (kiln-read-roofline, fastest of its sweep, L2 flushed before each launch): "
                          f"the INT4 weights ({wbytes} bytes) {f4:.4f} ms ({wbytes / (f4 * 1e-3) / 1e12:.2f} TB/s), "
                          f"cuBLAS's bf16 weights ({bf16_bytes} bytes) {f16:.4f} ms "
                          f"({bf16_bytes / (f16 * 1e-3) / 1e12:.2f} TB/s). No INT4 kernel that reads its weights "
                          f"once can beat the INT4 floor, so cuBLAS / floor is the largest speedup this GPU allows.",
                          ""]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
