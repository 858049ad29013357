#!/usr/bin/env python3
"""torch.compile(backend="kiln") against eager PyTorch and torch.compile (default and
reduce-overhead) on GPT-2, a Llama-style block, ResNet-18 and BERT, in one run.

For each model: every mode's largest error against a float64 reference (the same module and
inputs in float64, on the same device), and Kiln's verdict: it passes when its error is within 4x
the worst error of eager and torch.compile plus the dtype's assert_close atol (eager is measured
too because TF32 convolutions and bf16 put PyTorch's own result as far from the exact one as any
compiler's); for information, the largest difference from eager and assert_close's verdict at the
dtype's tolerances and at 100x; the pipeline of each part Kiln compiled; the median time per call (inputs already on the device, outputs
left there; each mode warmed up first); the first call's time (compile time); and, once per
run, the per-call host overhead of Kiln's Python API: `kiln.Model.run` against `kiln_model_run`
called directly (ctypes) on the same artifact, and the overhead of the nn.Module Kiln puts in
the graph against `Model.run`. For the Kiln mode, "host_split_us" splits the torch path's host
time per call less Kiln's run: dynamo's guards, Kiln's check that the frozen weights are
unchanged, and the rest of dynamo (frame evaluation, passing the parameters). Results go to --out as JSON and beside it as a Markdown table
(.md), rewritten after every model.

Kiln's ONNX path on the same model is measured too ("kiln-onnx"): the model exported to ONNX
(the TorchScript exporter, as bench/peer/run.py exports; attention spelled out where the module
uses SDPA), compiled with the pipeline the torch.compile backend uses, run through Model.run on
the same device tensors and timed the same way. The run checks issue 29's goals and exits 1 when
one is missed: Kiln through torch.compile more than --noise (1.05x) slower than the ONNX path,
or not faster than the fastest torch.compile mode on a model where the ONNX path is; Kiln's or
the ONNX path's accuracy check failing; a NaN anywhere; Model.run on CUDA tensors more than
--max-host-overhead-us (10) above kiln_model_run_device. --smoke reports the speed ratios
without enforcing them (tiny models time Python, not kernels).

    # on the GPU machine (torch, torchvision, transformers; a build with -DKILN_BUILD_PYTHON=ON):
    PYTHONPATH=build/python python3 bench/peer/torch_compile_kiln.py --out bench/results/torch-compile-kiln.json
    # anywhere, small sizes on the CPU (Kiln's cpu backend; no reduce-overhead):
    PYTHONPATH=build/python python3 bench/peer/torch_compile_kiln.py --device cpu --smoke --out /tmp/t.json
    # a subset, faster: one model, no Inductor modes, fewer calls
    PYTHONPATH=build/python python3 bench/peer/torch_compile_kiln.py --only gpt2 --no-inductor --iters 20 --out /tmp/t.json

On the GPU Kiln builds artifacts for --target (default sm_90a) and runs them through the
runtime on the CUDA tensors, ordered on PyTorch's current stream (kiln_model_run_device), one
artifact per set of input sizes.
"""
import argparse
import copy
import ctypes
import math
import json
import os
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench", "models"))
sys.path.insert(0, os.path.join(REPO, "bench", "peer"))

MODELS = ["gpt2", "llama", "resnet18", "bert"]


def build(name, smoke, torch, nn):
    """(module, inputs tuple, description, for_onnx): for_onnx(module) gives the module to export
    to ONNX, computing the same function with the same weights: attention spelled out as
    matmul/softmax/matmul where the module uses SDPA, as bench/peer/run.py and
    bench/models/export.py export it (what the TorchScript exporter writes at opset 17)."""
    torch.manual_seed(0)
    if name == "resnet18":
        import export as kexport  # bench/models/export.py

        model, _, _ = kexport.build("resnet18", "small" if smoke else "full")
        batch = 2 if smoke else 32
        size = 64 if smoke else 224
        return model, (torch.randn(batch, 3, size, size),), f"fp32 batch {batch} 3x{size}x{size}", lambda m: m
    if name == "llama":
        from run import LlamaBlock  # bench/peer/run.py

        d, ff, heads, seq, batch = (64, 160, 4, 16, 1) if smoke else (4096, 11008, 32, 2048, 1)
        dtype = torch.float32 if smoke else torch.bfloat16
        model = LlamaBlock(torch, nn, d=d, ff=ff, heads=heads, seq=seq, sdpa=True).to(dtype).eval()

        def spelled_out(m):
            twin = LlamaBlock(torch, nn, d=d, ff=ff, heads=heads, seq=seq, sdpa=False).to(dtype)
            twin = twin.to(next(m.parameters()).device).eval()
            twin.load_state_dict(m.state_dict())
            return twin
        return (model, (torch.randn(batch, seq, d).to(dtype),), f"{str(dtype)[6:]} batch {batch} seq {seq} d {d}",
                spelled_out)
    import transformers as tf

    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500) if smoke else tf.GPT2Config()
        seq, batch = (16, 1) if smoke else (128, 1)
        model = tf.GPT2Model(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                            vocab_size=500) if smoke else tf.BertConfig()
        seq, batch = (16, 1) if smoke else (128, 8)
        model = tf.BertModel(cfg)
    else:
        raise ValueError(name)

    class HiddenStates(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids, use_cache=False, return_dict=True).last_hidden_state

    def eager_attention(m):
        twin = copy.deepcopy(m)  # the copy's modules share one copied config
        twin.inner.config._attn_implementation = "eager"
        return twin

    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(2))
    return HiddenStates(model.eval()).eval(), (ids,), f"fp32 batch {batch} seq {seq}", eager_attention


def timed(torch, fn, iters, warmup, cuda):
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def tolerance(torch, dtype):
    return {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}[dtype]


def reference_f64(model, inputs, torch):
    """The module's output in float64: a copy of it with every floating parameter and buffer in
    float64, on float64 inputs (integer inputs as they are), on the same device. Its error is
    far below any fp32/bf16 mode's (the bench's Llama RMSNorm computes in float32 by its own
    definition, 1e-7 relative: still far below bf16's)."""
    ref = copy.deepcopy(model).to(torch.float64)
    xs = tuple(x.to(torch.float64) if x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        out = ref(*xs)
    del ref
    return out


def max_abs_err(torch, got, want):
    """The largest |got - want| in float64; NaN when either holds a NaN (then no check passes)."""
    diff = (got.double() - want.double()).abs()
    return float(diff.max()) if not torch.isnan(diff).any() else float("nan")


def kiln_onnx(name, model, for_onnx, inputs, a, entry):
    """Kiln's ONNX path on the same model: exported to ONNX, compiled with the pipeline the
    torch.compile backend uses (GPU: kiln.torch.gpu_pipeline, the same passes, backend, targets
    and TF32 flags; cpu: the standard passes on the cpu backend), run through Model.run or
    CompiledModel.run on the same device tensors. Returns the callable timed; puts the exporter,
    the export and compile seconds and the pipeline in `entry`."""
    import tempfile

    import kiln
    import kiln.torch
    import export as kexport  # bench/models/export.py

    work = a.work or tempfile.mkdtemp(prefix="kiln-tck-")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, f"{name}.onnx")
    start = time.perf_counter()
    exp = for_onnx(model)
    names = [f"input_{i}" for i in range(len(inputs))]
    exporter, legacy_error = kexport.export_with_fallback(exp, dict(zip(names, inputs)), path)
    del exp
    entry["exporter"] = exporter
    if legacy_error:
        entry["legacy_export_error"] = legacy_error
    entry["export_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    if a.device == "cuda":
        pipeline = kiln.torch.gpu_pipeline([a.target])
        compiled = kiln.Runtime().load(kiln.compile(path, pipeline, targets=[a.target]))
        entry["pipelines"] = [pipeline.canonical]
    else:
        compiled = kiln.compile(path, backend="cpu")
        entry["pipelines"] = [compiled.pipeline]
    entry["compile_s"] = round(time.perf_counter() - start, 3)
    xs = list(inputs)
    return lambda *_: compiled.run(xs)[0]


def run_model(name, a, torch, nn, kiln_options):
    import kiln.torch

    model, inputs, desc, for_onnx = build(name, a.smoke, torch, nn)
    dev = torch.device(a.device)
    model = model.to(dev)
    inputs = tuple(x.to(dev) for x in inputs)
    cuda = dev.type == "cuda"
    row = {"model": name, "shape": desc, "modes": {}}
    with torch.no_grad():
        ref = reference_f64(model, inputs, torch)
        if cuda:
            torch.cuda.empty_cache()
        want = model(*inputs)
        rtol, atol = tolerance(torch, want.dtype)
        row["accuracy"] = {"reference": f"float64 on {a.device}", "dtype": str(want.dtype)[6:], "atol": atol}
        modes = {"eager": lambda entry: model}
        if a.inductor:
            modes["torch.compile"] = lambda entry: torch.compile(model)
            if cuda:
                modes["torch.compile reduce-overhead"] = lambda entry: torch.compile(model, mode="reduce-overhead")
        modes["kiln"] = lambda entry: torch.compile(model, backend="kiln", options=kiln_options)
        if a.onnx:
            modes["kiln-onnx"] = lambda entry: kiln_onnx(name, model, for_onnx, inputs, a, entry)
        kept = {}  # Kiln's two paths, timed again side by side below
        for mode, make in modes.items():
            if mode != "kiln-onnx":  # the ONNX path needs no dynamo: Kiln's compiled model stays valid
                torch._dynamo.reset()
            entry = {}
            try:
                fn = make(entry)
                start = time.perf_counter()
                got = fn(*inputs)
                if cuda:
                    torch.cuda.synchronize()
                entry["first_call_s"] = round(time.perf_counter() - start, 3)
                if mode.startswith("kiln") and a.kiln_perturb:  # --kiln-perturb: shows that the check can fail
                    got = got.clone()
                    got.view(-1)[0] += a.kiln_perturb
                entry["max_abs_err_vs_f64"] = max_abs_err(torch, got, ref)
                entry["max_abs_diff"] = max_abs_err(torch, got, want)
                # For information: assert_close against eager at the dtype's tolerances and at 100x.
                for scale, key in [(1, "close"), (100, "close_x100")]:
                    try:
                        torch.testing.assert_close(got, want, rtol=rtol * scale, atol=atol * scale)
                        entry[key] = True
                    except AssertionError:
                        entry[key] = False
                entry["ms"] = round(timed(torch, lambda: fn(*inputs), a.iters, a.warmup, cuda), 4)
                if mode == "kiln":  # what Kiln compiled: its parts and the pipeline of each
                    parts = kiln.torch.kiln_backend.last_parts
                    entry["kiln_parts"] = len(parts)
                    # What PyTorch runs between the parts, and why Kiln did not take it.
                    entry["left_in_pytorch"] = kiln.torch.kiln_backend.last_left_in_pytorch
                    entry["pipelines"] = sorted({p.pipeline.canonical if p.pipeline is not None else
                                                 f"passes={p.passes!r} backend={p.backend}" for p in parts})
                    entry.update(call_path_times(torch, fn, parts, inputs, a, cuda))
            except Exception as e:  # one failing mode must not stop the others
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                traceback.print_exc()
            if mode in ("kiln", "kiln-onnx") and "ms" in entry:
                kept[mode] = fn
            fn = None  # frees the mode's compiled model before the next is made (Kiln's stay in `kept`)
            row["modes"][mode] = entry
            print(f"  {name:9} {mode:30} {json.dumps(entry)}", flush=True)
        if len(kept) == 2:
            # Kiln ÷ ONNX from the two timed in alternating blocks: a slow spell of the machine or
            # a clock change falls on both, so the ratio is not an artefact of when each ran.
            row["paired_ms"] = {m: round(v, 4) for m, v in paired(
                torch, {m: (lambda f=f: f(*inputs)) for m, f in kept.items()}, a.iters, cuda).items()}
            print(f"  {name:9} Kiln's paths timed side by side: {json.dumps(row['paired_ms'])}", flush=True)
        kept.clear()
    row["accuracy"].update(accuracy_verdict(row["modes"], atol))
    print(f"  {name:9} accuracy vs float64: {json.dumps(row['accuracy'])}", flush=True)
    if a.onnx:
        row["accuracy_onnx"] = accuracy_verdict(row["modes"], atol, "kiln-onnx")
        print(f"  {name:9} ONNX path's accuracy vs float64: {json.dumps(row['accuracy_onnx'])}", flush=True)
    row["goals"] = model_goals(row, a.noise, speed=not a.smoke)
    print(f"  {name:9} goals: {json.dumps(row['goals'])}", flush=True)
    return row


def call_path_times(torch, fn, parts, inputs, a, cuda):
    """Where the torch.compile path's time goes beyond its Kiln part, for information (the goals
    use "ms"): "part_ms", the part alone called on the same inputs (when it takes just the
    model's inputs), and "guards_skipped_ms", the compiled model with dynamo's guard checks
    skipped (torch.compiler.set_stance's skip_guard_eval_unsafe). Dynamo checks its guards on
    every call before the part is queued: with the GPU waited for after each call, that host
    time adds to the call's. "host_split_us" splits that host time (host_split)."""
    out = {}
    if len(parts) == 1 and len(parts[0].graph_.inputs) == len(inputs):
        xs = list(inputs)
        out["part_ms"] = round(timed(torch, lambda: parts[0].run_tensors(xs), a.iters, a.warmup, cuda), 4)
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            out["guards_skipped_ms"] = round(timed(torch, lambda: fn(*inputs), a.iters, a.warmup, cuda), 4)
    except (AttributeError, TypeError, RuntimeError) as e:  # an older PyTorch without the stance
        out["guards_skipped_ms_error"] = f"{type(e).__name__}: {e}"
    try:
        out["host_split_us"] = host_split(torch, fn, inputs, cuda)
    except Exception as e:  # PyTorch's internals moved: the rest of the row still counts
        out["host_split_error"] = f"{type(e).__name__}: {e}"
    return out


class _Ready:
    """Stands in for a compiled graph's forward or its weights' watch while the host split is
    timed: the outputs of the latest real call, at once (no GPU work queued)."""

    def __init__(self, outs):
        self.outs = outs

    def __call__(self, *args):
        return self.outs

    @staticmethod
    def unchanged(args):
        return True


def host_split(torch, fn, inputs, cuda):
    """Host time (us per call, thread CPU time: no GPU work is queued) of the torch.compile
    path less Kiln's run, split: "call" is the compiled model with the Kiln forward answering at
    once (dynamo's frame evaluation, guards and argument passing, and Kiln's wrapper with its
    check that no weight changed); "guards" dynamo's guard evaluation (the call less the call with
    set_stance(skip_guard_eval_unsafe=True)); "weight_check" Kiln's check that the frozen weights
    are unchanged (the call less the call with the check answering at once); "dynamo_rest" the
    remainder: dynamo's frame evaluation and the pre-graph code that gathers the parameters it
    passes. Also the Python version and dynamo's recursive dict-tag setting (on by default from
    CPython 3.12: guards on unchanged nn.Modules are then skipped, safely), which move "guards"."""
    import kiln.torch

    frozen = kiln.torch.kiln_backend.last_forward
    if frozen is None or not kiln.torch.kiln_backend.last_called_directly:
        return {"skipped": "the latest graph is not called directly"}
    with torch.no_grad():
        outs = fn(*inputs)
        if cuda:
            torch.cuda.synchronize()
    real_forward, real_watch = frozen.forward, frozen.direct_watch
    # Kiln's forward returns a tuple of the graph's outputs; the compiled model returns the
    # module's output: take them from a real call of the forward itself.
    captured = {}

    def capture(*args):
        captured["outs"] = real_forward(*args)
        return captured["outs"]

    frozen.forward = capture
    try:
        with torch.no_grad():
            fn(*inputs)
        if cuda:
            torch.cuda.synchronize()
        frozen.forward = _Ready(captured["outs"])

        def cpu_us(f, calls=500):
            with torch.no_grad():
                for _ in range(50):
                    f()
                best = []
                for _ in range(5):
                    start = time.thread_time_ns()
                    for _ in range(calls):
                        f()
                    best.append((time.thread_time_ns() - start) / calls / 1e3)
            return statistics.median(best)

        split = {"call": cpu_us(lambda: fn(*inputs))}
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            skipped = cpu_us(lambda: fn(*inputs))
        frozen.direct_watch = _Ready(None)
        unchecked = cpu_us(lambda: fn(*inputs))
        split["guards"] = split["call"] - skipped
        split["weight_check"] = split["call"] - unchecked
        split["dynamo_rest"] = skipped - split["weight_check"]
        split["weights_checked"] = len(real_watch)
    finally:
        frozen.forward, frozen.direct_watch = real_forward, real_watch
    split = {k: round(v, 2) if isinstance(v, float) else v for k, v in split.items()}
    split["python"] = sys.version.split()[0]
    split["recursive_dict_tags"] = bool(getattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", False))
    return split


def accuracy_verdict(modes, atol, mode="kiln"):
    """Kiln's verdict (`mode`'s: "kiln", or "kiln-onnx" for the ONNX path) against the float64
    reference: its error must be at most 4x the worst of PyTorch's own modes' (eager,
    torch.compile) plus `atol`. A failed mode, or a NaN anywhere, fails it. For "kiln", also sets
    the earlier rule's within_4x_of_torch_compile on its entry (its difference from eager against
    torch.compile's), for information."""
    kiln_entry = modes.get(mode, {})
    peers = {k: m["max_abs_err_vs_f64"] for k, m in modes.items()
             if not k.startswith("kiln") and "max_abs_err_vs_f64" in m}
    inductor = [m["max_abs_diff"] for k, m in modes.items() if k.startswith("torch.compile") and "max_abs_diff" in m]
    if mode == "kiln" and "max_abs_diff" in kiln_entry:
        kiln_entry["within_4x_of_torch_compile"] = bool(inductor) and kiln_entry["max_abs_diff"] <= 4 * max(inductor)
    err = kiln_entry.get("max_abs_err_vs_f64")
    if err is None or not peers:
        return {"pass": False, "why": kiln_entry.get("error", "no Kiln result or no PyTorch mode to compare with")}
    worst = max(peers, key=lambda k: (math.isnan(peers[k]), peers[k]))
    bound = 4 * peers[worst] + atol
    ok = not math.isnan(err) and err <= bound  # a NaN bound fails too
    return {"kiln_err": err, "worst_pytorch_mode": worst, "worst_pytorch_err": peers[worst], "bound": bound,
            "pass": bool(ok)}


def _is_nan(v):
    return isinstance(v, float) and math.isnan(v)


def model_goals(row, noise, speed=True):
    """Issue 29's goals on one model's row: Kiln through torch.compile no slower than Kiln's ONNX
    path (Kiln ÷ ONNX at most `noise`, e.g. 1.05: timing noise; from the two timed side by side,
    `paired_ms`, where the row has them, else from each mode's `ms`), and faster than Inductor (the
    fastest torch.compile mode) wherever the ONNX path is; both paths within the float64
    accuracy bound; no NaN in any number. `speed=False` reports the ratios without failing on
    them (--smoke: tiny models time Python's per-call overhead, not the kernels). Returns
    {ratios..., "missed": [why, ...]}: an empty list when every goal is met."""
    modes = row.get("modes", {})
    missed = []
    for mode, entry in modes.items():
        for key, v in entry.items():
            if _is_nan(v):
                missed.append(f"{mode}: {key} is NaN")
    for key, mode in (("accuracy", "kiln"), ("accuracy_onnx", "kiln-onnx")):
        verdict = row.get(key)
        if verdict is not None and not verdict.get("pass"):
            missed.append(f"{mode}: accuracy vs float64 fails ({verdict.get('why') or _bound_text(verdict)})")
    pair = row.get("paired_ms", {})  # the two timed side by side, when both ran
    missed += [f"paired_ms: {mode} is NaN" for mode, v in pair.items() if _is_nan(v)]
    out = {}
    kiln_ms = modes.get("kiln", {}).get("ms")
    onnx_ms = modes.get("kiln-onnx", {}).get("ms")
    inductor = [m["ms"] for k, m in modes.items() if k.startswith("torch.compile") and "ms" in m and not _is_nan(m["ms"])]
    if "kiln-onnx" in modes:
        if kiln_ms is None or onnx_ms is None:
            missed.append("no time for " + " and ".join(m for m, v in (("kiln", kiln_ms), ("kiln-onnx", onnx_ms))
                                                      if v is None) + ": Kiln ÷ ONNX unknown")
        else:
            k, o = pair.get("kiln", kiln_ms), pair.get("kiln-onnx", onnx_ms)
            if not (_is_nan(k) or _is_nan(o)) and o > 0:
                out["kiln_vs_onnx"] = round(k / o, 4)
                if speed and out["kiln_vs_onnx"] > noise:
                    missed.append(f"kiln {k} ms is {out['kiln_vs_onnx']}x Kiln's ONNX path ({o} ms), above {noise}x")
    if inductor and kiln_ms is not None and not _is_nan(kiln_ms):
        best = min(inductor)
        out["kiln_vs_inductor"] = round(kiln_ms / best, 4)
        if onnx_ms is not None and not _is_nan(onnx_ms):
            out["onnx_vs_inductor"] = round(onnx_ms / best, 4)
            if speed and onnx_ms < best and kiln_ms >= best:
                missed.append(f"kiln {kiln_ms} ms is not faster than torch.compile ({best} ms) "
                              f"while Kiln's ONNX path is ({onnx_ms} ms)")
    out["missed"] = missed
    return out


def _bound_text(verdict):
    return f"error {verdict.get('kiln_err')} above {verdict.get('bound')}"


def host_goal(overhead, limit_us):
    """The host-overhead goal: Model.run on torch CUDA tensors at most `limit_us` above
    kiln_model_run_device on the same model. [] when met or not measured (CPU runs)."""
    if not overhead or "python_over_c_api_us" not in overhead:
        return []
    over = overhead["python_over_c_api_us"]
    if _is_nan(over) or over > limit_us:
        return [f"Model.run on CUDA tensors is {over} us above kiln_model_run_device (goal: at most {limit_us})"]
    return []


def host_overhead(a, torch):
    """Per-call host time of Kiln's Python layers over the C API, on a tiny model."""
    import numpy as np
    import kiln
    import kiln.torch

    g = kiln.Graph("tiny")
    x = g.add_input("x", "f32", [16])
    g.set_outputs([g.add_node("relu", [x])[0]], ["y"])
    xs = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    out = {}
    if a.device == "cuda":
        art = kiln.compile(g, targets=[a.target], passes="")
        model = kiln.Runtime().load(art)
        lib = ctypes.CDLL(os.path.join(os.path.dirname(kiln._kiln.__file__), "..", "..", "lib", "libkiln_runtime.so"))
        c_api = _c_api_model(lib, art.to_bytes())
        host = (ctypes.c_void_p * 2)(xs.ctypes.data, 64)
        y = np.empty(16, np.float32)
        outs = (ctypes.c_void_p * 2)(y.ctypes.data, 64)
        out["kiln_model_run_us"] = 1e3 * timed(torch, lambda: lib.kiln_model_run(c_api, host, 1, outs, 1), 2000, 200, False)
        out["Model.run_numpy_us"] = 1e3 * timed(torch, lambda: model.run([xs]), 2000, 200, False)
        xt = torch.from_numpy(xs)
        out["Model.run_torch_cpu_us"] = 1e3 * timed(torch, lambda: model.run([xt]), 2000, 200, False)
        # Device buffers on PyTorch's stream: host time per call (neither side waits).
        xd, yd = xt.cuda(), torch.empty(16, device="cuda")
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        dev_in = (ctypes.c_void_p * 2)(xd.data_ptr(), 64)
        dev_out = (ctypes.c_void_p * 2)(yd.data_ptr(), 64)
        lib.kiln_model_run_device.restype = ctypes.c_void_p
        lib.kiln_model_run_device.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                              ctypes.c_size_t, ctypes.c_void_p]
        # The pair the goal compares, timed in alternating blocks so that drift falls on both alike.
        out.update({k: 1e3 * v for k, v in paired(torch, {
            "kiln_model_run_device_us": lambda: lib.kiln_model_run_device(c_api, dev_in, 1, dev_out, 1, stream),
            "Model.run_torch_cuda_us": lambda: model.run([xd])}, 2000, False, rounds=10, warmup=200).items()})
        out["python_over_c_api_us"] = out["Model.run_torch_cuda_us"] - out["kiln_model_run_device_us"]
        torch.cuda.synchronize()
    else:
        model = kiln.compile(g, backend="cpu", passes="")
        out["CompiledModel.run_numpy_us"] = 1e3 * timed(torch, lambda: model.run([xs]), 2000, 200, False)
        out["CompiledModel._run_us"] = 1e3 * timed(torch, lambda: model._impl._run([xs], False), 2000, 200, False)
        xt = torch.from_numpy(xs)
        out["CompiledModel.run_torch_cpu_us"] = 1e3 * timed(torch, lambda: model.run([xt]), 2000, 200, False)
    relu = torch.nn.ReLU()
    xt = torch.from_numpy(xs).to(a.device)
    fast = kiln.torch.compile_module(relu, (xt,), backend="cpu", targets=[a.target] if a.device == "cuda" else ())
    # Waiting for the GPU after each call (as first measured), and host time alone as above.
    out["compile_module_call_us"] = 1e3 * timed(torch, lambda: fast(xt), 2000, 200, a.device == "cuda")
    out["compile_module_call_host_us"] = 1e3 * timed(torch, lambda: fast(xt), 2000, 200, False)
    (part,) = fast.kiln_parts()
    out["kiln_part_call_us"] = 1e3 * timed(torch, lambda: part(xt), 2000, 200, False)
    # torch.compile(backend="kiln")'s own per-call cost (dynamo's guards, AOTAutograd's wrapper),
    # host time: what the Kiln column pays per call beyond Model.run.
    torch._dynamo.reset()
    compiled = torch.compile(relu, backend="kiln", options=_kiln_options(a))
    with torch.no_grad():
        compiled(xt)
        out["torch_compile_call_host_us"] = 1e3 * timed(torch, lambda: compiled(xt), 2000, 200, False)
    if a.device == "cuda":
        torch.cuda.synchronize()
    out = {k: round(v, 2) for k, v in out.items()}
    print("  host overhead:", json.dumps(out), flush=True)
    return out


def paired(torch, fns, calls, cuda, rounds=5, warmup=0):
    """Median ms per call of each of `fns` (name -> callable), timed as `timed` does in
    alternating blocks (`rounds` blocks each, `calls` calls in all), so that a slow spell of the
    machine falls on all of them: the median of each one's block medians."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    blocks = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            blocks[name].append(timed(torch, fn, max(1, calls // rounds), 0, cuda))
    return {name: statistics.median(v) for name, v in blocks.items()}


def _c_api_model(lib, data):
    """A kiln_model* loaded through the C API, to time kiln_model_run without Python's layers."""
    lib.kiln_runtime_options_initialize.argtypes = [ctypes.c_void_p]
    opts = ctypes.create_string_buffer(64)
    lib.kiln_runtime_options_initialize(opts)
    rt, model = ctypes.c_void_p(), ctypes.c_void_p()
    lib.kiln_runtime_create.restype = ctypes.c_void_p
    if lib.kiln_runtime_create(opts, ctypes.byref(rt)):
        raise RuntimeError("kiln_runtime_create failed")
    lib.kiln_model_load_memory.restype = ctypes.c_void_p
    if lib.kiln_model_load_memory(rt, data, len(data), ctypes.byref(model)):
        raise RuntimeError("kiln_model_load_memory failed")
    lib.kiln_model_run.restype = ctypes.c_void_p
    lib.kiln_model_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    _c_api_model.keep = (rt, model)
    return model


def _kiln_options(a):
    """torch.compile's options for Kiln on the run's device."""
    return {"targets": [a.target]} if a.device == "cuda" else {"backend": "cpu"}


# The modes' columns: JSON key -> heading.
TABLE_MODES = {"eager": "eager", "torch.compile": "torch.compile", "torch.compile reduce-overhead":
               "torch.compile reduce-overhead", "kiln": "Kiln", "kiln-onnx": "Kiln ONNX"}


def markdown(result):
    """The run as a Markdown table (median ms per call, the goals' ratios and verdicts) and the
    host overhead, for bench/results."""
    def cell(entry):
        if "ms" in entry:
            return f"{entry['ms']:.3f}"
        return "error" if "error" in entry else "-"

    def ratio(goals, key):
        return f"{goals[key]:.2f}x" if key in goals else "-"

    lines = [f"Device: {result['device']}, PyTorch {result['torch']}, Kiln {result['kiln']}. Median ms per call "
             "(inputs on the device). Kiln: torch.compile(backend=\"kiln\"); Kiln ONNX: the same model exported "
             "to ONNX, compiled with the same pipeline, run through Model.run. Kiln ÷ Kiln ONNX: the two timed "
             "again in alternating blocks.", "",
             "| model | " + " | ".join(TABLE_MODES.values()) + " | Kiln ÷ Kiln ONNX | Kiln ÷ fastest torch.compile "
             "| ONNX ÷ fastest torch.compile | Kiln parts | accuracy (Kiln, ONNX) | goals |",
             "|---|" + "---:|" * (len(TABLE_MODES) + 4) + "---|---|"]
    for m in result["models"]:
        if "skipped" in m:
            lines.append(f"| {m['model']} | skipped: {m['skipped']} |")
            continue
        modes, goals = m["modes"], m.get("goals", {})
        accuracy = ", ".join("pass" if m[k]["pass"] else "**fail**" for k in ("accuracy", "accuracy_onnx") if k in m)
        missed = goals.get("missed", [])
        lines.append(f"| {m['model']} {m['shape']} | " + " | ".join(cell(modes.get(k, {})) for k in TABLE_MODES) +
                     f" | {ratio(goals, 'kiln_vs_onnx')} | {ratio(goals, 'kiln_vs_inductor')} "
                     f"| {ratio(goals, 'onnx_vs_inductor')} | {modes.get('kiln', {}).get('kiln_parts', '-')} "
                     f"| {accuracy} | {'met' if not missed else '**missed**: ' + '; '.join(missed)} |")
    call_path = [f"{m['model']} {m['modes']['kiln'].get('part_ms', '-')} / {m['modes']['kiln'].get('guards_skipped_ms', '-')}"
                 for m in result["models"] if "part_ms" in m.get("modes", {}).get("kiln", {})]
    if call_path:
        lines += ["", "Kiln's torch.compile path, ms per call of its Kiln part alone / of the compiled model with "
                  "dynamo's guards skipped: " + ", ".join(call_path)]
    splits = [f"{m['model']}: " + ", ".join(f"{k} {v}" for k, v in m["modes"]["kiln"]["host_split_us"].items())
              for m in result["models"] if "host_split_us" in m.get("modes", {}).get("kiln", {})]
    if splits:
        lines += ["", "Host time per call of the torch.compile path less Kiln's run (us, thread CPU time; call = "
                  "guards + weight_check + dynamo_rest + Kiln's call itself): " + "; ".join(splits)]
    if result.get("host_overhead"):
        lines += ["", "Host overhead per call (one-op model, us): " +
                  ", ".join(f"{k} {v}" for k, v in result["host_overhead"].items())]
    if result.get("missed"):
        lines += ["", "Goals missed:", ""] + [f"- {why}" for why in result["missed"]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--target", default="sm_90a", help="Kiln's GPU target (--device cuda)")
    ap.add_argument("--only", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    ap.add_argument("--smoke", action="store_true",
                    help="small models, few iterations; speed goals reported, not enforced")
    ap.add_argument("--no-inductor", dest="inductor", action="store_false",
                    help="leave out torch.compile's own modes (slow to compile on the CPU)")
    ap.add_argument("--no-onnx", dest="onnx", action="store_false",
                    help="leave out Kiln's ONNX path (then Kiln ÷ ONNX is not checked)")
    ap.add_argument("--noise", type=float, default=1.05,
                    help="Kiln ÷ Kiln ONNX above this fails the run (default 1.05: timing noise)")
    ap.add_argument("--max-host-overhead-us", type=float, default=10.0,
                    help="Model.run on CUDA tensors more than this above kiln_model_run_device fails the run")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--out", required=True, help="JSON file to write (and its table beside it, .md)")
    ap.add_argument("--work", default=None, help="folder for the ONNX exports (default: a new temporary one)")
    ap.add_argument("--no-host-overhead", dest="host_overhead", action="store_false",
                    help="leave out the per-call host overhead measurements")
    ap.add_argument("--kiln-perturb", type=float, default=0.0, metavar="X",
                    help="testing the check: add X to one element of Kiln's outputs (both paths) before they are compared")
    a = ap.parse_args()
    a.iters = a.iters or (5 if a.smoke else 100)
    a.warmup = a.warmup or (2 if a.smoke else 20)

    try:
        import torch
        from torch import nn
    except ImportError:
        print("torch_compile_kiln: needs torch (scripts/setup-python.sh installs it)")
        return 77  # ctest's smoke run shows as skipped
    if a.onnx:
        try:
            import onnx  # noqa: F401  (the TorchScript exporter writes through it)
        except ImportError:
            print("torch_compile_kiln: Kiln's ONNX path needs the onnx package (scripts/setup-python.sh installs "
                  "it; --no-onnx leaves the path out)")
            return 77
    import kiln
    import kiln.torch  # registers backend="kiln" when not installed as a package

    kiln_options = _kiln_options(a)
    result = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
              "torch": torch.__version__, "kiln": kiln.__version__, "smoke": a.smoke,
              "kiln_options": kiln_options, "noise": a.noise, "models": [], "host_overhead": None, "missed": []}
    md = os.path.splitext(a.out)[0] + ".md"

    def save():
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(md, "w") as f:
            f.write(markdown(result))

    for name in a.only.split(","):
        try:
            result["models"].append(run_model(name, a, torch, nn, kiln_options))
        except ImportError as e:
            result["models"].append({"model": name, "skipped": str(e)})
            print(f"  {name}: skipped ({e})", flush=True)
        save()
    missed = [f"{m['model']}: {why}" for m in result["models"] for why in m.get("goals", {}).get("missed", [])]
    if a.host_overhead:
        result["host_overhead"] = host_overhead(a, torch)
        missed += host_goal(result["host_overhead"], a.max_host_overhead_us)
    result["missed"] = missed
    save()
    print(markdown(result), flush=True)
    print(f"wrote {a.out} and {md}; " + ("goals missed:\n" + "\n".join("  " + w for w in missed) if missed
                                         else "every goal met on every model run"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
