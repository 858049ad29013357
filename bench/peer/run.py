#!/usr/bin/env python3
"""Times Kiln against PyTorch eager and torch.compile on the same models and shapes, in one run.

For each workload a worker process builds the PyTorch model (random weights, seeded), exports
it to ONNX (the GEMMs are one-node .kir graphs instead), compiles both torch.compile modes,
then times eager, torch.compile (default) and torch.compile(mode="reduce-overhead") with CUDA
events. Meanwhile `kiln compile --target sm_90a` builds the artifact; once the worker has
exited, `kiln bench --graphs both --report-json` times it. Results go to
OUT/<date>-peer.md and OUT/<date>-peer.json, rewritten after every workload, so a run cut
short still leaves a table. A workload Kiln cannot import, compile or run gets a row with the
first line of the error; nothing stops the other workloads.

Times: "device" is GPU time of the model alone (PyTorch: CUDA events around the call, inputs
already on the GPU, each timing queued behind a short device sleep so that the host's dispatch
before the first kernel is not counted: peer_common.device_times_ms; Kiln: events around the
plan's steps). "e2e" is host to host: host
inputs in, host outputs back (PyTorch: .to("cuda") + call + .cpu(); Kiln: kiln_model_run),
wall clock. Medians throughout.

    python3 bench/peer/run.py --kiln build/bin/kiln [--only NAME,...] [--quick] [--out DIR]
    python3 bench/peer/run.py --dry-run          # print the plan; needs no torch, no GPU

Needs on the GPU machine: torch, torchvision, transformers, onnx (and onnxscript for the
exporter); a kiln build with the cuda-sm90 and onnx plugins.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback

from peer_common import device_times_ms

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name → (kind, params, shape text). Ordered by what matters most for the done criteria, so a
# run that hits the time budget drops the least important rows.
WORKLOADS = [
    ("gemm-bf16-4096", "gemm", {"m": 4096, "n": 4096, "k": 4096}, "bf16 4096x4096 @ 4096x4096"),
    ("gemm-bf16-8192", "gemm", {"m": 8192, "n": 8192, "k": 8192}, "bf16 8192x8192 @ 8192x8192"),
    ("mlp-b1", "mlp", {"batch": 1, "width": 512, "layers": 8}, "fp32 batch 1, 8 x Linear(512)+ReLU"),
    ("gpt2-b1-s128", "gpt2", {"batch": 1, "seq": 128}, "fp32 batch 1 seq 128"),
    ("llama-block-b1", "llama", {"batch": 1, "seq": 2048}, "bf16 batch 1 seq 2048, d 4096 ff 11008 32 heads"),
    ("resnet18-b32", "resnet18", {"batch": 32}, "fp32 batch 32 3x224x224"),
    ("gpt2-b16-s512", "gpt2", {"batch": 16, "seq": 512}, "fp32 batch 16 seq 512"),
    ("llama-block-b8", "llama", {"batch": 8, "seq": 2048}, "bf16 batch 8 seq 2048, d 4096 ff 11008 32 heads"),
    # Vision models from torchvision (random weights, randomized batch-norm statistics). TF32 is
    # allowed on both sides for these: PyTorch's cuDNN convolutions use it by default, and its
    # matmuls (ConvNeXt's Linear layers) are switched to it in the worker.
    ("resnet50-b16", "vision", {"model": "resnet50", "batch": 16}, "fp32 batch 16 3x224x224"),
    ("convnext-tiny-b8", "vision", {"model": "convnext_tiny", "batch": 8}, "fp32 batch 8 3x224x224"),
    ("mobilenetv3-small-b16", "vision", {"model": "mobilenet_v3_small", "batch": 16}, "fp32 batch 16 3x224x224"),
    ("efficientnet-b0-b16", "vision", {"model": "efficientnet_b0", "batch": 16}, "fp32 batch 16 3x224x224"),
    ("resnet50-bf16-b16", "vision", {"model": "resnet50", "batch": 16, "dtype": "bf16"}, "bf16 batch 16 3x224x224"),
]
MODES = ["eager", "compile", "compile-ro"]


def log(msg):
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def first_error_line(text):
    """The first 'kiln: error:' line of a tool's output, else its last non-empty line."""
    lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
    for l in lines:
        if "error" in l.lower():
            return l[:300]
    return lines[-1][:300] if lines else "(no output)"


# ---- worker: PyTorch side (imports torch) ------------------------------------------------------

def build_model(kind, p, torch, nn):
    """Returns (timing module, export module or None, {input name: CPU tensor})."""
    torch.manual_seed(0)
    if kind == "gemm":
        a = torch.randn(p["m"], p["k"]).to(torch.bfloat16)
        b = torch.randn(p["k"], p["n"]).to(torch.bfloat16)

        class MatMul(nn.Module):
            def forward(self, a, b):
                return torch.matmul(a, b)
        return MatMul(), None, {"a": a, "b": b}
    if kind == "mlp":
        layers = []
        for _ in range(p["layers"]):
            layers += [nn.Linear(p["width"], p["width"]), nn.ReLU()]
        m = nn.Sequential(*layers).eval()
        return m, m, {"x": torch.randn(p["batch"], p["width"])}
    sys.path.insert(0, os.path.join(REPO, "bench", "models"))
    import export as kexport  # bench/models/export.py: builders and the legacy exporter
    if kind == "resnet18":
        m, _, _ = kexport.build("resnet18", "full")
        return m, m, {"input": torch.randn(p["batch"], 3, 224, 224)}
    if kind == "vision":
        import torchvision
        torch.backends.cuda.matmul.allow_tf32 = True
        m = kexport.randomize_batchnorm(getattr(torchvision.models, p["model"])(weights=None)).eval()
        x = torch.randn(p["batch"], 3, 224, 224)
        if p.get("dtype") == "bf16":
            m, x = m.to(torch.bfloat16), x.to(torch.bfloat16)
        return m, m, {"input": x}
    if kind == "gpt2":
        import transformers as tf
        cfg = tf.GPT2Config()
        cfg._attn_implementation = "eager"  # exports as MatMul/Softmax/MatMul
        m = kexport.LogitsOnly(tf.GPT2Model(cfg).eval())  # last hidden state: see the notes
        ids = torch.randint(0, cfg.vocab_size, (p["batch"], p["seq"]), generator=torch.Generator().manual_seed(2))
        return m, m, {"input_ids": ids}
    if kind == "llama":
        timing = LlamaBlock(torch, nn, seq=p["seq"], sdpa=True)
        exp = LlamaBlock(torch, nn, seq=p["seq"], sdpa=False)
        exp.load_state_dict(timing.state_dict())
        timing, exp = timing.to(torch.bfloat16).eval(), exp.to(torch.bfloat16).eval()
        x = torch.randn(p["batch"], p["seq"], 4096).to(torch.bfloat16)
        return timing, exp, {"x": x}
    raise ValueError(kind)


def LlamaBlock(torch, nn, d=4096, ff=11008, heads=32, seq=2048, sdpa=True):
    """One Llama decoder layer (RMSNorm, RoPE, causal attention, SwiGLU), as a module.

    sdpa=True uses F.scaled_dot_product_attention (what PyTorch users run); sdpa=False spells
    attention out as matmul/softmax/matmul with an additive causal mask (what exports cleanly
    to ONNX opset 17). Both compute the same function."""
    F = nn.functional
    hd = d // heads

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
            return self.weight * xf.to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = RMSNorm(), RMSNorm()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
            self.down = nn.Linear(ff, d, bias=False)
            inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(seq).float(), inv)
            ang = torch.cat([ang, ang], -1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
            self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

        def rope(self, t):
            half = t.shape[-1] // 2
            rot = torch.cat([-t[..., half:], t[..., :half]], -1)
            return t * self.cos.to(t.dtype) + rot * self.sin.to(t.dtype)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.ln1(x)
            q = self.rope(self.q(h).view(b, s, heads, hd).transpose(1, 2))
            k = self.rope(self.k(h).view(b, s, heads, hd).transpose(1, 2))
            v = self.v(h).view(b, s, heads, hd).transpose(1, 2)
            if sdpa:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                sc = torch.matmul(q, k.transpose(-1, -2)).float() * (hd ** -0.5) + self.mask
                a = torch.matmul(torch.softmax(sc, -1).to(x.dtype), v)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
            h = self.ln2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    return Block()


def worker(a):
    """Builds, exports, compiles and times one workload; writes WORK/torch.json."""
    import torch
    from torch import nn
    name, kind, p, _ = next(w for w in WORKLOADS if w[0] == a.worker)
    work = a.workdir
    result = {"workload": name, "torch": torch.__version__, "modes": {}, "errors": {}}

    def save():
        with open(os.path.join(work, "torch.json"), "w") as f:
            json.dump(result, f, indent=1)

    def signal(file, payload):
        with open(os.path.join(work, file + ".tmp"), "w") as f:
            json.dump(payload, f)
        os.replace(os.path.join(work, file + ".tmp"), os.path.join(work, file))

    try:
        t0 = time.time()
        model, exp_model, inputs = build_model(kind, p, torch, nn)
        log(f"{name}: built in {time.time() - t0:.1f} s")
    except Exception as e:
        result["errors"]["build"] = f"{type(e).__name__}: {e}"
        result["trace"] = traceback.format_exc()[-3000:]
        signal("export.done", {"ok": False, "error": result["errors"]["build"]})
        save()
        return 1

    dev = torch.device("cuda")
    # Export first, so that kiln compile (in the parent) overlaps with torch.compile here.
    if exp_model is None:
        signal("export.done", {"ok": True, "skipped": True})
    else:
        try:
            t0 = time.time()
            sys.path.insert(0, os.path.join(REPO, "bench", "models"))
            import export as kexport
            exp_model = exp_model.to(dev)
            dev_inputs = {k: v.to(dev) for k, v in inputs.items()}
            exporter, legacy_error = kexport.export_with_fallback(exp_model, dev_inputs, os.path.join(work, "model.onnx"))
            if legacy_error:  # the TorchScript exporter failed: the dynamo one wrote the file
                log(f"{name}: legacy ONNX export failed ({legacy_error[:200]}); exported with {exporter}")
                result["export_fallback"] = legacy_error
            result["export_s"] = round(time.time() - t0, 1)
            log(f"{name}: exported ONNX in {result['export_s']} s")
            signal("export.done", {"ok": True})
        except Exception as e:
            result["errors"]["export"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"{name}: ONNX export failed: {result['errors']['export']}")
            signal("export.done", {"ok": False, "error": result["errors"]["export"]})
        if exp_model is not model:
            del exp_model
        torch.cuda.empty_cache()

    model = model.to(dev).eval()
    gpu_in = [v.to(dev) for v in inputs.values()]
    cpu_in = list(inputs.values())
    wanted = [m for m in a.torch_modes.split(",") if m in MODES]
    fns = {"eager": model} if "eager" in wanted else {}
    with torch.no_grad():
        for mode, kw in (("compile", {}), ("compile-ro", {"mode": "reduce-overhead"})):
            if mode not in wanted:
                continue
            try:
                t0 = time.time()
                fn = torch.compile(model, dynamic=False, **kw)
                for _ in range(3):  # compiles, then (reduce-overhead) records the CUDA graph
                    if mode == "compile-ro":
                        torch.compiler.cudagraph_mark_step_begin()
                    fn(*gpu_in)
                torch.cuda.synchronize()
                fns[mode] = fn
                result.setdefault("compile_s", {})[mode] = round(time.time() - t0, 1)
                log(f"{name}: torch.compile {mode} ready in {result['compile_s'][mode]} s")
            except Exception as e:
                result["errors"][mode] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"{name}: torch.compile {mode} failed: {result['errors'][mode]}")

        # Timings wait for kiln compile to finish, so that it does not steal CPU from them.
        deadline = time.time() + a.go_timeout
        while not os.path.exists(os.path.join(work, "go")) and time.time() < deadline:
            time.sleep(0.2)

        def call(mode, fn, args):
            if mode == "compile-ro":
                torch.compiler.cudagraph_mark_step_begin()
            return fn(*args)

        def to_host(out):
            return [t.cpu() for t in out] if isinstance(out, (tuple, list)) else out.cpu()

        for mode, fn in fns.items():
            try:
                dev_ms = device_times_ms(torch, lambda: call(mode, fn, gpu_in), a.iterations, a.warmup)
                e2e_ms = []
                for _ in range(a.e2e_iterations):
                    t0 = time.perf_counter()
                    to_host(call(mode, fn, [t.to(dev) for t in cpu_in]))
                    e2e_ms.append((time.perf_counter() - t0) * 1000)
                dev_ms.sort()
                e2e_ms.sort()
                result["modes"][mode] = {"device_ms": dev_ms[len(dev_ms) // 2], "device_min_ms": dev_ms[0],
                                         "e2e_ms": e2e_ms[len(e2e_ms) // 2], "iterations": a.iterations}
                log(f"{name}: {mode}: device {dev_ms[len(dev_ms) // 2]:.4f} ms, e2e {e2e_ms[len(e2e_ms) // 2]:.4f} ms")
            except Exception as e:
                result["errors"][mode] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"{name}: timing {mode} failed: {result['errors'][mode]}")
            save()
    save()
    return 0


# ---- parent: orchestration (no torch) ----------------------------------------------------------

def gemm_kir(p):
    m, n, k = p["m"], p["n"], p["k"]
    return (f"// One bf16 matmul, for bench/peer/run.py.\n"
            f"graph @gemm(%a: bf16[{m}, {k}], %b: bf16[{k}, {n}]) -> (bf16[{m}, {n}]) {{\n"
            f"  %c = matmul(%a, %b) : bf16[{m}, {n}]\n"
            f"  return %c\n}}\n")


def run_tool(cmd, log_path, timeout):
    """Runs a command with a timeout; returns (rc or None on timeout, combined output)."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                           timeout=timeout)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
        out += f"\nerror: timed out after {timeout} s"
        rc = None
    except OSError as e:
        out, rc = f"error: cannot run {cmd[0]}: {e}", -1
    with open(log_path, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n# rc={rc} in {time.time() - t0:.1f} s\n{out}")
    return rc, out


def header_info(argv):
    def sh(cmd):
        try:
            return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  cwd=REPO, timeout=20).stdout.strip()
        except Exception:
            return ""
    # KILN_COMMIT names the build when the tree was copied without its history (GPU machines).
    commit = os.environ.get("KILN_COMMIT", "")
    if not commit:
        head = sh(["git", "rev-parse", "--verify", "-q", "HEAD"])
        commit = head or "unknown (no git history; set KILN_COMMIT)"
        if head and sh(["git", "status", "--porcelain", "--untracked-files=no"]):
            commit += " (with uncommitted changes)"
    gpu = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"), "commit": commit,
            "device": gpu or "unknown (nvidia-smi failed)", "host": platform.node(),
            "python": sys.version.split()[0], "command": shlex.join([sys.executable] + argv)}


def fmt(v, digits=3):
    return "—" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return f"{a / b:.2f}×" if a is not None and b else "—"


def write_report(out_dir, stem, header, rows):
    data = {"header": header, "rows": rows}
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(data, f, indent=1)
    h = header
    lines = [f"# Kiln vs PyTorch ({h['date']})", "",
             f"- commit: `{h['commit']}`", f"- device: {h['device']}", f"- torch: {h.get('torch', '?')}",
             f"- command: `{h['command']}`", "",
             "Medians in ms. **device**: GPU time of the model alone (PyTorch: CUDA events around the call "
             "with inputs on the GPU, queued behind a device sleep so the host's dispatch of the first kernel "
             "is not counted; Kiln: CUDA events around the plan's steps, `kiln bench` device ms). "
             "Ratios below 1 mean Kiln is faster. GPT-2 is `GPT2Model` (last hidden state, no LM head, "
             "whose 1.6 GB of logits at batch 16 would turn every e2e time into a copy benchmark). "
             "PyTorch's Llama block uses SDPA; the exported one spells attention out (same function).", "",
             "| workload | shape | Kiln graphs on | Kiln graphs off | eager | compile | compile-ro "
             "| Kiln/eager | Kiln/compile | Kiln/compile-ro | status |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        k, t = r.get("kiln", {}), r.get("torch", {})
        kon, koff = k.get("on_device_ms"), k.get("off_device_ms")
        e, c, ro = (t.get(m, {}).get("device_ms") for m in MODES)
        lines.append(f"| {r['workload']} | {r['shape']} | {fmt(kon)} | {fmt(koff)} | {fmt(e)} | {fmt(c)} | {fmt(ro)} "
                     f"| {ratio(kon, e)} | {ratio(kon, c)} | {ratio(kon, ro)} | {r['status']} |")
    lines += ["", "**e2e** (host to host, wall clock): Kiln `kiln_model_run` (input upload, plan, output "
              "download, through pinned staging); PyTorch `.to(\"cuda\")`, call, `.cpu()`. "
              "Kiln's host enqueue time is the median time `kiln_model_enqueue` takes to return.", "",
              "| workload | Kiln graphs on | Kiln graphs off | Kiln enqueue (on) | eager | compile | compile-ro "
              "| Kiln/compile | Kiln/compile-ro |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        k, t = r.get("kiln", {}), r.get("torch", {})
        kon = k.get("on_e2e_ms")
        e, c, ro = (t.get(m, {}).get("e2e_ms") for m in MODES)
        lines.append(f"| {r['workload']} | {fmt(kon)} | {fmt(k.get('off_e2e_ms'))} | {fmt(k.get('on_enqueue_ms'), 4)} "
                     f"| {fmt(e)} | {fmt(c)} | {fmt(ro)} | {ratio(kon, c)} | {ratio(kon, ro)} |")
    notes = [f"- {r['workload']}: {n}" for r in rows for n in r.get("notes", [])]
    if notes:
        lines += ["", "Notes and errors:", ""] + notes
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def kiln_summary(report):
    """Picks the table's numbers out of a `kiln bench --report-json` file."""
    out, notes = {}, []
    for mode in ("on", "off"):
        g = report.get("graphs", {}).get(mode)
        if not g:
            continue
        if "error" in g:
            notes.append(f"kiln graphs {mode}: {g['error'].splitlines()[0][:300]}")
            continue
        if g.get("note"):
            notes.append(f"kiln graphs {mode}: {g['note'][:300]}")
        out[f"{mode}_e2e_ms"] = g["latency_ms"]["median"]
        out[f"{mode}_enqueue_ms"] = g["enqueue_ms"]["median"]
        dev = g.get("device_ms")
        # Without device timing the e2e latency is the best figure there is (and says so).
        out[f"{mode}_device_ms"] = dev["median"] if dev else None
        if not dev:
            notes.append(f"kiln graphs {mode}: no device time; see the e2e table")
    return out, notes


def kiln_pipeline(a, kind):
    """The pipeline Kiln compiles a workload with: --pipeline, except that convolutional models
    take --conv-pipeline, because PyTorch runs cuDNN convolutions in TF32 by default
    (torch.backends.cudnn.allow_tf32) while its matmuls stay in full fp32 (the vision workloads
    allow TF32 for matmuls too)."""
    if kind in ("resnet18", "vision") and a.conv_pipeline:
        return a.conv_pipeline
    return a.pipeline


def run_workload(w, a, kiln, work_root, budget_end):
    name, kind, p, shape = w
    row = {"workload": name, "shape": shape, "status": "ok", "notes": [], "kiln": {}, "torch": {}}
    work = os.path.join(work_root, name)
    model = os.path.join(work, "model.kir" if kind == "gemm" else "model.onnx")
    artifact = os.path.join(work, "model.kiln")
    compile_cmd = [kiln, "compile", model, "--target", a.target, "-o", artifact]
    pipeline = kiln_pipeline(a, kind)
    if pipeline:
        compile_cmd += ["--pipeline", pipeline]
    bench_cmd = [kiln, "bench", artifact, "--graphs", "both", "--iterations", str(a.kiln_iterations),
                 "--warmup", str(a.warmup), "--report-json", os.path.join(work, "kiln-bench.json")]
    if a.kiln_profile:
        bench_cmd += ["--profile", str(a.kiln_profile)]
    worker_cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--workdir", work,
                  "--iterations", str(a.iterations), "--warmup", str(a.warmup),
                  "--e2e-iterations", str(a.e2e_iterations), "--go-timeout", str(a.compile_timeout),
                  "--torch-modes", a.torch_modes]
    if a.dry_run:
        if kind == "gemm":
            print("  write " + model + ":\n    " + gemm_kir(p).rstrip().replace("\n", "\n    "))
        for c in (worker_cmd, compile_cmd, bench_cmd):
            print("  " + shlex.join(c))
        return None
    os.makedirs(work, exist_ok=True)
    for f in ("go", "export.done", "torch.json", "kiln-bench.json"):
        if os.path.exists(os.path.join(work, f)):
            os.remove(os.path.join(work, f))
    if kind == "gemm":
        with open(model, "w") as f:
            f.write(gemm_kir(p))

    t0 = time.time()
    # A hung step must not eat the whole device call: every wait has a deadline.
    worker_deadline = min(t0 + a.worker_timeout, max(budget_end, t0) + 90)
    wlog = open(os.path.join(work, "worker.log"), "w")
    worker = subprocess.Popen(worker_cmd, stdout=wlog, stderr=subprocess.STDOUT, text=True)
    # Wait for the export (or the worker's end), then compile with Kiln while torch compiles.
    while kind != "gemm" and worker.poll() is None and not os.path.exists(os.path.join(work, "export.done")):
        if time.time() > worker_deadline:
            break
        time.sleep(0.2)
    exported = {"ok": True} if kind == "gemm" else None  # the .kir needs no worker
    try:
        if kind != "gemm":
            with open(os.path.join(work, "export.done")) as f:
                exported = json.load(f)
    except (OSError, ValueError):
        pass
    compiled = False
    if exported and exported.get("ok"):
        log(f"{name}: kiln compile")
        rc, out = run_tool(compile_cmd, os.path.join(work, "kiln-compile.log"), a.compile_timeout)
        compiled = rc == 0
        if not compiled:
            row["status"] = "kiln compile failed: " + first_error_line(out)
        log(f"{name}: kiln compile {'ok' if compiled else 'failed: ' + first_error_line(out)}")
    else:
        err = exported.get("error") if exported else "the worker ended or timed out before exporting"
        row["status"] = "no ONNX export: " + (err or "?")[:300]
    open(os.path.join(work, "go"), "w").close()

    try:
        worker.wait(timeout=max(10, worker_deadline - time.time()))
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()
        row["notes"].append(f"torch worker killed after {time.time() - t0:.0f} s")
    wlog.close()
    try:
        with open(os.path.join(work, "torch.json")) as f:
            tj = json.load(f)
        row["torch"] = tj.get("modes", {})
        row["torch_version"] = tj.get("torch")
        row["compile_s"] = tj.get("compile_s", {})
        for k, v in tj.get("errors", {}).items():
            row["notes"].append(f"torch {k}: {v[:300]}")
    except (OSError, ValueError):
        with open(os.path.join(work, "worker.log")) as f:
            row["notes"].append("torch worker: " + first_error_line(f.read()))
    if worker.returncode not in (0, None):
        row["notes"].append(f"torch worker exit status {worker.returncode} (log: {work}/worker.log)")

    if compiled:
        log(f"{name}: kiln bench")
        rc, out = run_tool(bench_cmd, os.path.join(work, "kiln-bench.log"), a.bench_timeout)
        try:
            with open(os.path.join(work, "kiln-bench.json")) as f:
                row["kiln"], notes = kiln_summary(json.load(f))
            row["notes"] += notes
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if rc != 0:
            row["status"] = "kiln bench failed: " + first_error_line(out)
        log(f"{name}: kiln bench {'ok' if rc == 0 else 'failed: ' + first_error_line(out)}")
    if kind == "gemm":
        flop = 2.0 * p["m"] * p["n"] * p["k"]
        tf = lambda ms: f"{flop / (ms * 1e-3) / 1e12:.0f}" if ms else "—"
        row["notes"].append(f"TFLOP/s: Kiln {tf(row['kiln'].get('on_device_ms'))}, torch.matmul "
                            f"{tf(row['torch'].get('eager', {}).get('device_ms'))}")
    row["seconds"] = round(time.time() - t0, 1)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kiln", default=os.path.join(REPO, "build", "bin", "kiln"))
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--work", default="/tmp/kiln-peer", help="exports, artifacts and logs")
    ap.add_argument("--target", default="sm_90a")
    ap.add_argument("--budget", type=float, default=450, help="seconds; later workloads are skipped")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, import no torch")
    ap.add_argument("--pipeline", default=os.path.join(REPO, "examples", "pipelines", "cuda-sm90.toml"),
                    help="pipeline TOML for kiln compile ('' for none)")
    ap.add_argument("--conv-pipeline", default=os.path.join(REPO, "examples", "pipelines", "cuda-sm90-tf32.toml"),
                    help="pipeline for convolutional models (PyTorch's cuDNN convolutions use TF32)")
    ap.add_argument("--kiln-profile", type=int, default=0, help="kiln bench --profile N (per-step times)")
    ap.add_argument("--torch-modes", default=",".join(MODES),
                    help="PyTorch modes to time (eager,compile,compile-ro); 'none' to profile Kiln alone")
    # worker mode (internal)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--iterations", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--e2e-iterations", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go-timeout", type=float, default=300, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.iterations = a.iterations or (20 if a.quick else 50)
    a.warmup = a.warmup if a.warmup is not None else (3 if a.quick else 10)
    a.e2e_iterations = a.e2e_iterations or (5 if a.quick else 20)
    a.kiln_iterations = a.iterations
    a.compile_timeout, a.bench_timeout, a.worker_timeout = 240, 120, 360
    if a.worker:
        return worker(a)

    known = [w[0] for w in WORKLOADS]
    only = [s for s in a.only.split(",") if s]
    for s in only:
        if s not in known:
            print(f"run.py: unknown workload '{s}'; known: {', '.join(known)}", file=sys.stderr)
            return 2
    # --only also sets the order, so a run short of time drops the workloads named last.
    chosen = [next(w for w in WORKLOADS if w[0] == s) for s in only] if only else list(WORKLOADS)
    kiln = os.path.abspath(a.kiln)
    if a.dry_run:
        print(f"plan: {len(chosen)} workloads, kiln {kiln}, work dir {a.work}, results in {a.out}")
        for w in chosen:
            print(f"{w[0]} ({w[3]}):")
            run_workload(w, a, kiln, a.work, 0)
        return 0
    if not os.access(kiln, os.X_OK):
        print(f"run.py: kiln binary '{kiln}' not found or not executable (give --kiln)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    header = header_info(sys.argv)
    stem = datetime.date.today().isoformat() + "-peer"
    log(f"{len(chosen)} workloads; results: {os.path.join(a.out, stem)}.md; device: {header['device']}")
    start = time.time()
    budget_end = start + a.budget
    rows = []
    for w in chosen:
        if time.time() > budget_end:
            rows.append({"workload": w[0], "shape": w[3], "status": f"skipped: time budget of {a.budget:.0f} s spent",
                         "kiln": {}, "torch": {}, "notes": []})
        else:
            log(f"== {w[0]} ({w[3]})")
            try:
                rows.append(run_workload(w, a, kiln, a.work, budget_end))
            except Exception as e:  # the report must survive anything one workload does
                rows.append({"workload": w[0], "shape": w[3], "status": f"run.py error: {type(e).__name__}: {e}",
                             "kiln": {}, "torch": {}, "notes": [traceback.format_exc()[-500:]]})
            log(f"{w[0]}: {rows[-1]['status']} ({rows[-1].get('seconds', '?')} s)")
        header["torch"] = next((r.get("torch_version") for r in rows if r.get("torch_version")), "?")
        header["total_s"] = round(time.time() - start, 1)
        write_report(a.out, stem, header, rows)
    log(f"done in {time.time() - start:.0f} s: {os.path.join(a.out, stem)}.md")
    with open(os.path.join(a.out, stem + ".md")) as f:
        print(f.read(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
