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
the graph against `Model.run`. Results go to --out as JSON, rewritten after every model.

    # on the GPU machine (torch, torchvision, transformers; a build with -DKILN_BUILD_PYTHON=ON):
    PYTHONPATH=build/python python3 bench/peer/torch_compile_kiln.py --out bench/results/torch-compile-kiln.json
    # anywhere, small sizes on the CPU (Kiln's cpu backend; no reduce-overhead):
    PYTHONPATH=build/python python3 bench/peer/torch_compile_kiln.py --device cpu --smoke --out /tmp/t.json

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
    """(module, inputs tuple, description)."""
    torch.manual_seed(0)
    if name == "resnet18":
        import export as kexport  # bench/models/export.py

        model, _, _ = kexport.build("resnet18", "small" if smoke else "full")
        batch = 2 if smoke else 32
        size = 64 if smoke else 224
        return model, (torch.randn(batch, 3, size, size),), f"fp32 batch {batch} 3x{size}x{size}"
    if name == "llama":
        from run import LlamaBlock  # bench/peer/run.py

        d, ff, heads, seq, batch = (64, 160, 4, 16, 1) if smoke else (4096, 11008, 32, 2048, 1)
        dtype = torch.float32 if smoke else torch.bfloat16
        model = LlamaBlock(torch, nn, d=d, ff=ff, heads=heads, seq=seq, sdpa=True).to(dtype).eval()
        return model, (torch.randn(batch, seq, d).to(dtype),), f"{str(dtype)[6:]} batch {batch} seq {seq} d {d}"
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

    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(2))
    return HiddenStates(model.eval()).eval(), (ids,), f"fp32 batch {batch} seq {seq}"


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


def run_model(name, a, torch, nn, kiln_options):
    import kiln.torch

    model, inputs, desc = build(name, a.smoke, torch, nn)
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
        modes = {"eager": lambda: model}
        if a.inductor:
            modes["torch.compile"] = lambda: torch.compile(model)
            if cuda:
                modes["torch.compile reduce-overhead"] = lambda: torch.compile(model, mode="reduce-overhead")
        modes["kiln"] = lambda: torch.compile(model, backend="kiln", options=kiln_options)
        for mode, make in modes.items():
            torch._dynamo.reset()
            entry = {}
            try:
                fn = make()
                start = time.perf_counter()
                got = fn(*inputs)
                if cuda:
                    torch.cuda.synchronize()
                entry["first_call_s"] = round(time.perf_counter() - start, 3)
                if mode == "kiln" and a.kiln_perturb:  # --kiln-perturb: shows that the check can fail
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
            except Exception as e:  # one failing mode must not stop the others
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                traceback.print_exc()
            row["modes"][mode] = entry
            print(f"  {name:9} {mode:30} {json.dumps(entry)}", flush=True)
    row["accuracy"].update(accuracy_verdict(row["modes"], atol))
    print(f"  {name:9} accuracy vs float64: {json.dumps(row['accuracy'])}", flush=True)
    return row


def accuracy_verdict(modes, atol):
    """Kiln's verdict against the float64 reference: its error must be at most 4x the worst of
    PyTorch's own modes' (eager, torch.compile) plus `atol`. A failed mode, or a NaN anywhere,
    fails it. Also sets the earlier rule's within_4x_of_torch_compile on Kiln's entry (its
    difference from eager against torch.compile's), for information."""
    kiln_entry = modes.get("kiln", {})
    peers = {k: m["max_abs_err_vs_f64"] for k, m in modes.items() if k != "kiln" and "max_abs_err_vs_f64" in m}
    inductor = [m["max_abs_diff"] for k, m in modes.items() if k.startswith("torch.compile") and "max_abs_diff" in m]
    if "max_abs_diff" in kiln_entry:
        kiln_entry["within_4x_of_torch_compile"] = bool(inductor) and kiln_entry["max_abs_diff"] <= 4 * max(inductor)
    err = kiln_entry.get("max_abs_err_vs_f64")
    if err is None or not peers:
        return {"pass": False, "why": kiln_entry.get("error", "no Kiln result or no PyTorch mode to compare with")}
    worst = max(peers, key=lambda k: (math.isnan(peers[k]), peers[k]))
    bound = 4 * peers[worst] + atol
    ok = not math.isnan(err) and err <= bound  # a NaN bound fails too
    return {"kiln_err": err, "worst_pytorch_mode": worst, "worst_pytorch_err": peers[worst], "bound": bound,
            "pass": bool(ok)}


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
        out["kiln_model_run_device_us"] = 1e3 * timed(
            torch, lambda: lib.kiln_model_run_device(c_api, dev_in, 1, dev_out, 1, stream), 2000, 200, False)
        out["Model.run_torch_cuda_us"] = 1e3 * timed(torch, lambda: model.run([xd]), 2000, 200, False)
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
    if a.device == "cuda":
        torch.cuda.synchronize()
    out = {k: round(v, 2) for k, v in out.items()}
    print("  host overhead:", json.dumps(out), flush=True)
    return out


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--target", default="sm_90a", help="Kiln's GPU target (--device cuda)")
    ap.add_argument("--only", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--smoke", action="store_true", help="small models, few iterations")
    ap.add_argument("--no-inductor", dest="inductor", action="store_false",
                    help="leave out torch.compile's own modes (slow to compile on the CPU)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--no-host-overhead", dest="host_overhead", action="store_false",
                    help="leave out the per-call host overhead measurements")
    ap.add_argument("--kiln-perturb", type=float, default=0.0, metavar="X",
                    help="testing the check: add X to one element of Kiln's output before it is compared")
    a = ap.parse_args()
    a.iters = a.iters or (5 if a.smoke else 100)
    a.warmup = a.warmup or (2 if a.smoke else 20)

    try:
        import torch
        from torch import nn
    except ImportError:
        print("torch_compile_kiln: needs torch (scripts/setup-python.sh installs it)")
        return 77  # ctest's smoke run shows as skipped
    import kiln
    import kiln.torch  # registers backend="kiln" when not installed as a package

    kiln_options = {"targets": [a.target]} if a.device == "cuda" else {"backend": "cpu"}
    result = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
              "torch": torch.__version__, "kiln": kiln.__version__, "smoke": a.smoke,
              "kiln_options": kiln_options, "models": [], "host_overhead": None}

    def save():
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    for name in a.only.split(","):
        try:
            result["models"].append(run_model(name, a, torch, nn, kiln_options))
        except ImportError as e:
            result["models"].append({"model": name, "skipped": str(e)})
            print(f"  {name}: skipped ({e})", flush=True)
        save()
    if a.host_overhead:
        result["host_overhead"] = host_overhead(a, torch)
    failed = [m["model"] for m in result["models"] if "accuracy" in m and not m["accuracy"]["pass"]]
    save()
    print(f"wrote {a.out}; kiln {'failed on ' + ', '.join(failed) if failed else 'within the float64 bound on every model run'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
