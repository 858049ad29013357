"""FP8 on the GPU: Kiln's FP8 GEMM against torch._scaled_mm, and Kiln's FP8 Llama block against its bf16 one.

Run on the GPU machine (torch with CUDA, a kiln build with the cuda-sm90, kir and onnx plugins):

    /opt/torch/.venv/bin/python3 bench/peer/quant.py --kiln build/bin/kiln \
        --out bench/results/$(date +%F)-fp8.md

1. GEMM, M = N = K = 8192 (--sizes): torch._scaled_mm (e4m3 x e4m3, per-tensor scales, bf16
   out) and torch.matmul in bf16, timed with CUDA events; Kiln's scaled_matmul graph (.kir) and
   a bf16 linear, compiled with `kiln compile --target sm_90a` and timed by `kiln bench
   --report-json` (device time of the plan, CUDA graphs on). TFLOP/s = 2 M N K / time.
2. Llama-style block (d 4096, ff 11008, 32 heads, seq 2048, bf16, batch 1; bench/peer/run.py's
   LlamaBlock, exported to ONNX): compiled once with the bf16 pipeline and once with
   quantize-fp8, both timed by `kiln bench`. The FP8 scales come from torch forward hooks (max
   |x| of each nn.Linear input, matched to Kiln's activation names by weight shape); they set
   accuracy, not speed (accuracy: `kiln quant-report` on the small models).
Writes a Markdown table to --out and the raw numbers next to it (.json).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

from peer_common import kiln_device_ms, median_ms

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg):
    print(f"[quant {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd, timeout=1200):
    log(" ".join(cmd))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} {cmd[1]} failed ({p.returncode}): {p.stdout[-2000:]}")
    return p.stdout


def gemm_rows(a, torch, work):
    rows = []
    for n in a.sizes:
        flops = 2.0 * n * n * n
        x = torch.randn(n, n, device="cuda")
        w = torch.randn(n, n, device="cuda")
        sx = (x.abs().max() / 448).float()
        sw = (w.abs().max() / 448).float()
        xq = (x / sx).to(torch.float8_e4m3fn)
        wq = (w / sw).to(torch.float8_e4m3fn)  # [N, K] row-major: its .t() is the column-major B
        t_fp8 = median_ms(torch, lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16),
                        a.iterations, a.warmup)
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        t_bf16 = median_ms(torch, lambda: torch.matmul(xb, wb.t()), a.iterations, a.warmup)
        del x, w, xq, wq, xb, wb
        torch.cuda.empty_cache()

        kir = os.path.join(work, f"fp8-gemm-{n}.kir")
        with open(kir, "w") as f:
            f.write(f"// One FP8 GEMM (E4M3, per-tensor scales, bf16 out), for bench/peer/quant.py.\n"
                    f"graph @fp8_gemm(%x: f8e4m3fn[{n}, {n}], %w: f8e4m3fn[{n}, {n}]) -> (bf16[{n}, {n}]) {{\n"
                    f"  %sx = constant() {{value = dense<f32[]>[0.01]}} : f32[]\n"
                    f"  %sw = constant() {{value = dense<f32[]>[0.01]}} : f32[]\n"
                    f"  %y = scaled_matmul(%x, %w, %sx, %sw) {{dtype = bf16}} : bf16[{n}, {n}]\n"
                    f"  return %y\n}}\n")
        bkir = os.path.join(work, f"bf16-gemm-{n}.kir")
        with open(bkir, "w") as f:
            f.write(f"// One bf16 linear, for bench/peer/quant.py.\n"
                    f"graph @bf16_gemm(%x: bf16[{n}, {n}], %w: bf16[{n}, {n}]) -> (bf16[{n}, {n}]) {{\n"
                    f"  %y = linear(%x, %w) : bf16[{n}, {n}]\n  return %y\n}}\n")
        k = {}
        for name, src in (("fp8", kir), ("bf16", bkir)):
            art = src[:-4] + ".kiln"
            run([a.kiln, "compile", src, "--target", a.target, "-o", art])
            report = os.path.join(work, os.path.basename(art) + ".bench.json")
            k[name] = kiln_device_ms(a.kiln, art, report, a.iterations, a.warmup)[0]
        tf = lambda ms: flops / (ms * 1e-3) / 1e12
        rows.append({"size": n, "torch_scaled_mm_ms": t_fp8, "kiln_fp8_ms": k["fp8"], "torch_bf16_ms": t_bf16,
                     "kiln_bf16_ms": k["bf16"], "torch_scaled_mm_tflops": tf(t_fp8), "kiln_fp8_tflops": tf(k["fp8"]),
                     "torch_bf16_tflops": tf(t_bf16), "kiln_bf16_tflops": tf(k["bf16"]),
                     "ratio_vs_scaled_mm": t_fp8 / k["fp8"]})
        log(f"gemm {n}: kiln fp8 {tf(k['fp8']):.0f} TFLOP/s, torch._scaled_mm {tf(t_fp8):.0f} TFLOP/s")
    return rows


def llama_row(a, torch, work):
    from torch import nn
    sys.path.insert(0, os.path.join(REPO, "bench", "peer"))
    sys.path.insert(0, os.path.join(REPO, "bench", "models"))
    from run import LlamaBlock
    import export as kexport

    model = LlamaBlock(torch, nn, seq=a.seq, sdpa=False).to(torch.bfloat16).cuda().eval()
    x = torch.randn(1, a.seq, 4096, device="cuda").to(torch.bfloat16)
    amax = {}  # (n, k) of the weight -> largest max|x| over the inputs of such layers

    def hook(mod, inp, out):
        key = (mod.weight.shape[0], mod.weight.shape[1])
        amax[key] = max(amax.get(key, 0.0), inp[0].abs().max().float().item())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    onnx = os.path.join(work, "llama-block.onnx")
    if not os.path.exists(onnx):
        kexport.export(model, {"x": x}, None, onnx, "legacy")
    del model
    torch.cuda.empty_cache()

    # Kiln's names for the activations: linear/matmul nodes with a constant [K, N] or [N, K] weight.
    kir = os.path.join(work, "llama-block.kir")
    run([a.kiln, "opt", onnx, "--passes", a.pre, "-o", kir])
    # .kir quotes names that are not plain identifiers (%"/ln1/Cast_output_0"), JSON-style.
    name = r'%("(?:[^"\\]|\\.)*"|[^\s,()"]+)'
    unquote = lambda s: json.loads(s) if s.startswith('"') else s
    consts, scales = {}, {}
    with open(kir) as f:
        for line in f:
            m = re.match(r"\s*" + name + r" = constant\(\).*: \S+\[(\d+), (\d+)\]\s*$", line)
            if m:
                consts[unquote(m.group(1))] = (int(m.group(2)), int(m.group(3)))
            m = re.match(r"\s*" + name + r" = (linear|matmul)\(" + name + ", " + name, line)
            if m and unquote(m.group(4)) in consts:
                r, c = consts[unquote(m.group(4))]
                key = (r, c) if m.group(2) == "linear" else (c, r)
                scales[unquote(m.group(3))] = amax.get(key, max(amax.values()))
    path = os.path.join(work, "llama-scales.json")
    with open(path, "w") as f:
        json.dump({"kiln_fp8_scales": 1, "amax": scales}, f, indent=1)
    log(f"llama: {len(scales)} activation scales from torch hooks")
    ms = {}
    for name, passes in (("bf16", f"{a.pre},{a.post}"), ("fp8", f"{a.pre},quantize-fp8{{scales={path}}},{a.post}")):
        art = os.path.join(work, f"llama-block-{name}.kiln")
        run([a.kiln, "compile", onnx, "--passes", passes, "--target", a.target, "-o", art], timeout=3600)
        report = os.path.join(work, os.path.basename(art) + ".bench.json")
        ms[name] = kiln_device_ms(a.kiln, art, report, a.iterations, a.warmup)[0]
        log(f"llama {name}: {ms[name]:.3f} ms")
    return {"seq": a.seq, "passes": f"{a.pre},[quantize-fp8],{a.post}", "kiln_bf16_ms": ms["bf16"],
            "kiln_fp8_ms": ms["fp8"], "speedup": ms["bf16"] / ms["fp8"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kiln", default=os.path.join(REPO, "build", "bin", "kiln"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", time.strftime("%Y-%m-%d") + "-fp8.md"))
    ap.add_argument("--work", default="/tmp/kiln-quant")
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[8192])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--no-llama", action="store_true", help="GEMMs only")
    ap.add_argument("--no-gemm", action="store_true", help="the Llama block only")
    ap.add_argument("--pre", default="canonicalize,cse", help="Llama block: passes before quantize-fp8")
    ap.add_argument("--post",
                    default="fold-layout,fuse-attention,fuse-horizontal,fuse-rows,fuse-pointwise,dce,schedule-memory",
                    help="Llama block: passes after quantize-fp8 (the same for bf16; the standard order)")
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args()
    import torch
    os.makedirs(a.work, exist_ok=True)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "gemm": [] if a.no_gemm else gemm_rows(a, torch, a.work)}
    if not a.no_llama:
        try:
            result["llama"] = llama_row(a, torch, a.work)
        except Exception as e:  # the GEMM table stands on its own
            result["llama_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            log(f"llama block failed: {result['llama_error']}")

    lines = [f"# FP8: Kiln vs torch._scaled_mm, FP8 vs bf16 Llama block ({result['device']}, torch {result['torch']})",
             "", "Median of CUDA-event times (torch: each call queued behind a device sleep, so its host dispatch is not counted); Kiln: `kiln bench` device time of the plan, CUDA graphs on.", "",
             "| GEMM M=N=K | torch._scaled_mm | Kiln FP8 | Kiln / torch | torch bf16 | Kiln bf16 |",
             "|---|---|---|---|---|---|"]
    for r in result["gemm"]:
        lines.append(f"| {r['size']} | {r['torch_scaled_mm_ms']:.3f} ms ({r['torch_scaled_mm_tflops']:.0f} TFLOP/s) | "
                     f"{r['kiln_fp8_ms']:.3f} ms ({r['kiln_fp8_tflops']:.0f} TFLOP/s) | {r['ratio_vs_scaled_mm']:.3f}x | "
                     f"{r['torch_bf16_ms']:.3f} ms ({r['torch_bf16_tflops']:.0f}) | "
                     f"{r['kiln_bf16_ms']:.3f} ms ({r['kiln_bf16_tflops']:.0f}) |")
    if "llama" in result:
        r = result["llama"]
        lines += ["", f"Llama block passes: `{r['passes']}`.", "",
                  "| Llama block (d 4096, ff 11008, batch 1) | Kiln bf16 | Kiln FP8 | FP8 speed-up |",
                  "|---|---|---|---|",
                  f"| seq {r['seq']} | {r['kiln_bf16_ms']:.3f} ms | {r['kiln_fp8_ms']:.3f} ms | {r['speedup']:.2f}x |"]
    elif "llama_error" in result:
        lines += ["", f"Llama block: not measured ({result['llama_error'].splitlines()[0][:300]})"]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
