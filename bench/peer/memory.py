#!/usr/bin/env python3
"""Peak activation memory of a GPT-2 forward pass: PyTorch against Kiln's static memory plan.

PyTorch: torch.cuda.max_memory_allocated() during GPT2Model's forward (fp32, no_grad, random
weights, default GPT2Config) minus what was allocated before it (weights and input ids), with
eager attention (the pattern Kiln imports) and with SDPA (transformers' default).
Kiln: the same GPT2Model exported to ONNX through bench/models/export.py's TorchScript path
(eager attention, dims batch/seq), then `kiln compile` with the standard passes, with and
without schedule-memory, the same without fuse-attention, and with only the clean-up passes. Each row
gives the estimate `kiln compile` prints (import order and as compiled) and the plan's arena.
Writes a Markdown table to OUT/<date>-memory.md and prints it.

    /opt/torch/.venv/bin/python3 bench/peer/memory.py --kiln build/bin/kiln [--batch 16] [--seq 512]
"""
import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
# `kiln compile`'s standard order (core/src/driver.cpp default_compile_passes).
STANDARD = ["canonicalize", "cse", "fold-layout", "fuse-attention", "fuse-horizontal", "fuse-rows",
            "fuse-pointwise", "dce"]
CLEANUP = ["canonicalize", "cse", "dce"]


def gpt2(torch, attn):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.GPT2Config()
    cfg._attn_implementation = attn
    return tf.GPT2Model(cfg).eval()


def torch_peak(torch, attn, batch, seq):
    model = gpt2(torch, attn).cuda()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, return_dict=False)[0]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out, model, ids
    torch.cuda.empty_cache()
    return peak


def export_onnx(torch, path):
    sys.path.insert(0, os.path.join(REPO, "bench", "models"))
    import export  # bench/models/export.py: its LogitsOnly wrapper and TorchScript export path
    model = export.LogitsOnly(gpt2(torch, "eager"))
    ids = torch.randint(0, model.model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(2))
    export.export(model, {"input_ids": ids}, {"input_ids": {0: "batch", 1: "seq"}}, path, "legacy")


def registered_passes(kiln):
    out = subprocess.run([kiln, "plugins"], check=True, capture_output=True, text=True).stdout
    return {m.group(1) for m in re.finditer(r"^(\S+)\s+pass\s", out, re.M)}


def kiln_memory(kiln, model, passes, batch, seq, target, work):
    """(import-order estimate, compiled estimate, plan arena) in bytes, or an error string."""
    cmd = [kiln, "compile", model, "--target", target, "--sym", f"batch={batch}", "--sym", f"seq={seq}",
           "--passes", ",".join(passes), "-o", os.path.join(work, "gpt2.kiln")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[0]
    size = r"([\d.]+) (B|KiB|MiB|GiB)"
    est = re.search(r"peak activation memory: " + size + " in import order, " + size + " as compiled", r.stdout)
    arena = re.search(r"arena bytes=(\d+)", r.stdout)
    if not est or not arena:
        return "no memory lines in: " + r.stdout
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    g = est.groups()
    return float(g[0]) * scale[g[1]], float(g[2]) * scale[g[3]], int(arena.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kiln", default=os.path.join(REPO, "build", "bin", "kiln"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    a = ap.parse_args()
    import torch

    rows = []
    for attn in ("eager", "sdpa"):
        rows.append((f"PyTorch {torch.__version__} GPT2Model, {attn} attention", "", "", torch_peak(torch, attn, a.batch, a.seq)))
    known = registered_passes(a.kiln)
    with tempfile.TemporaryDirectory() as work:
        model = os.path.join(work, "gpt2.onnx")
        export_onnx(torch, model)
        no_attention = [p for p in STANDARD if p != "fuse-attention"]
        for label, base in (("standard passes", STANDARD), ("standard passes but fuse-attention", no_attention),
                            ("clean-up passes only", CLEANUP)):
            base = [p for p in base if p in known]
            for sched in (False, True):
                passes = base + (["schedule-memory"] if sched else [])
                r = kiln_memory(a.kiln, model, passes, a.batch, a.seq, a.target, work)
                name = f"Kiln, {label}" + (" + schedule-memory" if sched else "")
                rows.append((name, *r) if isinstance(r, tuple) else (name, "", "", r))

    fmt = lambda b: f"{b / MIB:.1f}" if isinstance(b, (int, float)) else b
    lines = [f"# GPT-2 (124M) fp32 forward, batch {a.batch}, seq {a.seq}: peak activation memory (MiB)", "",
             "| run | estimate, import order | estimate, compiled | measured peak / plan arena |",
             "|---|---|---|---|"]
    lines += [f"| {n} | {fmt(i)} | {fmt(c)} | {fmt(p)} |" for n, i, c, p in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{datetime.date.today()}-memory.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
