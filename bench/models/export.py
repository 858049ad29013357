#!/usr/bin/env python3
"""Exports Kiln's real test models to ONNX with random weights (no downloads).

Models: ResNet-18, GPT-2 small, BERT-base and a Llama-style decoder (RMSNorm, RoPE, SwiGLU,
grouped-query attention), each at full size and as a small version (same architecture,
smaller widths and depths, a few MB) for the test suite. Exporters: the TorchScript exporter
(`torch.onnx.export(dynamo=False, opset_version=17)`) and the default dynamo exporter (opset
18+, weights in an external-data file).

For every export, onnxruntime runs the model on seeded random inputs; inputs and outputs are
saved next to it as .npy files, so Kiln can be checked against onnxruntime without it.

    python3 bench/models/export.py --out OUT [--size small|full|all] [--exporters legacy,dynamo]

Needs torch, torchvision, transformers, onnx, onnxscript and onnxruntime (the GPU machine has
them). Each export writes OUT/<model>-<size>-<exporter>/{model.onnx, model.onnx.data?,
input_<name>.npy, output_<name>.npy, meta.json}.
"""
import argparse
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
from torch import nn


# ---- models ---------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with configurable width."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (self.down(x) if self.down is not None else x))


class SmallResNet18(nn.Module):
    """ResNet-18's layout (2-2-2-2 basic blocks) at a quarter of the width."""

    def __init__(self, width=16, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, cout in enumerate([width, width * 2, width * 4, width * 8]):
            for j in range(2):
                blocks.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class LogitsOnly(nn.Module):
    """Wraps a transformers model so the graph has one output: the logits / hidden states."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]


def randomize_batchnorm(model):
    # Fresh BatchNorm layers are identities (mean 0, var 1); random statistics test more.
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def build(name, size):
    """Returns (module, example inputs dict, dynamic axes)."""
    torch.manual_seed(0)
    small = size == "small"
    if name == "resnet18":
        if small:
            model = SmallResNet18()
            x = torch.randn(1, 3, 64, 64)
        else:
            import torchvision
            model = torchvision.models.resnet18(weights=None)
            x = torch.randn(1, 3, 224, 224)
        return randomize_batchnorm(model).eval(), {"input": x}, {"input": {0: "batch"}}

    import transformers as tf
    seq = 16 if small else 128
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128) \
            if small else tf.GPT2Config()
        model = tf.GPT2LMHeadModel(cfg)
        vocab = cfg.vocab_size
    elif name == "bert":
        cfg = tf.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=512, vocab_size=1000) if small else tf.BertConfig()
        model = tf.BertModel(cfg, add_pooling_layer=False)
        vocab = cfg.vocab_size
    elif name == "llama":
        if small:
            cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                 max_position_embeddings=256)
        else:
            cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                 max_position_embeddings=4096)
        model = tf.LlamaForCausalLM(cfg)
        vocab = cfg.vocab_size
    else:
        raise ValueError(name)
    cfg._attn_implementation = "eager"  # export the MatMul/Softmax/MatMul pattern, not SDPA
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(2))
    return LogitsOnly(model.eval()), {"input_ids": ids}, {"input_ids": {0: "batch", 1: "seq"}}


# ---- export and check ----------------------------------------------------------------------

def export(model, inputs, dyn, path, exporter):
    args = tuple(inputs.values())
    names = list(inputs.keys())
    with torch.no_grad():
        if exporter == "legacy":
            # transformers' packed-sequence detection uses aten::diff, which the TorchScript
            # exporter cannot write at opset 17; the exported models never pack sequences.
            try:
                import transformers.masking_utils as mu
                mu.find_packed_sequence_indices = lambda *a, **k: None
            except ImportError:
                pass
            torch.onnx.export(model, args, path, dynamo=False, opset_version=17,
                              input_names=names, output_names=["output"], dynamic_axes=dyn)
        else:
            prog = torch.onnx.export(model, args, dynamo=True, input_names=names,
                                     output_names=["output"])
            prog.save(path, external_data=True)


def export_with_fallback(model, inputs, path):
    """export() with the TorchScript exporter (opset 17, what Kiln's model tests import), else
    with the dynamo one when that fails (the TorchScript exporter may be gone from a newer
    PyTorch). Returns (the exporter used, the TorchScript failure's first 300 characters or None)."""
    try:
        export(model, inputs, None, path, "legacy")
        return "legacy", None
    except Exception as e:
        legacy_error = f"{type(e).__name__}: {str(e)[:300]}"
    export(model, inputs, None, path, "dynamo")
    return "dynamo", legacy_error


def run_onnxruntime(path, inputs):
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name].numpy() for i in sess.get_inputs()}
    outs = sess.run(None, feeds)
    return feeds, {o.name: v for o, v in zip(sess.get_outputs(), outs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="all", choices=["small", "full", "all"])
    ap.add_argument("--exporters", default="legacy,dynamo")
    ap.add_argument("--models", default="resnet18,gpt2,bert,llama")
    a = ap.parse_args()
    sizes = ["small", "full"] if a.size == "all" else [a.size]
    summary = []
    for size in sizes:
        for name in a.models.split(","):
            for exporter in a.exporters.split(","):
                tag = f"{name}-{size}-{exporter}"
                d = os.path.join(a.out, tag)
                os.makedirs(d, exist_ok=True)
                t0 = time.time()
                try:
                    model, inputs, dyn = build(name, size)
                    with torch.no_grad():
                        torch_out = model(*inputs.values()).numpy()
                    path = os.path.join(d, "model.onnx")
                    export(model, inputs, dyn, path, exporter)
                    if exporter == "legacy":
                        # The TorchScript exporter's dynamic axes become symbolic dims whose
                        # shape arithmetic Kiln folds at import: record the example's sizes
                        # (tests/models/check_model.py passes them as --sym).
                        with open(os.path.join(d, "dims.txt"), "w") as f:
                            sizes = {}
                            for name, axes in dyn.items():
                                for axis, dim in axes.items():
                                    sizes[dim] = inputs[name].shape[axis]
                            f.writelines(f"{k}={v}\n" for k, v in sizes.items())
                    feeds, outs = run_onnxruntime(path, inputs)
                    for k, v in feeds.items():
                        np.save(os.path.join(d, f"input_{k}.npy"), v)
                    for k, v in outs.items():
                        np.save(os.path.join(d, f"output_{k}.npy"), v)
                    ort_out = next(iter(outs.values()))
                    diff = float(np.max(np.abs(ort_out - torch_out)))
                    meta = {"model": name, "size": size, "exporter": exporter, "ok": True,
                            "torch_vs_onnxruntime_max_abs_diff": diff,
                            "params": int(sum(p.numel() for p in model.parameters())),
                            "seconds": round(time.time() - t0, 1),
                            "files": sorted(os.listdir(d))}
                except Exception as e:  # keep going: one broken export must not hide the others
                    meta = {"model": name, "size": size, "exporter": exporter, "ok": False,
                            "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                with open(os.path.join(d, "meta.json"), "w") as f:
                    json.dump(meta, f, indent=1)
                summary.append({k: v for k, v in meta.items() if k != "trace"})
                print(json.dumps(summary[-1]), flush=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if all(m["ok"] for m in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
