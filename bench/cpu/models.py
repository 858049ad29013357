#!/usr/bin/env python3
"""Builds the CPU benchmark's ONNX models with onnx's helper and seeded random weights.

No torch here: each model is spelled out node by node with the shapes (and the node pattern
of PyTorch's TorchScript exporter, opset 17) of the real architecture:
  mlp       8 x (Gemm 512x512 + Relu), batch 1
  gpt2      GPT-2 small (12 layers, d 768, 12 heads, vocab 50257), batch 1, seq 128,
            last hidden state (no LM head), GELU in its tanh form
  resnet18  ResNet-18 (batch norms folded into the convs, as the exporter does in eval mode),
            batch 1, 3x224x224, 1000 classes

    python3 bench/cpu/models.py OUT_DIR [--only mlp,gpt2,resnet18]
"""
import argparse
import math
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class Builder:
    def __init__(self, seed):
        self.nodes, self.inits, self.n = [], [], 0
        self.rng = np.random.default_rng(seed)

    def name(self, base):
        self.n += 1
        return f"{base}_{self.n}"

    def weight(self, shape, std):
        t = self.name("w")
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * std).astype(np.float32), t))
        return t

    def const(self, array):
        t = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(array), t))
        return t

    def op(self, op_type, inputs, n_out=1, **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, name, inputs, outputs):
        g = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="kiln-bench-cpu")
        m.ir_version = 8
        return m


def mlp(width=512, layers=8):
    b = Builder(1)
    x = "input"
    for _ in range(layers):
        x = b.op("Gemm", [x, b.weight((width, width), 1 / math.sqrt(width)), b.weight((width,), 0.01)], transB=1)
        x = b.op("Relu", [x])
    b.nodes[-1].output[0] = "output"
    return b.model("mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, width])],
                   [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, width])])


def gpt2(seq=128, d=768, heads=12, layers=12, vocab=50257, ctx=1024):
    b = Builder(2)
    hd = d // heads

    def layer_norm(x):
        return b.op("LayerNormalization", [x, b.const(np.ones(d, np.float32)), b.const(np.zeros(d, np.float32))],
                    axis=-1, epsilon=1e-5)

    def dense(x, n_in, n_out):  # HF Conv1D: x @ W + b
        return b.op("Add", [b.op("MatMul", [x, b.weight((n_in, n_out), 0.02)]), b.weight((n_out,), 0.02)])

    pos = b.const(np.arange(seq, dtype=np.int64))
    h = b.op("Add", [b.op("Gather", [b.weight((vocab, d), 0.02), "input_ids"]),
                     b.op("Gather", [b.weight((ctx, d), 0.01), pos])])
    mask = b.const(np.triu(np.full((1, 1, seq, seq), -3.4028234663852886e38, np.float32), 1))
    heads_shape = b.const(np.array([1, seq, heads, hd], np.int64))
    merged_shape = b.const(np.array([1, seq, d], np.int64))
    split = b.const(np.array([d, d, d], np.int64))
    for _ in range(layers):
        a = layer_norm(h)
        q, k, v = b.op("Split", [dense(a, d, 3 * d), split], n_out=3, axis=2)
        q = b.op("Transpose", [b.op("Reshape", [q, heads_shape])], perm=[0, 2, 1, 3])
        k = b.op("Transpose", [b.op("Reshape", [k, heads_shape])], perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [v, heads_shape])], perm=[0, 2, 1, 3])
        s = b.op("Div", [b.op("MatMul", [q, k]), b.const(np.array(math.sqrt(hd), np.float32))])
        p = b.op("Softmax", [b.op("Add", [s, mask])], axis=-1)
        o = b.op("Reshape", [b.op("Transpose", [b.op("MatMul", [p, v])], perm=[0, 2, 1, 3]), merged_shape])
        h = b.op("Add", [h, dense(o, d, d)])
        f = dense(layer_norm(h), d, 4 * d)
        # GELU, tanh form, as HF's NewGELUActivation exports it.
        cube = b.op("Pow", [f, b.const(np.array(3.0, np.float32))])
        inner = b.op("Mul", [b.op("Add", [f, b.op("Mul", [cube, b.const(np.array(0.044715, np.float32))])]),
                             b.const(np.array(math.sqrt(2 / math.pi), np.float32))])
        g = b.op("Mul", [b.op("Mul", [f, b.const(np.array(0.5, np.float32))]),
                         b.op("Add", [b.op("Tanh", [inner]), b.const(np.array(1.0, np.float32))])])
        h = b.op("Add", [h, dense(g, 4 * d, d)])
    out = layer_norm(h)
    b.nodes[-1].output[0] = "output"
    return b.model("gpt2", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq])],
                   [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, seq, d])])


def resnet18(classes=1000):
    b = Builder(3)

    def conv(x, c_in, c_out, k, stride, relu=True):
        w = b.weight((c_out, c_in, k, k), math.sqrt(2 / (c_in * k * k)))
        y = b.op("Conv", [x, w, b.weight((c_out,), 0.01)], kernel_shape=[k, k], strides=[stride, stride],
                 pads=[k // 2] * 4)
        return b.op("Relu", [y]) if relu else y

    x = conv("input", 3, 64, 7, 2)
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = 64
    for c, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        for blk in range(2):
            s = stride if blk == 0 else 1
            y = conv(conv(x, c_in, c, 3, s), c, c, 3, 1, relu=False)
            short = conv(x, c_in, c, 1, s, relu=False) if (s != 1 or c_in != c) else x
            x = b.op("Relu", [b.op("Add", [y, short])])
            c_in = c
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    b.op("Gemm", [x, b.weight((classes, 512), 1 / math.sqrt(512)), b.weight((classes,), 0.01)], transB=1)
    b.nodes[-1].output[0] = "output"
    return b.model("resnet18", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])],
                   [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, classes])])


BUILDERS = {"mlp": mlp, "gpt2": gpt2, "resnet18": resnet18}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--only", default=",".join(BUILDERS))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name in a.only.split(","):
        path = os.path.join(a.out, f"{name}.onnx")
        if not os.path.exists(path):
            m = BUILDERS[name]()
            onnx.checker.check_model(m)
            onnx.save(m, path)
        print(path)


if __name__ == "__main__":
    main()
