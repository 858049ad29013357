"""Kiln from Python: a .kir model on the CPU, an artifact for GPUs, a PyTorch module.

    PYTHONPATH=build/python .venv/bin/python examples/python/quickstart.py
"""
import os
import time

import numpy as np

import kiln

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
mlp = os.path.join(root, "examples", "kir", "mlp.kir")
backends = {p["name"] for p in kiln.plugins() if p["kind"] == "backend"}

# 1. Compile for this process and run on NumPy arrays (the batch dim B stays symbolic).
model = kiln.compile(mlp, backend="cpu" if "cpu" in backends else "reference")
print("pipeline:", model.pipeline)
rng = np.random.default_rng(0)
inputs = {i["name"]: (rng.standard_normal([4 if d == "B" else d for d in i["shape"]]) * 0.1).astype(np.float32)
          for i in model.inputs}
(probs,) = model.run(inputs)
print("probs:", probs.shape, "rows sum to", probs.sum(-1).round(5))

# 2. One artifact for two GPU generations (NVRTC: no GPU needed to build it).
if "cuda-sm90" in backends:
    art = kiln.compile(mlp, targets=["sm_80", "sm_90a"], symbols={"B": 4})
    info = art.inspect()
    print("artifact:", len(art), "bytes, targets", info["targets"])

# 3. A PyTorch module, without ONNX: Kiln runs what it lowers, PyTorch the rest.
try:
    import torch
    import kiln.torch
except ImportError as e:
    print(f"skipping the PyTorch part: {e}")
else:
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).eval()
    x = torch.randn(8, 64)
    start = time.perf_counter()
    fast = kiln.torch.compile_module(net, (x,), backend="cpu" if "cpu" in backends else "reference")
    print(f"compile_module: {time.perf_counter() - start:.2f} s, {len(fast.kiln_parts())} Kiln part(s)")
    with torch.no_grad():
        torch.testing.assert_close(fast(x), net(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.compile(net, backend="kiln")(x), net(x), rtol=1e-4, atol=1e-4)
    print("kiln.torch.compile_module and torch.compile(backend='kiln') match eager PyTorch")
