#!/usr/bin/env python3
"""Writes a model folder (model.onnx, input_x.npy, output_y.npy): a T5-style RMS norm as the model's last nodes, output named "y".

canonicalize drops the final Identity and the fusion passes turn the Pow/ReduceMean/Add/Sqrt/
Div/Mul chain into one fused node, so the value that computes the output is another one; the
output must still be called "y". The expected output is float64 math stored as float32;
tests/models/check_model.py reads the folder.

    python3 tests/cli/data/make_rms_tail.py tests/cli/data/rms-tail
"""
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
rng = np.random.default_rng(7)
x = rng.standard_normal((2, 3, 16)).astype(np.float32)
w = rng.standard_normal((16,)).astype(np.float32)

nodes = [
    helper.make_node("Pow", ["x", "two"], ["sq"]),
    helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
    helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
    helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
    helper.make_node("Div", ["x", "rms"], ["normed"]),
    helper.make_node("Mul", ["w", "normed"], ["scaled"]),
    helper.make_node("Identity", ["scaled"], ["y"]),  # as exporters end T5's encoder (dropout)
]
graph = helper.make_graph(
    nodes, "rms_tail",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 16])],
    initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                 numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
                 numpy_helper.from_array(w, "w")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
onnx.checker.check_model(model)
onnx.save(model, os.path.join(out_dir, "model.onnx"))

xd = x.astype(np.float64)
y = w * (xd / np.sqrt((xd * xd).mean(axis=-1, keepdims=True) + 1e-6))
np.save(os.path.join(out_dir, "input_x.npy"), x)
np.save(os.path.join(out_dir, "output_y.npy"), y.astype(np.float32))
