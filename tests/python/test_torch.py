"""kiln.torch against PyTorch's own outputs on the CPU: torch.export graphs converted to Kiln IR
and run on the reference and cpu backends, transformer and vision blocks as torchvision and
transformers build them, dynamic dims, partitioning around ops Kiln lacks, and
torch.compile(backend="kiln")."""
import importlib.util
import operator
import os
import sys
import unittest
import warnings

try:
    import torch
    from torch import nn
    import torch.nn.functional as F
except ImportError:
    print("SKIP: torch is not installed (scripts/setup-python.sh installs it)")
    sys.exit(77)

import kiln
import kiln.torch

SRC = os.environ.get("KILN_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(SRC, "bench", "models"))
torch.manual_seed(0)
BACKENDS = [b for b in ("reference", "cpu") if b in {p["name"] for p in kiln.plugins() if p["kind"] == "backend"}]


# ---- blocks as torchvision and transformers write them (small sizes) ------------------------

class MLP(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class GPT2Block(nn.Module):
    """GPT-2's block: pre-LayerNorm, fused QKV, causal attention, GELU (tanh) MLP."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class BertLayer(nn.Module):
    """BERT's layer: post-LayerNorm, an additive attention mask, explicit softmax attention."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, mask):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).permute(0, 2, 1, 3)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        scores = scores + (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        a = torch.softmax(scores, dim=-1) @ v
        x = self.ln1(x + self.o(a.permute(0, 2, 1, 3).reshape(b, s, d)))
        return self.ln2(x + self.out(F.gelu(self.fc(x))))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaBlock(nn.Module):
    """A Llama decoder layer: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

    def __init__(self, d=32, heads=4, kv_heads=2, seq=8):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat([ang, ang], -1).cos())
        self.register_buffer("sin", torch.cat([ang, ang], -1).sin())

    def rope(self, t):
        half = t.shape[-1] // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * self.cos + rotated * self.sin

    def forward(self, x):
        b, s, d = x.shape
        y = self.n1(x)
        q = self.rope(self.q(y).view(b, s, self.h, self.hd).transpose(1, 2))
        k = self.rope(self.k(y).view(b, s, self.kv, self.hd).transpose(1, 2))
        v = self.v(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        rep = self.h // self.kv
        k = k[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.h, s, self.hd)
        v = v[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.h, s, self.hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class ConvBlock(nn.Module):
    """torchvision's conv stem and a basic block's pieces: conv, batch norm, ReLU, pooling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.fc = nn.Linear(8, 5)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        y = F.avg_pool2d(F.hardtanh(self.conv2(y)), 2)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


class GPT2Style(nn.Module):
    """GPT-2 as transformers writes it: position ids and the padding-aware causal mask are
    computed inside forward from an all-ones attention mask (cumsum, arange comparisons,
    index): tensors from constants only, which Kiln must not hand to PyTorch as NumPy."""

    def __init__(self, vocab=50, d=32, heads=4, max_pos=16):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_pos, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, ids):
        b, s = ids.shape
        d = self.wte.embedding_dim
        attention_mask = torch.ones(b, s, dtype=torch.long, device=ids.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.wte(ids) + self.wpe(position_ids)
        pos = torch.arange(s, device=ids.device)
        keep = (pos[None, :] <= pos[:, None])[None, None] & attention_mask[:, None, None, :].bool()
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return self.ln_f(x)


class BertStyle(nn.Module):
    """BERT's embeddings as transformers writes them (position ids sliced from a buffer, token
    type ids gathered from a buffer) and a layer with the mask of an unpadded batch."""

    def __init__(self, vocab=50, d=32, max_pos=16, types=2):
        super().__init__()
        self.word, self.pos, self.token_type = nn.Embedding(vocab, d), nn.Embedding(max_pos, d), nn.Embedding(types, d)
        self.norm = nn.LayerNorm(d, eps=1e-12)
        self.register_buffer("position_ids", torch.arange(max_pos).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, max_pos, dtype=torch.long), persistent=False)
        self.layer = BertLayer(d)

    def forward(self, ids):
        b, s = ids.shape
        position_ids = self.position_ids[:, :s]
        token_type_ids = torch.gather(self.token_type_ids.expand(position_ids.shape[0], -1), 1, position_ids)
        token_type_ids = token_type_ids.expand(b, s)
        x = self.norm(self.word(ids) + self.token_type(token_type_ids) + self.pos(position_ids))
        return self.layer(x, torch.ones(b, s, dtype=torch.long, device=ids.device))


class BertSdpaStyle(nn.Module):
    """BERT's encoder as transformers writes it for SDPA: the mask of an unpadded batch built
    from positions as [1, 1, S, 1] and expanded to [B, 1, S, S] (last stride 0), given to
    F.scaled_dot_product_attention in every layer. On CUDA that stride sends SDPA to its math
    form (PyTorch's fused kernels need the mask's last stride to be 1), whose safe softmax
    (any, full_like) once left two ops per layer in PyTorch: BERT-base ran as 13 Kiln parts."""

    def __init__(self, vocab=50, d=32, heads=4, layers=3):
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d), "fc": nn.Linear(d, 2 * d), "out": nn.Linear(2 * d, d),
            "ln1": nn.LayerNorm(d, eps=1e-12), "ln2": nn.LayerNorm(d, eps=1e-12)}) for _ in range(layers))

    def forward(self, ids):
        b, s = ids.shape
        keep = (torch.arange(s, device=ids.device) >= 0)[None, None, :, None].expand(b, 1, s, s)
        x = self.norm(self.word(ids))
        d = x.shape[-1]
        for layer in self.layers:
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                       for t in layer["qkv"](x).split(d, dim=2))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            x = layer["ln1"](x + layer["o"](a.transpose(1, 2).reshape(b, s, d)))
            x = layer["ln2"](x + layer["out"](F.gelu(layer["fc"](x))))
        return x


def small_resnet18():
    from export import SmallResNet18, randomize_batchnorm  # bench/models/export.py

    model = SmallResNet18(width=8, classes=10)
    randomize_batchnorm(model)
    return model.eval()


def check(test, module, inputs, backends=None, rtol=1e-4, atol=1e-4, **kw):
    """Compiles `module` with kiln.torch on each backend and compares with eager PyTorch."""
    module = module.eval()
    with torch.no_grad():
        want = module(*inputs)
    for backend in backends or BACKENDS:
        with test.subTest(backend=backend):
            compiled = kiln.torch.compile_module(module, inputs, backend=backend, **kw)
            got = compiled(*inputs)
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return compiled


class Blocks(unittest.TestCase):
    def test_mlp_is_one_kiln_graph(self):
        x = torch.randn(2, 5, 32)
        compiled = check(self, MLP(), (x,), rtol=1.3e-6 * 10, atol=1e-5)
        self.assertEqual(len(compiled.kiln_parts()), 1)
        g = compiled.kiln_parts()[0].graph_
        self.assertIn("layer_norm", g.ops())
        self.assertIn("gelu", g.ops())

    def test_gpt2_block(self):
        compiled = check(self, GPT2Block(), (torch.randn(2, 8, 32),))
        self.assertEqual(len(compiled.kiln_parts()), 1)
        self.assertIn("attention", compiled.kiln_parts()[0].graph_.ops())

    def test_bert_layer_with_mask(self):
        mask = torch.ones(2, 8, dtype=torch.int64)
        mask[1, 5:] = 0
        check(self, BertLayer(), (torch.randn(2, 8, 32), mask))

    def test_llama_block(self):
        compiled = check(self, LlamaBlock(), (torch.randn(2, 8, 32),))
        self.assertEqual(len(compiled.kiln_parts()), 1)

    def test_conv_block(self):
        compiled = check(self, ConvBlock(), (torch.randn(2, 3, 16, 16),))
        self.assertNotIn("batch_norm", compiled.kiln_parts()[0].graph_.ops(), "folded into the conv's weights")

    def test_small_resnet18(self):
        compiled = check(self, small_resnet18(), (torch.randn(2, 3, 32, 32),),
                         backends=["cpu"] if "cpu" in BACKENDS else None)
        ops = compiled.kiln_parts()[0].graph_.ops()
        self.assertEqual((ops.count("conv"), ops.count("batch_norm")), (20, 0))

    def test_batch_norms_that_cannot_fold(self):
        class SharedConv(nn.Module):
            """A conv read by its batch norm and by an add; a batch norm after a pool."""

            def __init__(self):
                super().__init__()
                self.conv, self.bn, self.bn2 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)
                for bn in (self.bn, self.bn2):
                    with torch.no_grad():
                        bn.running_mean.uniform_(-0.5, 0.5)
                        bn.running_var.uniform_(0.5, 1.5)
                        bn.weight.uniform_(0.5, 1.5)

            def forward(self, x):
                y = self.conv(x)
                return self.bn2(F.avg_pool2d(self.bn(y) + y, 2))

        compiled = check(self, SharedConv(), (torch.randn(2, 3, 8, 8),))
        self.assertEqual(compiled.kiln_parts()[0].graph_.ops().count("batch_norm"), 2)
        torch._dynamo.reset()
        module, x = SharedConv().eval(), torch.randn(2, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(module, backend="kiln")(x), module(x), rtol=1e-4, atol=1e-4)

    def test_weights_are_shared_not_copied(self):
        mlp = MLP().eval()
        g = kiln.torch.export_graph(mlp, (torch.randn(1, 3, 32),))
        self.assertEqual([i["name"] for i in g.inputs], ["x"])
        self.assertTrue("%fc1.weight = constant" in str(g), "the constants are named after the parameters")


def computed_ops(gm):
    """The ATen ops PyTorch still runs in a partitioned graph (outside Kiln's parts)."""
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem}


class ConstantParts(unittest.TestCase):
    """Tensors computed from constants only (position ids, masks) fold into constants: no part
    of the graph is left without inputs (such a part once returned NumPy arrays to PyTorch's
    cumsum and gather on the GPU path)."""

    def check_model(self, module, ids):
        compiled = check(self, module, (ids,))
        parts = compiled.kiln_parts()
        self.assertEqual(len(parts), 1, compiled.graph_module.graph)
        self.assertEqual(computed_ops(compiled.graph_module), set(), "everything but the part folded")
        self.assertTrue(all(p.tensor_inputs for p in parts))
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(module, backend="kiln", options={"backend": BACKENDS[-1]})(ids)
            torch.testing.assert_close(got, module(ids), rtol=1e-4, atol=1e-4)
        self.assertEqual(len(kiln.torch.kiln_backend.last_parts), 1)
        self.assertTrue(all(p.tensor_inputs for p in kiln.torch.kiln_backend.last_parts))

    def test_gpt2_position_ids_from_cumsum(self):
        self.check_model(GPT2Style(), torch.randint(0, 50, (2, 12)))

    def test_bert_token_types_from_gather(self):
        self.check_model(BertStyle(), torch.randint(0, 50, (2, 12)))

    def test_results_too_large_to_fold_stay_in_pytorch(self):
        # Nothing folds: the constant-only part of the mask runs in PyTorch, never in a Kiln part
        # without inputs.
        saved = kiln.torch._FOLD_GROWTH_BYTES
        kiln.torch._FOLD_GROWTH_BYTES = -(1 << 40)
        try:
            module = GPT2Style().eval()
            ids = torch.randint(0, 50, (2, 12))
            compiled = check(self, module, (ids,), backends=BACKENDS[-1:])
        finally:
            kiln.torch._FOLD_GROWTH_BYTES = saved
        self.assertIn("aten.cumsum.default", computed_ops(compiled.graph_module))
        self.assertTrue(compiled.kiln_parts())
        self.assertTrue(all(p.tensor_inputs for p in compiled.kiln_parts()))

    def test_a_constant_output_is_not_shared_between_calls(self):
        class Positions(nn.Module):
            def forward(self, x):
                return x + 1, torch.arange(4) * 2

        x = torch.randn(4)
        compiled = kiln.torch.compile_module(Positions(), (x,), backend=BACKENDS[-1])
        first = compiled(x)[1]
        first.add_(100)  # the caller owns what it is returned
        torch.testing.assert_close(compiled(x)[1], torch.arange(4) * 2)


@unittest.skipUnless(importlib.util.find_spec("transformers"), "transformers is not installed")
class Transformers(unittest.TestCase):
    """transformers' own GPT-2 and BERT (tiny configurations) through torch.compile(backend="kiln")."""

    def run_model(self, model, ids):
        """One Kiln part matching eager, with PyTorch's SDPA picking its kernel and forced to
        the math form (what CUDA runs for some masks)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        model = model.eval()
        for math in (False, True):
            torch._dynamo.reset()
            with self.subTest(math_attention=math), torch.no_grad(), \
                    sdpa_kernel([SDPBackend.MATH] if math else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
                want = model(input_ids=ids, use_cache=False).last_hidden_state
                compiled = torch.compile(model, backend="kiln", options={"backend": BACKENDS[-1]})
                got = compiled(input_ids=ids, use_cache=False).last_hidden_state
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                parts = kiln.torch.kiln_backend.last_parts
                self.assertEqual(len(parts), 1, kiln.torch.kiln_backend.last_left_in_pytorch)
                self.assertEqual(kiln.torch.kiln_backend.last_left_in_pytorch, {})
                self.assertTrue(parts[0].tensor_inputs)

    def test_gpt2(self):
        import transformers as tf

        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        self.run_model(tf.GPT2Model(cfg), torch.randint(0, 100, (2, 12)))

    def test_bert(self):
        import transformers as tf

        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                            vocab_size=100, max_position_embeddings=32)
        torch.manual_seed(0)
        self.run_model(tf.BertModel(cfg), torch.randint(0, 100, (2, 12)))


class BertParts(unittest.TestCase):
    """BERT-style encoders are one Kiln part, whichever attention PyTorch records."""

    def setUp(self):
        torch._dynamo.reset()

    def compile(self, module, ids, backends):
        from torch.nn.attention import sdpa_kernel

        with torch.no_grad(), sdpa_kernel(backends):
            want = module(ids)
            got = torch.compile(module, backend="kiln", options={"backend": BACKENDS[-1]})(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        parts = kiln.torch.kiln_backend.last_parts
        self.assertEqual(len(parts), 1, kiln.torch.kiln_backend.last_left_in_pytorch)
        self.assertEqual(kiln.torch.kiln_backend.last_left_in_pytorch, {})
        return parts[0].graph_.ops()

    def test_math_attention_with_a_mask_is_one_part(self):
        from torch.nn.attention import SDPBackend

        ops = self.compile(BertSdpaStyle().eval(), torch.randint(0, 50, (2, 12)), [SDPBackend.MATH])
        self.assertIn("softmax", ops)
        self.assertIn("reduce_max", ops)  # the safe softmax's test for rows that see no key

    def test_fused_attention_is_one_part_and_one_op(self):
        from torch.nn.attention import SDPBackend

        ops = self.compile(BertSdpaStyle().eval(), torch.randint(0, 50, (2, 12)), [SDPBackend.FLASH_ATTENTION])
        self.assertEqual(ops.count("attention"), 3)

    def test_strided_masks_are_made_contiguous_for_sdpa(self):
        counts = []

        def capture(gm, example_inputs):
            counts.append(kiln.torch._contiguous_attention_masks(gm))
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target in kiln.torch._SDPA_FUNCTIONS:
                    mask = node.kwargs["attn_mask"]
                    self.assertEqual(mask.op, "call_method")
                    self.assertEqual(mask.target, "contiguous")
            return gm.forward

        module = BertSdpaStyle().eval()
        ids = torch.randint(0, 50, (2, 12))
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(module, backend=capture)(ids), module(ids))
        self.assertEqual(counts, [3])

    def test_compile_module(self):
        compiled = check(self, BertSdpaStyle(), (torch.randint(0, 50, (2, 12)),))
        self.assertEqual(len(compiled.kiln_parts()), 1)
        self.assertEqual(compiled.left_in_pytorch(), {})

    def test_what_stays_in_pytorch_is_reported(self):
        compiled = check(self, WithTopK(), (torch.randn(3, 16),), backends=BACKENDS[-1:])
        self.assertEqual(compiled.left_in_pytorch(), {"aten.topk.default: no Kiln lowering": 1})


class DynamicDims(unittest.TestCase):
    def test_batch_and_sequence_are_symbols(self):
        batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=64)
        mlp = MLP().eval()
        compiled = kiln.torch.compile_module(mlp, (torch.randn(2, 5, 32),),
                                             dynamic_shapes=({0: batch, 1: seq},), backend=BACKENDS[-1])
        (part,) = compiled.kiln_parts()
        shape = part.graph_.inputs[0]["shape"]
        self.assertTrue(isinstance(shape[0], str) and isinstance(shape[1], str), shape)
        for b, s in [(1, 3), (4, 7), (3, 16)]:
            x = torch.randn(b, s, 32)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-5, atol=1e-5)

    def test_dynamic_gpt2_block(self):
        block = GPT2Block().eval()
        compiled = kiln.torch.compile_module(block, (torch.randn(2, 8, 32),),
                                             dynamic_shapes=({0: torch.export.Dim("batch", max=16)},),
                                             backend=BACKENDS[-1])
        for b in (1, 3):
            x = torch.randn(b, 8, 32)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), block(x), rtol=1e-4, atol=1e-4)


class Overloads(unittest.TestCase):
    def test_attention_overloads_of_aot_autograd(self):
        # torch.compile's graphs hold the device-specific attention overloads, not SDPA itself.
        from torch.fx.experimental.proxy_tensor import make_fx

        q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
        mask = torch.randn(8, 8)
        cases = [
            (lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0], (q, k, v),
             F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            (lambda q, k, v, m: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=m, scale=0.3)[0],
             (q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)),
            # CUDA's, for a float mask: expanded to [B, H, Sq, Skv] first, as SDPA does.
            (lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(q, k, v, m.expand(2, 4, 8, 8), False,
                                                                             scale=0.3)[0],
             (q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)),
            # ... padded to a multiple of 16 and sliced back when its last dim is not one.
            (lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(
                q, k, v, F.pad(m.expand(2, 4, 8, 8), (0, 8), value=-1.0)[..., :8], False, scale=0.3)[0],
             (q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)),
        ]
        for fn, inputs, want in cases:
            gm = make_fx(fn, tracing_mode="fake")(*inputs)
            g = kiln.torch.convert(gm)
            self.assertIn("attention", g.ops())
            for backend in BACKENDS:
                (got,) = kiln.compile(g, backend=backend).run(list(inputs))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


aten = torch.ops.aten


class WithTopK(nn.Module):
    """An op Kiln does not lower (topk) between two it does."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(4, 3)

    def forward(self, x):
        values, _ = torch.topk(torch.relu(self.fc1(x)), 4, dim=-1)
        return self.fc2(values).sigmoid()


class Partitioning(unittest.TestCase):
    def test_unsupported_ops_stay_in_pytorch(self):
        compiled = check(self, WithTopK(), (torch.randn(3, 16),))
        self.assertEqual(len(compiled.kiln_parts()), 2)
        targets = {str(n.target) for n in compiled.graph_module.graph.nodes if n.op == "call_function"}
        self.assertIn("aten.topk.default", targets)

    def test_a_model_kiln_cannot_take_at_all_still_runs(self):
        class Sort(nn.Module):
            def forward(self, x):
                return torch.sort(x, dim=-1).values

        x = torch.randn(4, 6)
        compiled = kiln.torch.compile_module(Sort(), (x,), backend=BACKENDS[0])
        self.assertEqual(compiled.kiln_parts(), [])
        torch.testing.assert_close(compiled(x), torch.sort(x, dim=-1).values)

    def test_export_graph_names_the_missing_op(self):
        with self.assertRaisesRegex(kiln.KilnError, "topk"):
            kiln.torch.export_graph(WithTopK(), (torch.randn(3, 16),))


class ImportOrder(unittest.TestCase):
    def test_kiln_before_torch(self):
        # Kiln's runtime and PyTorch link libnccl.so.2; the package loads PyTorch's first.
        import subprocess

        r = subprocess.run([sys.executable, "-c", "import kiln, torch; print(torch.ones(1).item())"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])


class TorchCompile(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_backend_matches_eager(self):
        for module, inputs in [(MLP(), (torch.randn(2, 5, 32),)), (GPT2Block(), (torch.randn(1, 8, 32),)),
                               (WithTopK(), (torch.randn(3, 16),))]:
            module = module.eval()
            with self.subTest(module=type(module).__name__), torch.no_grad():
                compiled = torch.compile(module, backend="kiln")
                torch.testing.assert_close(compiled(*inputs), module(*inputs), rtol=1e-4, atol=1e-4)
                ops = [op for part in kiln.torch.kiln_backend.last_parts for op in part.graph_.ops()]
                self.assertIn("linear", ops)
                if isinstance(module, GPT2Block):
                    self.assertIn("attention", ops)

    def test_backend_options_pick_the_kiln_backend(self):
        mlp = MLP().eval()
        x = torch.randn(2, 3, 32)
        with torch.no_grad():
            compiled = torch.compile(mlp, backend="kiln", options={"backend": "reference"})
            torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-5, atol=1e-5)

    def test_a_backend_that_refuses_leaves_the_graph_to_pytorch(self):
        mlp = MLP().eval()
        x = torch.randn(2, 3, 32)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            y = torch.compile(mlp, backend="kiln", options={"backend": "null"})(x)
            torch.testing.assert_close(y, mlp(x))
        self.assertTrue(any("stays in PyTorch" in str(w.message) for w in caught))
        self.assertEqual(kiln.torch.kiln_backend.last_parts, [])
        with self.assertRaisesRegex(Exception, "unknown option 'backnd'"):
            torch.compile(mlp, backend="kiln", options={"backnd": "cpu"})(x)

    def test_aot_wrapper_left_out_only_where_it_passes_through(self):
        # Dynamo calls Kiln's forward directly when AOTAutograd's runtime wrapper would only pass
        # arguments through; a graph that mutates an input or returns an alias keeps the wrapper,
        # which copies the mutation back and rebuilds the alias.
        class Mutates(nn.Module):
            def forward(self, x):
                x.mul_(2)
                return torch.relu(x) + 1

        class Aliases(nn.Module):
            def forward(self, x):
                return x, x.view(-1), torch.relu(x) * 3

        mlp, x = MLP().eval(), torch.randn(2, 3, 32)
        with torch.no_grad():
            compiled = torch.compile(mlp, backend="kiln")
            for _ in range(3):
                torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-4, atol=1e-4)
            self.assertTrue(kiln.torch.kiln_backend.last_called_directly)

            torch._dynamo.reset()
            x = torch.randn(4, 8)
            x_eager = x.clone()
            want = Mutates()(x_eager)
            got = torch.compile(Mutates(), backend="kiln")(x)
            self.assertFalse(kiln.torch.kiln_backend.last_called_directly)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(x, x_eager)  # the input's mutation happened

            torch._dynamo.reset()
            got = torch.compile(Aliases(), backend="kiln")(x)
            self.assertFalse(kiln.torch.kiln_backend.last_called_directly)
            for g, w in zip(got, Aliases()(x)):
                torch.testing.assert_close(g, w)
            self.assertEqual(got[1].data_ptr(), x.data_ptr())  # a view of the input, as in eager

            torch._dynamo.reset()
            with torch.autocast("cpu", dtype=torch.bfloat16):  # the wrapper switches autocast off
                torch.testing.assert_close(torch.compile(mlp, backend="kiln")(x.view(1, 4, 8).repeat(1, 1, 4)),
                                           mlp(x.view(1, 4, 8).repeat(1, 1, 4)), rtol=2e-2, atol=2e-2)
            self.assertFalse(kiln.torch.kiln_backend.last_called_directly)

        torch._dynamo.reset()
        with torch.enable_grad():  # gradients on: the wrapper stays (it sets what outputs require)
            torch.testing.assert_close(torch.compile(mlp.requires_grad_(False), backend="kiln")(x.view(1, 4, 8).repeat(1, 1, 4)),
                                       mlp(x.view(1, 4, 8).repeat(1, 1, 4)), rtol=1e-4, atol=1e-4)
        self.assertFalse(kiln.torch.kiln_backend.last_called_directly)

    def test_changed_weights_are_seen_by_the_next_call(self):
        # Kiln freezes the weights into its parts; a weight written in place, swapped for another
        # tensor or moved to other memory since is seen on the next call (the parts are rebuilt
        # from the new weights), on the direct path and through AOTAutograd's wrapper alike.
        class MutatesInput(nn.Module):  # keeps AOTAutograd's wrapper (it copies the mutation back)
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 4)

            def forward(self, x):
                x.mul_(2)
                return self.fc(x)

        for module, direct in [(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), True),
                               (MutatesInput(), False)]:
            torch._dynamo.reset()
            module = module.eval()
            first, last = module[0] if direct else module.fc, module[2] if direct else module.fc
            x = torch.randn(3, 8)
            with self.subTest(direct=direct), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = torch.compile(module, backend="kiln")

                def same():
                    want = module(x.clone())
                    torch.testing.assert_close(compiled(x.clone()), want, rtol=1e-5, atol=1e-5)

                same()
                self.assertEqual(kiln.torch.kiln_backend.last_called_directly, direct)
                parts = kiln.torch.kiln_backend.last_parts
                self.assertEqual(len(parts), 1)
                first.weight.add_(1.0)  # in place
                same()
                self.assertIsNot(kiln.torch.kiln_backend.last_parts[0], parts[0], "the part was rebuilt")
                parts = kiln.torch.kiln_backend.last_parts
                same()  # unchanged since: no rebuild
                self.assertIs(kiln.torch.kiln_backend.last_parts[0], parts[0])
                last.bias = nn.Parameter(torch.randn(4))  # another tensor of the same shape
                same()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    first.weight.data = torch.randn(first.weight.shape)  # other memory
                    same()
                    last.weight.zero_()
                    same()
                self.assertTrue(any("runs in PyTorch from now on" in str(w.message) for w in caught),
                                "weights changed on every call: PyTorch runs the graph")
                first.bias.add_(3.0)
                same()

    def test_guards_still_recompile(self):
        # Kiln's own checks come on top of dynamo's guards: inputs of other shapes or dtypes and a
        # parameter of another shape still compile a new graph, which then gives the right result.
        from torch._dynamo.utils import counters

        module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
        counters.clear()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(module, backend="kiln", dynamic=False)

            def graphs():
                return counters["stats"]["unique_graphs"]

            x = torch.randn(3, 8)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
            self.assertEqual(graphs(), 1)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
            self.assertEqual(graphs(), 1, "nothing changed: no recompile")
            y = torch.randn(5, 8)
            torch.testing.assert_close(compiled(y), module(y), rtol=1e-5, atol=1e-5)
            self.assertEqual(graphs(), 2)
            module.double()  # parameters and inputs of another dtype
            torch.testing.assert_close(compiled(x.double()), module(x.double()), rtol=1e-9, atol=1e-9)
            self.assertEqual(graphs(), 3)
            module.float()
            module[2] = nn.Linear(16, 6)  # another layer: a parameter of another shape
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
            self.assertEqual(compiled(x).shape, (3, 6))
            self.assertGreaterEqual(graphs(), 4)

    def test_graphs_needing_gradients_stay_in_pytorch(self):
        mlp = MLP()
        x = torch.randn(2, 3, 32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = torch.compile(mlp, backend="kiln")(x)
        y.sum().backward()
        self.assertIsNotNone(mlp.fc1.weight.grad)
        self.assertTrue(any("gradients" in str(w.message) for w in caught))


class CallPaths(unittest.TestCase):
    """The per-call paths of compile_module's module: tensors in and out without pytree, other
    structures through it; host tensors of every dtype and layout reaching Kiln."""

    def test_outputs_and_arguments_of_every_structure(self):
        class Structured(nn.Module):
            def forward(self, x, y):
                return {"sum": x + y, "pair": (x * y, torch.relu(x))}

        class Single(nn.Module):
            def forward(self, x):
                return torch.sigmoid(x) * 2

        x, y = torch.randn(3, 4), torch.randn(3, 4)
        compiled = kiln.torch.compile_module(Structured(), (x, y), backend=BACKENDS[-1])
        torch.testing.assert_close(compiled(x, y), Structured()(x, y))
        for wrong in ((x,), (x, [y]), (x, y, x)):
            with self.assertRaisesRegex(kiln.KilnError, "another structure"):
                compiled(*wrong)
        single = kiln.torch.compile_module(Single(), (x,), backend=BACKENDS[-1])
        torch.testing.assert_close(single(x), Single()(x))
        self.assertIsInstance(single(x), torch.Tensor)

    def test_a_whole_model_part_is_called_directly(self):
        # Kiln took the whole graph: its part is called without FX's code (a faster call), with
        # the graph's inputs and outputs in their order.
        class Three(nn.Module):
            def forward(self, x, y):
                return y - x, torch.relu(y) * x, x + 1

        x, y = torch.randn(3, 4), torch.randn(3, 4)
        fast = kiln.torch.compile_module(Three(), (x, y), backend=BACKENDS[-1])
        self.assertIsNotNone(fast._direct)
        for got, want in zip(fast(x, y), Three()(x, y)):
            torch.testing.assert_close(got, want)
        self.assertIsNone(kiln.torch.compile_module(WithTopK(), (torch.randn(3, 16),), backend=BACKENDS[-1])._direct)
        torch._dynamo.reset()
        with torch.no_grad():
            for got, want in zip(torch.compile(Three(), backend="kiln", options={"backend": BACKENDS[-1]})(x, y),
                                 Three()(x, y)):
                torch.testing.assert_close(got, want)

    def test_compile_modules_weights_changed_in_place_are_seen(self):
        # compile_module's module checks on every call that the weights it froze are unwritten
        # and where they were; a change compiles the module again (twice at most; then PyTorch
        # runs the module itself).
        mlp = MLP().eval()
        x = torch.randn(2, 3, 32)
        fast = kiln.torch.compile_module(mlp, (x,), backend=BACKENDS[-1])

        def same():
            with torch.no_grad():
                torch.testing.assert_close(fast(x), mlp(x), rtol=1e-5, atol=1e-5)

        same()
        parts = fast.kiln_parts()
        with torch.no_grad():
            mlp.fc1.weight.mul_(2.0)  # in place
        same()
        self.assertIsNot(fast.kiln_parts()[0], parts[0], "compiled again")
        mlp.load_state_dict({k: torch.randn_like(v) for k, v in mlp.state_dict().items()})  # copies in place
        same()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mlp.fc2.bias.data = torch.randn_like(mlp.fc2.bias)  # other memory
            same()
        self.assertTrue(any("PyTorch runs it from now on" in str(w.message) for w in caught))
        with torch.no_grad():
            mlp.fc2.weight.zero_()
        same()

    def test_host_tensors_of_every_dtype_and_layout(self):
        class Mix(nn.Module):
            def forward(self, a, b, i, m):
                return (a * 2, (b.float() + i.float()).to(torch.bfloat16), torch.where(m, a, -a))

        a = torch.randn(4, 6).t()  # not contiguous
        b = torch.randn(6, 4).to(torch.bfloat16)  # no NumPy dtype: DLPack
        i = torch.arange(24).reshape(6, 4)
        m = torch.rand(6, 4) > 0.5
        compiled = kiln.torch.compile_module(Mix(), (a, b, i, m), backend=BACKENDS[-1])
        want = Mix()(a, b, i, m)
        torch.testing.assert_close(compiled(a, b, i, m), want)
        leaf = a.clone().requires_grad_()
        torch.testing.assert_close(compiled(leaf, b, i, m)[0], want[0])


class TorchFastPath(unittest.TestCase):
    """Dense host torch tensors of a model's types go in and out of Model.run in C++ (_run_torch),
    zero-copy; anything else takes the general path, and both raise the same errors."""

    class NoGeneralPath:
        """A model's implementation whose general path fails: shows the fast path was taken."""

        def __init__(self, impl):
            self.impl, self.inputs = impl, impl.inputs

        def _run_torch(self, xs):
            return self.impl._run_torch(xs)

        def _run(self, *args):
            raise AssertionError("the general path was taken")

    def model(self):
        g = kiln.Graph("mix")
        x = g.add_input("x", "f32", [2, 3])
        w = g.add_input("w", "bf16", [3])
        i = g.add_input("i", "i64", [4])
        m = g.add_input("m", "bool", [4])
        g.set_outputs([g.add_node("relu", [x])[0], x, g.add_node("neg", [w])[0], i, m], ["y", "x2", "nw", "i2", "m2"])
        return kiln.compile(g, backend=BACKENDS[-1], passes="")

    def test_dense_host_tensors_take_the_fast_path(self):
        model = self.model()
        impl = model._impl
        model._impl = self.NoGeneralPath(impl)
        x = nn.Parameter(torch.randn(2, 3))  # needs gradients: read without detaching
        w = torch.randn(3).to(torch.bfloat16)
        i, m = torch.arange(4), torch.tensor([True, False, True, True])
        y, x2, nw, i2, m2 = model.run([x, w, i, m])
        torch.testing.assert_close(y, torch.relu(x.detach()))
        torch.testing.assert_close(nw, -w)
        self.assertTrue(torch.equal(i2, i) and torch.equal(m2, m) and torch.equal(x2, x.detach()))
        self.assertFalse(y.requires_grad)
        self.assertEqual((nw.dtype, i2.dtype, m2.dtype), (torch.bfloat16, torch.int64, torch.bool))
        # An output that is an input is a copy: the caller may write either.
        self.assertNotEqual(x2.data_ptr(), x.data_ptr())
        x2 += 1
        self.assertFalse(torch.equal(x2, x.detach()))
        (y_by_name, *_) = model.run({"x": x, "w": w, "i": i, "m": m})
        torch.testing.assert_close(y_by_name, y)
        # Others take the general path: not contiguous (copied there), or a NumPy array.
        with self.assertRaisesRegex(AssertionError, "general path"):
            model.run([x.detach().t().contiguous().t(), w, i, m])
        with self.assertRaisesRegex(AssertionError, "general path"):
            model.run([x.detach().numpy(), w, i, m])
        model._impl = impl
        torch.testing.assert_close(model.run([torch.randn(3, 2).t(), w, i, m])[2], -w)

    def test_errors_match_the_general_path(self):
        model = self.model()
        w, i, m = torch.randn(3).to(torch.bfloat16), torch.arange(4), torch.ones(4, dtype=torch.bool)
        for bad in (torch.randn(2, 4), torch.randn(2, 3, dtype=torch.float64)):
            with self.assertRaises(kiln.KilnError) as fast:
                model.run([bad, w, i, m])
            with self.assertRaises(kiln.KilnError) as general:
                model.run([bad.numpy(), w, i, m])
            self.assertEqual(str(fast.exception), str(general.exception))
            self.assertIn("input 'x'", str(fast.exception))
        with self.assertRaisesRegex(kiln.KilnError, "takes 4 inputs, got 1"):
            model.run([torch.randn(2, 3)])


class GpuPipeline(unittest.TestCase):
    """The pipeline GPU targets compile with when none is given (checked without a GPU: NVRTC
    builds sm_90a kernels here): the shipped CUDA pipelines' passes, TF32 as PyTorch's flags say."""

    def setUp(self):
        self.saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
                      torch.get_float32_matmul_precision())

    def tearDown(self):
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved[:2]
        torch.set_float32_matmul_precision(self.saved[2])

    def test_passes_are_those_of_the_shipped_cuda_pipelines(self):
        for name in ("cuda-sm90.toml", "cuda-sm90-tf32.toml"):
            shipped = kiln.Pipeline.from_toml(os.path.join(SRC, "examples", "pipelines", name))
            self.assertEqual(tuple(shipped.passes), kiln.torch.GPU_PASSES, name)
        p = kiln.torch.gpu_pipeline(["sm_90a"])
        self.assertEqual(tuple(p.passes), kiln.torch.GPU_PASSES)
        self.assertEqual((p.backend, p.targets), ("cuda-sm90", ["sm_90a"]))
        self.assertEqual(kiln.torch.gpu_pipeline(["sm_80"]).backend, "cuda-sm80")

    def test_tf32_follows_pytorchs_flags(self):
        def backend():  # the canonical form leaves out options at their defaults (false)
            return kiln.torch.gpu_pipeline(["sm_90a"]).canonical.rsplit("| ", 1)[1]

        torch.backends.cudnn.allow_tf32 = True  # PyTorch's defaults: TF32 convolutions, IEEE matmuls
        torch.set_float32_matmul_precision("highest")
        self.assertEqual(backend(), "cuda-sm90{allow-tf32-conv=true}@sm_90a")
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = False
        self.assertEqual(backend(), "cuda-sm90{allow-tf32-matmul=true}@sm_90a")
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        self.assertEqual(backend(), "cuda-sm90{allow-tf32-conv=true,allow-tf32-matmul=true}@sm_90a")

    def test_a_conv_block_artifact_for_sm90a(self):
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")
        compiled = kiln.torch.compile_module(ConvBlock(), (torch.randn(2, 3, 16, 16),), targets=["sm_90a"])
        (part,) = compiled.kiln_parts()
        self.assertIn("layout-nhwc", part.pipeline.canonical)
        recorded = part.build_artifact().inspect()["meta"]["pipeline"]
        self.assertEqual(recorded, "python " + part.pipeline.canonical)
        self.assertTrue(recorded.endswith("| cuda-sm90{allow-tf32-conv=true}@sm_90a"), recorded)
        with self.assertRaisesRegex(kiln.KilnError, "no backend builds target 'sm_12'"):
            kiln.torch.gpu_pipeline(["sm_12"])

    def test_a_given_pipeline_or_pass_list_is_kept(self):
        module, x = MLP().eval(), torch.randn(2, 3, 32)
        (part,) = kiln.torch.compile_module(module, (x,), targets=["sm_90a"], passes="cse,dce").kiln_parts()
        self.assertEqual(part.pipeline.passes, ["cse", "dce"])
        self.assertEqual(part.pipeline.backend, "cuda-sm90")
        given = kiln.Pipeline.from_toml(os.path.join(SRC, "examples", "pipelines", "cuda-sm90-tf32.toml"))
        (part,) = kiln.torch.compile_module(module, (x,), targets=["sm_90a"], pipeline=given).kiln_parts()
        self.assertEqual(part.pipeline, given)


class CausalSdpa(nn.Module):
    """A GPT-2 layer's attention as transformers' SDPA path writes it under torch.compile: the
    causal mask is built as a tensor (no is_causal) and given to scaled_dot_product_attention."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        pos = torch.arange(s, device=x.device)
        mask = torch.zeros(s, s, device=x.device).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).split(d, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
        return self.proj(a.transpose(1, 2).reshape(b, s, d))


class SeparateQkv(nn.Module):
    """BERT's self-attention projections: three nn.Linear of one activation, with biases."""

    def __init__(self, d=64, heads=4, zero_bias=False):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        if zero_bias:  # as transformers initializes them
            for lin in (self.q, self.k, self.v):
                nn.init.zeros_(lin.bias)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)


def plan_of(artifact):
    """The steps of an artifact's plan, each as its words (`step` left out)."""
    data = artifact.to_bytes()
    (plan,) = [s for s in artifact.inspect()["sections"] if s["kind"] == "plan"]
    text = data[plan["offset"]:plan["offset"] + plan["size"]].decode()
    return [line.split()[1:] for line in text.splitlines() if line.startswith("step ")]


def plan_summary(steps):
    """(steps by kind, GEMM shapes, buffers the kernel launches read and write) of a plan."""
    kinds, gemms, launch_buffers = {}, [], 0
    for step in steps:
        kinds[step[0]] = kinds.get(step[0], 0) + 1
        attrs = dict(w.split("=", 1) for w in step[1:] if "=" in w)
        if step[0] == "gemm":
            gemms.append(tuple(attrs[k] for k in ("m", "n", "k", "batch")))
        elif step[0] == "launch":
            launch_buffers += sum(a.startswith("b") for a in attrs["args"].split(","))
    return kinds, sorted(gemms), launch_buffers


@unittest.skipUnless(importlib.util.find_spec("onnx"), "the ONNX path needs the onnx package (setup-python.sh)")
class PlanParity(unittest.TestCase):
    """torch.compile(backend="kiln")'s plan for sm_90a (built by NVRTC, no GPU needed) against
    the ONNX path's for the same module (TorchScript exporter, opset 17; the same pipeline):
    no more steps, the same GEMMs, no more buffers read or written by kernels. What the FX
    capture gives Kiln differs from what the exporter gives (an attention op with a causal mask
    tensor, nn.Linear with its bias, batch norm): these cases once planned more work."""

    def plans(self, module, inputs):
        import tempfile

        module = module.eval()
        torch._dynamo.reset()
        with torch.no_grad():
            try:  # the part is made at the first call; without a GPU its run then fails
                torch.compile(module, backend="kiln", options={"targets": ["sm_90a"]})(*inputs)
            except kiln.KilnError:
                pass
        parts = kiln.torch.kiln_backend.last_parts
        self.assertEqual(len(parts), 1, kiln.torch.kiln_backend.last_left_in_pytorch)
        via_torch = plan_of(parts[0].build_artifact())
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "m.onnx")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(module, inputs, path, opset_version=17, dynamo=False)
            via_onnx = plan_of(kiln.compile(path, kiln.torch.gpu_pipeline(["sm_90a"]), targets=["sm_90a"]))
        return plan_summary(via_torch), plan_summary(via_onnx)

    def assert_parity(self, module, inputs):
        (kinds, gemms, buffers), (onnx_kinds, onnx_gemms, onnx_buffers) = self.plans(module, inputs)
        self.assertLessEqual(sum(kinds.values()), sum(onnx_kinds.values()), (kinds, onnx_kinds))
        self.assertEqual(gemms, onnx_gemms)
        self.assertLessEqual(buffers, onnx_buffers)
        return kinds, onnx_kinds

    def test_causal_mask_tensor_is_causal_attention(self):
        # The mask tensor once went to the attention kernel (read for every score, no blocks
        # skipped); the ONNX path's fuse-attention found the causal pattern and dropped it.
        self.assert_parity(CausalSdpa(), (torch.randn(1, 64, 64),))

    def test_projections_with_biases_are_one_gemm(self):
        # nn.Linear with its bias (zero as initialized, or not) was a linear op fuse-horizontal
        # left alone: three GEMMs where the ONNX path's matmul + add made one batched GEMM.
        for zero_bias in (True, False):
            with self.subTest(zero_bias=zero_bias):
                kinds, _ = self.assert_parity(SeparateQkv(zero_bias=zero_bias), (torch.randn(2, 32, 64),))
                self.assertEqual(kinds.get("gemm"), 1)

    def test_conv_batch_norm_and_gelu_mlp(self):
        self.assert_parity(ConvBlock(), (torch.randn(2, 3, 16, 16),))
        self.assert_parity(MLP(), (torch.randn(2, 32, 32),))


def gpu_target():
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if major in (9, 10) else "")


@unittest.skipUnless(torch.cuda.is_available(), "no GPU here: the CUDA paths run on a GPU machine")
class Gpu(unittest.TestCase):
    def test_cuda_tensors_run_on_the_callers_stream(self):
        mlp = MLP().cuda().eval()
        x = torch.randn(2, 5, 32, device="cuda")
        fast = kiln.torch.compile_module(mlp, (x,), targets=[gpu_target()])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = fast(x)  # ordered on `side`, no host copies
        side.synchronize()
        self.assertTrue(y.is_cuda)
        with torch.no_grad():
            torch.testing.assert_close(y, mlp(x), rtol=1e-4, atol=1e-4)

    def test_model_run_takes_cuda_and_host_tensors(self):
        g = kiln.Graph()
        x = g.add_input("x", "f32", [4, 8])
        g.set_outputs([g.add_node("gelu", [x])[0]], ["y"])
        model = kiln.Runtime().load(kiln.compile(g, targets=[gpu_target()]))
        xs = torch.randn(4, 8)
        (on_device,) = model.run(xs.cuda())
        (on_host,) = model.run(xs)
        self.assertTrue(on_device.is_cuda and not on_host.is_cuda)
        torch.testing.assert_close(on_device.cpu(), F.gelu(xs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(on_host, F.gelu(xs), rtol=1e-5, atol=1e-5)
        with self.assertRaisesRegex(kiln.KilnError, "input 'x'"):
            model.run(torch.randn(4, 9, device="cuda"))
        # Not contiguous: copied on the device first (the Python path around the C++ one).
        (strided,) = model.run(xs.t().contiguous().cuda().t())
        torch.testing.assert_close(strided.cpu(), F.gelu(xs), rtol=1e-5, atol=1e-5)

    def test_bert_is_one_part_with_fused_attention(self):
        # The expanded mask's last stride is 0: made contiguous, SDPA records its fused overload
        # on CUDA (not the math form), which Kiln runs as its attention op.
        module = BertSdpaStyle().cuda().eval()
        ids = torch.randint(0, 50, (2, 12), device="cuda")
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(module, backend="kiln", options={"targets": [gpu_target()]})(ids)
            torch.testing.assert_close(got, module(ids), rtol=1e-3, atol=1e-3)
        parts = kiln.torch.kiln_backend.last_parts
        self.assertEqual(len(parts), 1, kiln.torch.kiln_backend.last_left_in_pytorch)
        self.assertEqual(parts[0].graph_.ops().count("attention"), 3)

    def test_torch_compile_with_gpu_targets(self):
        block = GPT2Block().cuda().eval()
        x = torch.randn(1, 8, 32, device="cuda")
        torch._dynamo.reset()
        with torch.no_grad():
            y = torch.compile(block, backend="kiln", options={"targets": [gpu_target()]})(x)
            torch.testing.assert_close(y, block(x), rtol=1e-3, atol=1e-3)


if __name__ == "__main__":
    unittest.main()
