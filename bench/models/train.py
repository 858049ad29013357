#!/usr/bin/env python3
"""Trains GPT-2 small and the Llama-style decoder on local text, then exports them to ONNX.

Quantization error depends on the weights: trained networks grow outlier channels and peaked
logits that random initialisations lack, so SQNR and top-1 agreement measured on random weights
say little about real models. Where pretrained checkpoints cannot be downloaded (the GPU machine
has no network), this script gives `kiln quant-report` trained weights of the same architectures
(bench/models/export.py's full-size configs): a byte-level BPE tokenizer and the model are
trained for a fixed time on the Python sources on the machine, held-out files give validation
loss and the token windows the reports run on.

    python3 bench/models/train.py --out OUT [--models gpt2,llama] [--seconds 150]

Writes OUT/<model>-trained/: model.onnx and model.onnx.data; calib/set<i>/input_ids.npy and
eval/set<i>/input_ids.npy (held-out windows); input_input_ids.npy and output_output.npy (the
first eval window and onnxruntime's logits, as export.py writes them, so the folder also suits
tests/models/check_model.py and check_quantized.py); meta.json. Needs a CUDA GPU, torch,
transformers, tokenizers, onnx, onnxscript and onnxruntime (the GPU machine has them).
bench/models/quant_accuracy.sh runs the reports.
"""
import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export as kiln_export  # noqa: E402  (build() and export() of the test models)

# Per model: training batch and sequence, peak learning rate, and the report windows.
SETTINGS = {
    "gpt2": {"batch": 64, "seq": 512, "lr": 6e-4, "eval_seq": 256, "eval_sets": 6, "calib_sets": 4},
    "llama": {"batch": 32, "seq": 512, "lr": 3e-4, "eval_seq": 128, "eval_sets": 3, "calib_sets": 3},
}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def read_corpus(dirs, max_bytes):
    """Python files under `dirs`, split into training and held-out sets by a hash of the path
    (1 file in 20 held out), at most `max_bytes` in all."""
    train, held, total = [], [], 0
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs.sort()
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                try:
                    text = open(path, encoding="utf-8").read()
                except (OSError, UnicodeDecodeError):
                    continue
                if not text.strip():
                    continue
                (held if zlib.crc32(path.encode()) % 20 == 0 else train).append(text)
                total += len(text)
                if total >= max_bytes:
                    return train, held, total
    return train, held, total


def train_tokenizer(texts, vocab, sample_bytes):
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    sample, n = [], 0
    for t in texts:
        sample.append(t)
        n += len(t)
        if n >= sample_bytes:
            break
    tok.train_from_iterator(sample, vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"])
    return tok


def encode(tok, texts):
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def windows(tokens, count, seq, seed):
    """`count` non-overlapping windows of `seq` tokens at seeded positions."""
    rng = np.random.default_rng(seed)
    slots = len(tokens) // seq
    picks = rng.choice(slots, size=min(count, slots), replace=False)
    return [tokens[p * seq:(p + 1) * seq].astype(np.int64)[None, :] for p in sorted(picks)]


def train(model, tokens, s, seconds, device):
    """AdamW in bf16 autocast for `seconds` of wall time; the learning rate warms up over 50
    steps and then follows a cosine over the time budget down to a tenth."""
    model.config._attn_implementation = "sdpa"
    model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=s["lr"], betas=(0.9, 0.95), fused=True)
    data = torch.from_numpy(tokens.astype(np.int64)).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    span = s["seq"]
    start, step, seen, losses = time.time(), 0, 0, []
    while True:
        elapsed = time.time() - start
        if elapsed >= seconds:
            break
        frac = elapsed / seconds
        lr = s["lr"] * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        at = torch.randint(0, len(data) - span - 1, (s["batch"],), device=device, generator=gen)
        x = torch.stack([data[i:i + span] for i in at.tolist()])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        if step % 25 == 0:
            losses.append(loss.item())
        if step % 200 == 0:
            log(f"  step {step} loss {losses[-1]:.3f} lr {lr:.2e} {seen / (time.time() - start):.0f} tok/s")
    return {"steps": step, "tokens": seen, "seconds": round(time.time() - start, 1),
            "final_train_loss": round(float(np.mean(losses[-8:])), 4) if losses else None}


@torch.no_grad()
def evaluate(model, tokens, s, device, count=64):
    """Validation loss and next-token top-1 accuracy over `count` held-out windows."""
    model.eval()
    total, correct, predicted = 0.0, 0, 0
    held = windows(tokens, count, s["seq"], seed=7)
    for w in held:
        x = torch.from_numpy(w).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x, use_cache=False)
        total += out.loss.item()
        correct += (out.logits[0, :-1].argmax(-1) == x[0, 1:]).sum().item()
        predicted += x.shape[1] - 1
    return {"val_loss": round(total / len(held), 4), "val_top1_accuracy": round(correct / predicted, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--seconds", type=float, default=150.0, help="training time per model")
    ap.add_argument("--corpus", action="append",
                    help="folder of .py files to train on (repeatable; default: the Python "
                         "standard library and site-packages of this interpreter)")
    ap.add_argument("--max-corpus-bytes", type=int, default=96 << 20)
    ap.add_argument("--tokenizer-sample-bytes", type=int, default=24 << 20)
    ap.add_argument("--exporter", default="dynamo", choices=["dynamo", "legacy"])
    a = ap.parse_args()
    unknown = [m for m in a.models.split(",") if m not in SETTINGS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    if not torch.cuda.is_available():
        print("train.py: no CUDA device; training needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    dirs = a.corpus or [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    log("reading corpus from", dirs)
    train_texts, held_texts, nbytes = read_corpus(dirs, a.max_corpus_bytes)
    log(f"corpus: {len(train_texts)} training files, {len(held_texts)} held out, {nbytes / 1e6:.1f} MB")
    tokenizers = {}
    for name in a.models.split(","):
        t0 = time.time()
        wrapper, example, dyn = kiln_export.build(name, "full")
        model = wrapper.model
        vocab = model.config.vocab_size
        s = SETTINGS[name]
        if vocab not in tokenizers:
            log(f"training a {vocab}-token BPE tokenizer")
            tok = train_tokenizer(train_texts, vocab, a.tokenizer_sample_bytes)
            tokenizers[vocab] = (tok, encode(tok, train_texts), encode(tok, held_texts))
            log(f"  {len(tokenizers[vocab][1])} training tokens, {len(tokenizers[vocab][2])} held out")
        tok, train_ids, held_ids = tokenizers[vocab]
        params = sum(p.numel() for p in model.parameters())
        log(f"{name}: {params / 1e6:.1f} M parameters, training {a.seconds:.0f} s")
        stats = train(model, train_ids, s, a.seconds, device)
        stats.update(evaluate(model, held_ids, s, device))
        log(f"  {stats}")

        d = os.path.join(a.out, f"{name}-trained")
        os.makedirs(d, exist_ok=True)
        sets = windows(held_ids, s["eval_sets"] + s["calib_sets"], s["eval_seq"], seed=11)
        for kind, chunk in (("eval", sets[: s["eval_sets"]]), ("calib", sets[s["eval_sets"]:])):
            for i, w in enumerate(chunk):
                os.makedirs(os.path.join(d, kind, f"set{i}"), exist_ok=True)
                np.save(os.path.join(d, kind, f"set{i}", "input_ids.npy"), w)
        model.float().cpu()
        wrapper.eval()  # the wrapper and the model it holds
        model.config._attn_implementation = "eager"  # export MatMul/Softmax/MatMul, as export.py
        ids = torch.from_numpy(sets[0])
        path = os.path.join(d, "model.onnx")
        kiln_export.export(wrapper, {"input_ids": ids}, dyn, path, a.exporter)
        if a.exporter == "legacy":
            with open(os.path.join(d, "dims.txt"), "w") as f:
                f.write(f"batch=1\nseq={ids.shape[1]}\n")
        with torch.no_grad():
            ref = wrapper(ids).numpy()
        feeds, outs = kiln_export.run_onnxruntime(path, {"input_ids": ids})
        ort_out = next(iter(outs.values()))
        # The first report window and onnxruntime's logits for it, named as export.py names
        # them, so tests/models/check_model.py and check_quantized.py take this folder too.
        for k, v in feeds.items():
            np.save(os.path.join(d, f"input_{k}.npy"), v)
        for k, v in outs.items():
            np.save(os.path.join(d, f"output_{k}.npy"), v)
        meta = {"model": name, "params": params, "vocab": vocab, "exporter": a.exporter,
                "corpus_dirs": dirs, "corpus_bytes": nbytes, "train_tokens_available": int(len(train_ids)),
                "held_out_tokens": int(len(held_ids)), "settings": s, **stats,
                "torch_vs_onnxruntime_max_abs_diff": float(np.max(np.abs(ort_out - ref))),
                "total_seconds": round(time.time() - t0, 1), "torch": torch.__version__,
                "device": torch.cuda.get_device_name()}
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        log(json.dumps(meta))
        del model, wrapper
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
