"""PyTorch front end: FX graphs of ATen ops (torch.export, torch.compile) to Kiln graphs.

    import kiln.torch
    fast = kiln.torch.compile_module(model, (x,), backend="cpu")     # an nn.Module
    y = fast(x)

    compiled = torch.compile(model, backend="kiln")                   # the dynamo backend

Weights become Kiln constants that share the parameters' memory (no copy, no ONNX file); they
are frozen, and checked on every call (written in place, moved, or for torch.compile swapped for
another tensor): a change rebuilds Kiln's parts rather than running stale weights. Dynamic dims (`torch.export.Dim`, or dynamo's
dynamic shapes) become Kiln symbols named after PyTorch's (s0, s1, ...). Ops Kiln does not
lower stay in PyTorch: the graph is split into the parts Kiln converts, each compiled on its
own, and the rest, which PyTorch runs as before.
"""
from __future__ import annotations

import operator
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import fx

import kiln
from kiln import KilnError

aten = torch.ops.aten

__all__ = ["GPU_PASSES", "compile_module", "convert", "export_graph", "gpu_pipeline", "kiln_backend", "supported_ops",
           "tf32_options", "Unsupported"]

_DTYPES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool",
}
_NP = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32,
       "i16": np.int16, "i8": np.int8, "u8": np.uint8, "bool": np.bool_}


class Unsupported(Exception):
    """A node Kiln cannot take; the partitioner leaves it to PyTorch."""


def _meta(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_tensor_node(node: Any) -> bool:
    return isinstance(_meta(node), torch.Tensor)


def _dim(d: Any) -> "int | str":
    """A static size, or the name of the plain symbol a dynamic size is."""
    if isinstance(d, int):
        return d
    expr = d.node.expr if isinstance(d, torch.SymInt) else None
    if expr is not None and expr.is_Integer:
        return int(expr)
    if expr is not None and expr.is_Symbol:
        return str(expr)
    raise Unsupported(f"size {d} is computed from symbols; Kiln takes plain symbols only")


def _shape(t: torch.Tensor) -> list:
    return [_dim(d) for d in t.shape]


class _Builder:
    """Converts one FX graph (placeholders = inputs, get_attr = constants) to a kiln.Graph."""

    def __init__(self, gm: fx.GraphModule, name: str, constants: dict | None = None):
        """constants: placeholder index → (tensor, name) for placeholders that are weights."""
        self.gm = gm
        self.g = kiln.Graph(name)
        self.env: dict = {}
        self.constants = constants or {}
        self.tensor_inputs: list = []  # indices of the placeholders that are Kiln inputs

    # -- helpers used by the op handlers --------------------------------------------------
    def op(self, name: str, operands: list, attrs: dict | None = None, n: int = 1):
        out = self.g.add_node(name, operands, attrs or {}, n)
        return out if n > 1 else out[0]

    def const(self, value: Any, dtype: str) -> kiln.Value:
        if dtype == "bf16":
            t = torch.tensor(value, dtype=torch.bfloat16)
            return self.g.constant(t, "")
        return self.g.constant(np.asarray(value, dtype=_NP[dtype]), "")

    def val(self, a: Any, like: "kiln.Value | str | None" = None) -> kiln.Value:
        """An operand: a converted node, or a Python scalar made a constant of `like`'s dtype."""
        if isinstance(a, fx.Node):
            v = self.env[a]
            if v is None:
                raise Unsupported(f"'{a.name}' is a result Kiln does not compute")
            if not isinstance(v, kiln.Value):
                raise Unsupported(f"'{a.name}' is not a tensor Kiln computes")
            return v
        if isinstance(a, (bool, int, float)):
            dtype = like if isinstance(like, str) else like.dtype if like is not None else "f32"
            return self.const(a, dtype)
        raise Unsupported(f"operand {a!r} is not a tensor or a number")

    def cast(self, v: kiln.Value, dtype: str) -> kiln.Value:
        return v if v.dtype == dtype else self.op("cast", [v], {"to": dtype})

    # -- the conversion ------------------------------------------------------------------
    def run(self) -> kiln.Graph:
        outputs = []
        for i, node in enumerate(n for n in self.gm.graph.nodes if n.op == "placeholder"):
            m = _meta(node)
            if i in self.constants:
                self.env[node] = _constant(self.g, *self.constants[i])
            elif isinstance(m, torch.Tensor):
                if m.dtype not in _DTYPES:
                    raise Unsupported(f"input '{node.name}' is {m.dtype}")
                self.env[node] = self.g.add_input(node.name, _DTYPES[m.dtype], _shape(m))
                self.tensor_inputs.append(i)
            else:
                self.env[node] = m  # a SymInt or a number: read by the ops that take sizes
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "get_attr":
                t = _fetch_attr(self.gm, node.target)
                if not isinstance(t, torch.Tensor):
                    raise Unsupported(f"attribute '{node.target}' is not a tensor")
                self.env[node] = _constant(self.g, t, node.meta.get("kiln_name", node.target))
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                outputs = _flatten(node.args[0])
            else:
                raise Unsupported(f"{node.op} '{node.target}'")
        values = []
        for o in outputs:
            if not isinstance(o, fx.Node) or not _is_tensor_node(o):
                raise Unsupported(f"output {o!r} is not a tensor")
            v = self.val(o)
            values.append(self.cast(v, _DTYPES[_meta(o).dtype]))
        self.g.set_outputs(values, [f"output{i}" for i in range(len(values))])
        return self.g

    def call(self, node: fx.Node) -> Any:
        if node.target is operator.getitem:
            src, idx = node.args
            v = self.env[src]
            if not isinstance(v, tuple):
                raise Unsupported("getitem of a non-tuple")
            return v[idx]  # None for a result Kiln does not compute: an error only where used
        handler = _HANDLERS.get(node.target)
        if handler is None:
            raise Unsupported(f"no Kiln lowering for {node.target}")
        m = _meta(node)
        for a in _flatten((node.args, node.kwargs)):
            if isinstance(a, fx.Node) and isinstance(_meta(a), torch.Tensor) and _meta(a).dtype not in _DTYPES:
                raise Unsupported(f"operand of dtype {_meta(a).dtype}")
        out = handler(self, node, *node.args, **node.kwargs)
        if isinstance(m, torch.Tensor) and isinstance(out, kiln.Value):
            want = _DTYPES.get(m.dtype)
            if want is None:
                raise Unsupported(f"result dtype {m.dtype}")
            out = self.cast(out, want)
        return out


def _flatten(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flatten(item)]
    return [x]


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _constant(g: kiln.Graph, t: torch.Tensor, name: str) -> kiln.Value:
    """A Kiln constant viewing the tensor's memory (a host copy first for device tensors)."""
    if t.dtype not in _DTYPES:
        raise Unsupported(f"constant '{name}' is {t.dtype}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return g.constant(t.contiguous(), name)


# ---- op handlers: (builder, node, *args, **kwargs) -> kiln.Value or a tuple of them --------

_HANDLERS: dict = {}


def _handles(*targets: Any) -> Callable:
    def register(fn: Callable) -> Callable:
        for t in targets:
            _HANDLERS[t] = fn
        return fn
    return register


def _out_dtype(node: fx.Node) -> str:
    return _DTYPES[_meta(node).dtype]


def _binary(kiln_op: str, compare: bool = False) -> Callable:
    def handler(b: _Builder, node: fx.Node, x: Any, y: Any, **kw: Any) -> kiln.Value:
        if kw.get("alpha", 1) != 1:
            y_val = b.op("mul", [b.val(y, _operand_dtype(node, x, y)), b.val(kw["alpha"], _operand_dtype(node, x, y))])
            y = None
        else:
            y_val = None
        dtype = _operand_dtype(node, x, y if y_val is None else x) if compare else _out_dtype(node)
        xv = b.cast(b.val(x, dtype), dtype)
        yv = y_val if y_val is not None else b.cast(b.val(y, dtype), dtype)
        return b.op(kiln_op, [xv, yv])
    return handler


def _operand_dtype(node: fx.Node, *args: Any) -> str:
    """The dtype PyTorch computes a binary op in (type promotion of its operands)."""
    ts = [_meta(a) for a in args if isinstance(a, fx.Node)]
    scalars = [a for a in args if not isinstance(a, fx.Node)]
    if not ts:
        raise Unsupported("no tensor operand")
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    for s in scalars:
        if isinstance(s, float) and not dtype.is_floating_point:
            dtype = torch.get_default_dtype()
    return _DTYPES[dtype]


for _t, _k in [(aten.add.Tensor, "add"), (aten.add.Scalar, "add"), (aten.sub.Tensor, "sub"),
               (aten.sub.Scalar, "sub"), (aten.mul.Tensor, "mul"), (aten.mul.Scalar, "mul"),
               (aten.div.Tensor, "div"), (aten.div.Scalar, "div"), (aten.pow.Tensor_Scalar, "pow"),
               (aten.pow.Tensor_Tensor, "pow"), (aten.maximum.default, "maximum"),
               (aten.minimum.default, "minimum")]:
    _HANDLERS[_t] = _binary(_k)
for _t, _k in [(aten.eq.Tensor, "equal"), (aten.eq.Scalar, "equal"), (aten.ne.Tensor, "not_equal"),
               (aten.ne.Scalar, "not_equal"), (aten.lt.Tensor, "less"), (aten.lt.Scalar, "less"),
               (aten.le.Tensor, "less_equal"), (aten.le.Scalar, "less_equal"), (aten.gt.Tensor, "greater"),
               (aten.gt.Scalar, "greater"), (aten.ge.Tensor, "greater_equal"), (aten.ge.Scalar, "greater_equal")]:
    _HANDLERS[_t] = _binary(_k, compare=True)


@_handles(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(b, node, x, y, alpha=1):
    if alpha != 1:
        raise Unsupported("rsub with alpha")
    dtype = _out_dtype(node)
    return b.op("sub", [b.cast(b.val(y, dtype), dtype), b.cast(b.val(x, dtype), dtype)])


@_handles(aten.div.Tensor_mode)
def _div_mode(b, node, x, y, rounding_mode=None):
    if rounding_mode is not None:
        raise Unsupported(f"div with rounding_mode={rounding_mode}")
    return _HANDLERS[aten.div.Tensor](b, node, x, y)


def _unary(kiln_op: str, **attrs: Any) -> Callable:
    def handler(b: _Builder, node: fx.Node, x: Any) -> kiln.Value:
        return b.op(kiln_op, [b.cast(b.val(x), _out_dtype(node))], attrs)
    return handler


for _t, _k in [(aten.relu.default, "relu"), (aten.silu.default, "silu"), (aten.sigmoid.default, "sigmoid"),
               (aten.tanh.default, "tanh"), (aten.exp.default, "exp"), (aten.log.default, "log"),
               (aten.sqrt.default, "sqrt"), (aten.rsqrt.default, "rsqrt"), (aten.neg.default, "neg"),
               (aten.abs.default, "abs"), (aten.erf.default, "erf"), (aten.sin.default, "sin"),
               (aten.cos.default, "cos"), (aten.reciprocal.default, "reciprocal"),
               (aten.floor.default, "floor"), (aten.ceil.default, "ceil"), (aten.isnan.default, "isnan"),
               (aten.logical_not.default, "not"), (aten.softplus.default, "softplus")]:
    _HANDLERS[_t] = _unary(_k)


@_handles(aten.gelu.default)
def _gelu(b, node, x, approximate="none"):
    return b.op("gelu", [b.val(x)], {"approximate": approximate})


@_handles(aten.leaky_relu.default)
def _leaky_relu(b, node, x, negative_slope=0.01):
    return b.op("leaky_relu", [b.val(x)], {"alpha": float(negative_slope)})


@_handles(aten.clamp.default, aten.hardtanh.default)
def _clamp(b, node, x, min=None, max=None):
    attrs = {}
    if node.target == aten.hardtanh.default:
        min = -1.0 if min is None else min
        max = 1.0 if max is None else max
    if min is not None:
        attrs["min"] = float(min)
    if max is not None:
        attrs["max"] = float(max)
    return b.op("clip", [b.val(x)], attrs)


@_handles(aten.where.self)
def _where(b, node, cond, x, y):
    dtype = _out_dtype(node)
    return b.op("where", [b.cast(b.val(cond, "bool"), "bool"), b.cast(b.val(x, dtype), dtype),
                          b.cast(b.val(y, dtype), dtype)])


@_handles(aten.masked_fill.Scalar)
def _masked_fill(b, node, x, mask, value):
    xv = b.val(x)
    return b.op("where", [b.cast(b.val(mask), "bool"), b.val(value, xv), xv])


@_handles(aten._softmax.default, aten.softmax.int)
def _softmax(b, node, x, dim, half_to_float=False, dtype=None):
    return b.op("softmax", [b.cast(b.val(x), _out_dtype(node))], {"axis": dim})


@_handles(aten._log_softmax.default, aten.log_softmax.int)
def _log_softmax(b, node, x, dim, half_to_float=False, dtype=None):
    return b.op("log_softmax", [b.cast(b.val(x), _out_dtype(node))], {"axis": dim})


def _transposed_weight(y: Any) -> Any:
    """w when `y` is w transposed (aten.t / permute [1, 0] of a 2-D tensor): nn.Linear after
    decomposition, which Kiln takes back as one linear op (GEMM with a bias epilogue)."""
    if not isinstance(y, fx.Node) or len(_meta(y).shape) != 2:
        return None
    if y.target == aten.t.default or (y.target == aten.permute.default and list(y.args[1]) == [1, 0]):
        return y.args[0]
    return None


@_handles(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(b, node, x, y):
    w = _transposed_weight(y) if node.target == aten.mm.default else None
    if w is not None:
        return b.op("linear", [b.val(x), b.val(w)])
    return b.op("matmul", [b.val(x), b.val(y)])


@_handles(aten.addmm.default)
def _addmm(b, node, bias, x, y, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise Unsupported("addmm with alpha or beta")
    w = _transposed_weight(y)
    if w is not None and isinstance(bias, fx.Node) and len(_meta(bias).shape) == 1:
        return b.op("linear", [b.val(x), b.val(w), b.val(bias)])
    return b.op("add", [b.op("matmul", [b.val(x), b.val(y)]), b.val(bias)])


@_handles(aten.linear.default)
def _linear(b, node, x, w, bias=None):
    ops = [b.val(x), b.val(w)] + ([b.val(bias)] if bias is not None else [])
    return b.op("linear", ops)


@_handles(aten.t.default, aten.numpy_T.default)
def _t(b, node, x):
    rank = len(_meta(x).shape)
    return b.op("transpose", [b.val(x)], {"perm": list(reversed(range(rank)))}) if rank > 1 else b.val(x)


@_handles(aten.permute.default)
def _permute(b, node, x, dims):
    rank = len(_meta(x).shape)
    return b.op("transpose", [b.val(x)], {"perm": [d % rank for d in dims]})


@_handles(aten.transpose.int)
def _transpose(b, node, x, d0, d1):
    rank = len(_meta(x).shape)
    perm = list(range(rank))
    perm[d0 % rank], perm[d1 % rank] = perm[d1 % rank], perm[d0 % rank]
    return b.op("transpose", [b.val(x)], {"perm": perm})


def _target_shape(b: _Builder, x: fx.Node, node: fx.Node, *, expand: bool = False) -> list:
    """A reshape/expand target as Kiln attribute ints: static sizes stay; a symbolic size equal
    to the input's at the same position becomes 0 (reshape: copy) or 1 (expand: keep); one
    other symbolic size becomes -1 (reshape infers it)."""
    out = [_dim(d) if not isinstance(d, int) else d for d in _meta(node).shape]
    src = _shape(_meta(x))
    offset = len(out) - len(src)
    result, inferred = [], False
    for i, d in enumerate(out):
        if isinstance(d, int):
            result.append(d)
        elif expand and 0 <= i - offset < len(src) and src[i - offset] == d:
            result.append(1)  # broadcasting against 1 keeps the input's size
        elif not expand and i < len(src) and src[i] == d:
            result.append(0)  # reshape's 0 copies the input's size at the same position
        elif not expand and not inferred:
            result.append(-1)
            inferred = True
        else:
            raise Unsupported(f"target shape {out} of '{node.name}' needs sizes Kiln cannot compute")
    return result


@_handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def _view(b, node, x, shape):
    return b.op("reshape", [b.val(x)], {"shape": _target_shape(b, x, node)})


@_handles(aten.expand.default, aten.expand_copy.default)
def _expand(b, node, x, shape, implicit=False):
    return b.op("expand", [b.val(x)], {"shape": _target_shape(b, x, node, expand=True)})


@_handles(aten.unsqueeze.default)
def _unsqueeze(b, node, x, dim):
    rank = len(_meta(x).shape) + 1
    return b.op("unsqueeze", [b.val(x)], {"axes": [dim % rank]})


@_handles(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(b, node, x, dims=None):
    shape = _meta(x).shape
    rank = len(shape)
    dims = list(range(rank)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    axes = [d % rank for d in dims if isinstance(shape[d], int) and shape[d] == 1]
    return b.op("squeeze", [b.val(x)], {"axes": axes}) if axes else b.val(x)


@_handles(aten.flatten.using_ints)
def _flatten_op(b, node, x, start_dim=0, end_dim=-1):
    return b.op("reshape", [b.val(x)], {"shape": _target_shape(b, x, node)})


@_handles(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(b, node, x, dim=0, start=None, end=None, step=1):
    rank = len(_meta(x).shape)
    start = 0 if start is None else start
    end = 2**62 if end is None else end
    if not all(isinstance(v, int) for v in (start, end, step)):
        raise Unsupported("slice bounds computed from symbols")
    return b.op("slice", [b.val(x)], {"starts": [start], "ends": [min(end, 2**62)], "axes": [dim % rank],
                                      "steps": [step]})


@_handles(aten.select.int, aten.select_copy.int)
def _select(b, node, x, dim, index):
    if not isinstance(index, int):
        raise Unsupported("select with a symbolic index")
    rank = len(_meta(x).shape)
    return b.op("gather", [b.val(x), b.const(index, "i64")], {"axis": dim % rank})


@_handles(aten.cat.default, aten.concat.default)
def _cat(b, node, xs, dim=0):
    dtype = _out_dtype(node)
    vals = [b.cast(b.val(x), dtype) for x in xs if not (isinstance(x, fx.Node) and _meta(x).numel() == 0)]
    rank = len(_meta(node).shape)
    return b.op("concat", vals, {"axis": dim % rank})


@_handles(aten.constant_pad_nd.default)
def _constant_pad(b, node, x, pad, value=0):
    """PyTorch's pads run from the last dim back, (begin, end) each; Kiln's are all begins, then
    all ends. SDPA pads an attention mask on CUDA this way when its last dim is unaligned."""
    rank = len(_meta(x).shape)
    if not all(isinstance(p, int) for p in pad) or len(pad) > 2 * rank:
        raise Unsupported(f"padding {list(pad)}")
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):
        begins[rank - 1 - i], ends[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    return b.op("pad", [b.val(x)], {"pads": begins + ends, "mode": "constant", "value": float(value)})


@_handles(aten.split_with_sizes.default, aten.split.Tensor, aten.split_with_sizes_copy.default)
def _split(b, node, x, sizes, dim=0):
    rank = len(_meta(x).shape)
    full = _meta(x).shape[dim]
    if isinstance(sizes, int):
        if not isinstance(full, int):
            raise Unsupported("split of a symbolic dim")
        sizes = [min(sizes, full - i) for i in range(0, full, sizes)]
    if not all(isinstance(s, int) for s in sizes):
        raise Unsupported("split with symbolic sizes")
    outs = b.op("split", [b.val(x)], {"axis": dim % rank, "sizes": list(sizes)}, n=len(sizes))
    return tuple(outs) if len(sizes) > 1 else (outs,)


@_handles(aten.embedding.default)
def _embedding(b, node, weight, indices, padding_idx=-1, scale_grad=False, sparse=False):
    return b.op("gather", [b.val(weight), b.val(indices)], {"axis": 0})


@_handles(aten.index_select.default)
def _index_select(b, node, x, dim, index):
    rank = len(_meta(x).shape)
    return b.op("gather", [b.val(x), b.val(index)], {"axis": dim % rank})


def _reduce(kiln_op: str) -> Callable:
    def handler(b, node, x, dims=None, keepdim=False, dtype=None):
        rank = len(_meta(x).shape)
        attrs = {"keepdims": int(bool(keepdim))}
        if dims is not None and (not isinstance(dims, (list, tuple)) or len(dims)):
            dims = [dims] if isinstance(dims, int) else dims
            attrs["axes"] = [d % rank for d in dims]
        return b.op(kiln_op, [b.cast(b.val(x), _out_dtype(node))], attrs)
    return handler


_HANDLERS[aten.mean.dim] = _reduce("reduce_mean")
_HANDLERS[aten.sum.dim_IntList] = _reduce("reduce_sum")
_HANDLERS[aten.amax.default] = _reduce("reduce_max")
_HANDLERS[aten.amin.default] = _reduce("reduce_min")


def _flag_reduce(kiln_op: str) -> Callable:
    """any (kiln_op reduce_max) and all (reduce_min): over the operand's truth values as bytes,
    as Kiln's reductions take numbers. PyTorch's safe softmax (the math attention's, with a
    mask) asks whether every score of a row is -inf this way."""
    def handler(b, node, x, dims=None, keepdim=False):
        xv = b.val(x)
        flags = xv if xv.dtype == "bool" else b.op("not_equal", [xv, b.const(0, xv.dtype)])
        rank = len(_meta(x).shape)
        attrs = {"keepdims": int(bool(keepdim))}
        if dims is not None and (not isinstance(dims, (list, tuple)) or len(dims)):
            attrs["axes"] = [d % rank for d in ([dims] if isinstance(dims, int) else dims)] if rank else []
        return b.cast(b.op(kiln_op, [b.cast(flags, "u8")], attrs), "bool")
    return handler


for _t in (aten.any.dim, aten.any.dims, aten.any.default):
    _HANDLERS[_t] = _flag_reduce("reduce_max")
for _t in (aten.all.dim, aten.all.dims, aten.all.default):
    _HANDLERS[_t] = _flag_reduce("reduce_min")


@_handles(aten.full_like.default, aten.zeros_like.default, aten.ones_like.default)
def _full_like(b, node, x, *args, **kw):
    """A scalar constant broadcast to the result's (static) shape: no tensor-sized constant."""
    m = _meta(node)
    value = {aten.zeros_like.default: 0, aten.ones_like.default: 1}.get(node.target)
    if value is None:
        value = args[0] if args else kw["fill_value"]
    shape = _shape(m)
    if not all(isinstance(d, int) for d in shape):
        raise Unsupported(f"{node.target} with a symbolic shape")
    scalar = b.const(value, _DTYPES[m.dtype])
    return b.op("expand", [scalar], {"shape": shape}) if shape else scalar


@_handles(aten.mean.default, aten.sum.default)
def _reduce_all(b, node, x, dtype=None):
    kiln_op = "reduce_mean" if node.target == aten.mean.default else "reduce_sum"
    return b.op(kiln_op, [b.cast(b.val(x), _out_dtype(node))], {"keepdims": 0})


@_handles(aten.native_layer_norm.default)
def _native_layer_norm(b, node, x, normalized_shape, w, bias, eps):
    rank = len(_meta(x).shape)
    ops = [b.val(x)] + ([b.val(w)] if w is not None else [])
    if bias is not None:
        if w is None:
            ops.append(b.const(np.ones(1), b.val(x).dtype))
        ops.append(b.val(bias))
    y = b.op("layer_norm", ops, {"axis": rank - len(normalized_shape), "epsilon": float(eps)})
    return (y, None, None)


@_handles(aten.layer_norm.default)
def _layer_norm(b, node, x, normalized_shape, w=None, bias=None, eps=1e-5, cudnn_enable=True):
    return _native_layer_norm(b, node, x, normalized_shape, w, bias, eps)[0]


@_handles(aten.rms_norm.default)
def _rms_norm(b, node, x, normalized_shape, w=None, eps=None):
    rank = len(_meta(x).shape)
    if eps is None:
        eps = torch.finfo(_meta(x).dtype).eps
    ops = [b.val(x)] + ([b.val(w)] if w is not None else [])
    return b.op("rms_norm", ops, {"axis": rank - len(normalized_shape), "epsilon": float(eps)})


@_handles(aten._native_batch_norm_legit_no_training.default)
def _batch_norm(b, node, x, w, bias, mean, var, momentum, eps):
    if w is None or bias is None:
        raise Unsupported("batch norm without affine parameters")
    y = b.op("batch_norm", [b.val(x), b.val(w), b.val(bias), b.val(mean), b.val(var)], {"epsilon": float(eps)})
    return (y, None, None)


@_handles(aten.convolution.default)
def _convolution(b, node, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise Unsupported("transposed convolution")
    ops = [b.val(x), b.val(w)] + ([b.val(bias)] if bias is not None else [])
    return b.op("conv", ops, {"strides": list(stride), "pads": list(padding) * 2, "dilations": list(dilation),
                              "groups": groups})


def _pool_attrs(rank: int, kernel, stride, padding) -> dict:
    n = rank - 2
    kernel = list(kernel) * (n if len(kernel) == 1 else 1)
    stride = list(stride or kernel) * (n if stride and len(stride) == 1 else 1)
    padding = list(padding) * (n if len(padding) == 1 else 1)
    return {"kernel_shape": kernel, "strides": stride, "pads": padding * 2}


@_handles(aten.max_pool2d_with_indices.default, aten.max_pool2d.default)
def _max_pool(b, node, x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    rank = len(_meta(x).shape)
    attrs = _pool_attrs(rank, kernel, stride, padding)
    attrs["dilations"] = list(dilation) * ((rank - 2) if len(dilation) == 1 else 1)
    attrs["ceil_mode"] = int(ceil_mode)
    y = b.op("max_pool", [b.val(x)], attrs)
    return (y, None) if node.target == aten.max_pool2d_with_indices.default else y


@_handles(aten.avg_pool2d.default)
def _avg_pool(b, node, x, kernel, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    if divisor_override is not None:
        raise Unsupported("avg_pool2d with divisor_override")
    attrs = _pool_attrs(len(_meta(x).shape), kernel, stride, padding)
    attrs.update(ceil_mode=int(ceil_mode), count_include_pad=int(count_include_pad))
    return b.op("avg_pool", [b.val(x)], attrs)


@_handles(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default)
def _adaptive_avg_pool(b, node, x, output_size):
    if list(output_size) != [1, 1]:
        raise Unsupported(f"adaptive average pooling to {list(output_size)}")
    return b.op("reduce_mean", [b.val(x)], {"axes": [2, 3], "keepdims": 1})


@_handles(aten._to_copy.default, aten.to.dtype)
def _to_copy(b, node, x, *args, **kw):
    if _meta(node).device != _meta(x).device:
        raise Unsupported("a copy to another device")
    return b.cast(b.val(x), _out_dtype(node))


@_handles(aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
          aten.contiguous.default, aten.dropout.default)
def _identity(b, node, x, *args, **kw):
    return b.val(x)


def _attention(b, q, k, v, mask, dropout_p, is_causal, scale):
    if dropout_p:
        raise Unsupported("attention with dropout")
    qm = _meta(q)
    if len(qm.shape) != 4:
        raise Unsupported("attention on other than [B, H, S, D] tensors")
    if scale is None:
        scale = 1.0 / float(qm.shape[-1]) ** 0.5
    ops = [b.val(q), b.val(k), b.val(v)]
    if mask is not None:
        m = b.val(mask)
        if m.dtype == "bool":  # True keeps a position: additive 0 / -inf
            m = b.op("where", [m, b.const(0.0, ops[0].dtype), b.const(float("-inf"), ops[0].dtype)])
        ops.append(b.cast(m, ops[0].dtype))
    return b.op("attention", ops, {"scale": float(scale), "causal": int(bool(is_causal))})


# The overloads PyTorch picks per device; each returns the output first (then statistics Kiln
# does not compute: _FIRST_RESULT_ONLY keeps those nodes out when the statistics are used).
@_handles(aten.scaled_dot_product_attention.default)
def _sdpa(b, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # Kiln's attention takes grouped-query heads (fewer k/v heads) as they are, enable_gqa or not.
    return _attention(b, q, k, v, attn_mask, dropout_p, is_causal, scale)


@_handles(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu(b, node, q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    return (_attention(b, q, k, v, attn_mask, dropout_p, is_causal, scale), None)


@_handles(aten._scaled_dot_product_flash_attention.default)
def _sdpa_flash(b, node, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=None):
    return (_attention(b, q, k, v, None, dropout_p, is_causal, scale),) + (None,) * 8


@_handles(aten._scaled_dot_product_efficient_attention.default)
def _sdpa_efficient(b, node, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, scale=None):
    return (_attention(b, q, k, v, attn_bias, dropout_p, is_causal, scale),) + (None,) * 3


@_handles(aten._scaled_dot_product_cudnn_attention.default)
def _sdpa_cudnn(b, node, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, scale=None):
    return (_attention(b, q, k, v, attn_bias, dropout_p, is_causal, scale),) + (None,) * 8


@_handles(aten.full.default, aten.scalar_tensor.default)
def _full(b, node, *args, **kw):
    m = _meta(node)
    if not all(isinstance(d, int) for d in m.shape):
        raise Unsupported("full with a symbolic shape")
    value = args[1] if node.target == aten.full.default else args[0]
    return _constant(b.g, torch.full(tuple(m.shape), value, dtype=m.dtype), node.name)


@_handles(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(b, node, *args, **kw):
    m = _meta(node)
    if not all(isinstance(a, (int, float)) for a in args):
        raise Unsupported("arange with symbolic bounds")
    return _constant(b.g, torch.arange(*args, dtype=m.dtype), node.name)


_FIRST_RESULT_ONLY = {aten.native_layer_norm.default, aten._native_batch_norm_legit_no_training.default,
                      aten.max_pool2d_with_indices.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default}


def supported_ops() -> list:
    """The ATen overloads Kiln lowers, by name."""
    return sorted(str(t) for t in _HANDLERS)


# ---- whole graphs, partitions and the nn.Module replacement ---------------------------------

def _unsupported_reason(node: fx.Node) -> "str | None":
    """None when `node` converts alone (a handler exists and the builder accepts it on its own
    operand types, checked by converting a one-node graph); otherwise why not."""
    if node.op != "call_function":
        return f"{node.op} node"
    if node.target is operator.getitem:
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.target not in _HANDLERS:
            return "getitem of a result Kiln does not compute"
        if node.args[1] != 0 and src.target in _FIRST_RESULT_ONLY:
            return f"result {node.args[1]} of {src.target}, which Kiln does not compute"
        return None
    if node.target not in _HANDLERS:
        return "no Kiln lowering"
    # Ops whose other results (statistics, indices) Kiln does not compute: only when unused.
    if node.target in _FIRST_RESULT_ONLY and any(u.target is not operator.getitem or u.args[1] != 0
                                                 for u in node.users):
        return "its second or later results are used, which Kiln does not compute"
    m = _meta(node)
    if m is None:
        return "no type information (meta 'val')"
    if isinstance(m, torch.Tensor) and (m.dtype not in _DTYPES or m.device.type == "meta"):
        return f"result of dtype {m.dtype} on {m.device}"
    try:
        _probe(node)
    except (Unsupported, KilnError, TypeError, ValueError, KeyError, IndexError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _node_supported(node: fx.Node) -> bool:
    return _unsupported_reason(node) is None


def _probe(node: fx.Node) -> None:
    """Converts `node` alone (its tensor operands as inputs) and throws when Kiln refuses it."""
    g = fx.Graph()
    mapping = {}
    for a in _flatten((node.args, node.kwargs)):
        if isinstance(a, fx.Node) and a not in mapping:
            p = g.placeholder(a.name)
            p.meta["val"] = _meta(a)
            mapping[a] = p
    copy = g.node_copy(node, lambda n: mapping[n])
    outs = [copy] if not isinstance(_meta(node), (tuple, list)) else []
    g.output(tuple(outs))
    b = _Builder(fx.GraphModule(torch.nn.Module(), g), "probe")
    b.run()


# The passes of the shipped CUDA pipelines (examples/pipelines/cuda-sm90*.toml; a test keeps them
# the same): the standard passes plus layout-nhwc, so convolutions run channels last as cuDNN's
# tensor-core kernels want them.
GPU_PASSES = ("canonicalize", "cse", "layout-nhwc", "fold-layout", "fuse-attention", "fuse-horizontal", "fuse-rows",
              "fuse-pointwise", "dce", "schedule-memory")


def tf32_options() -> dict:
    """The CUDA backends' TF32 options as PyTorch's flags set them now: convolutions follow
    torch.backends.cudnn.allow_tf32 (on by default), matmuls torch.backends.cuda.matmul.allow_tf32
    and torch.set_float32_matmul_precision (off, "highest", by default)."""
    matmul = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return {"allow-tf32-matmul": bool(matmul), "allow-tf32-conv": bool(torch.backends.cudnn.allow_tf32)}


def gpu_pipeline(targets: Sequence[str], passes: str | None = None) -> "kiln.Pipeline":
    """The pipeline GPU targets compile with when none is given: the shipped CUDA pipelines'
    passes (or `passes`), the backend that builds the first target, and TF32 as PyTorch would
    use it (tf32_options, read now)."""
    targets = list(targets)
    backends = [p["name"] for p in kiln.plugins() if p["kind"] == "backend" and targets[0] in p.get("targets", ())]
    if not backends:
        raise KilnError(f"kiln.torch: no backend builds target '{targets[0]}'")
    options = ",".join(f"{k}={'true' if v else 'false'}" for k, v in tf32_options().items())
    pass_list = ",".join(GPU_PASSES) if passes is None else passes
    return kiln.Pipeline.from_string(f"| {pass_list} | {backends[0]}{{{options}}}@{','.join(targets)}")


class KilnGraphModule(torch.nn.Module):
    """One part of a PyTorch graph compiled by Kiln; called with the part's inputs."""

    def __init__(self, gm: fx.GraphModule, name: str, backend: str, targets: Sequence[str],
                 pipeline: Any, passes: str | None, constants: dict | None = None):
        """constants: placeholder index → (tensor, name), for the part's inputs that are weights
        (they become Kiln constants; forward still receives them, and ignores them)."""
        super().__init__()
        builder = _Builder(gm, name, constants)  # reads gm, never changes it: on failure PyTorch runs it
        self.graph_ = builder.run()
        self.tensor_inputs = builder.tensor_inputs
        outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.single = not isinstance(outs, (tuple, list))
        self.backend, self.targets, self.passes = backend, list(targets), passes
        # GPU targets without a pipeline: the CUDA pipelines' passes and PyTorch's TF32 choices,
        # fixed when the part is made. `pipeline.canonical` shows it (artifacts record it too).
        if self.targets and pipeline is None:
            pipeline, self.passes = gpu_pipeline(self.targets, passes), None
        self.pipeline = pipeline
        self._models: dict = {}
        self._runtime = None
        # (input, dim, symbol) of every symbolic dim of the graph's inputs.
        self._symbolic = [(i, j, d) for i, info in enumerate(self.graph_.inputs)
                          for j, d in enumerate(info["shape"]) if isinstance(d, str)]
        if not self.targets:
            self._models[None] = kiln.compile(self.graph_, pipeline, backend=None if pipeline else backend,
                                              passes=passes)

    def _model(self, tensors: list) -> Any:
        if not self.targets:
            return self._models[None]
        # Artifacts have static shapes: one per set of sizes of the symbolic dims.
        key = tuple(tensors[i].shape[j] for i, j, _ in self._symbolic) if self._symbolic else ()
        model = self._models.get(key)
        if model is None:
            art = self.build_artifact({name: int(tensors[i].shape[j]) for i, j, name in self._symbolic})
            if self._runtime is None:  # on the inputs' GPU
                self._runtime = kiln.Runtime(next((t.device.index or 0 for t in tensors if t.is_cuda), 0))
            model = self._models[key] = self._runtime.load(art)
        return model

    def build_artifact(self, symbols: dict | None = None) -> "kiln.Artifact":
        """The artifact for the targets with the symbolic dims bound to `symbols` (needs no GPU)."""
        return kiln.compile(self.graph_, self.pipeline, targets=self.targets, symbols=symbols or {},
                            passes=self.passes)

    def forward(self, *args: Any) -> Any:
        outs = self.run_tensors([args[i] for i in self.tensor_inputs])
        return outs[0] if self.single else tuple(outs)

    def run_tensors(self, tensors: list) -> list:
        """The part's outputs, a list, for its tensor inputs in order (what forward takes less
        the weights it ignores)."""
        if not self.targets:  # the in-process model on host tensors, without the package's checks
            impl = self._models[None]._impl
            outs = impl._run_torch(tensors)  # dense tensors: no Python per input (None: others)
            return outs if outs is not None else impl._run([_host_array(t) for t in tensors], True)
        model = self._models.get(()) if not self._symbolic else None
        if model is None:
            model = self._model(tensors)
        outs = model._impl._run_torch(tensors)  # as above, on the host or on the model's GPU
        if outs is not None:
            return outs
        for t in tensors:
            if not t.is_cuda:
                return model.run(tensors)
        return model._run_cuda(tensors)


# NumPy views of host tensors of these dtypes reach Kiln through the buffer protocol, which costs
# less per call than DLPack (about 1 us against 2.5 on the development machine).
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool}


def _host_array(t: torch.Tensor) -> Any:
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.numpy() if t.dtype in _NUMPY_DTYPES else t


def _freeze_params(gm: fx.GraphModule, placeholders: dict, names: dict | None = None) -> None:
    """Turns the placeholders in `placeholders` (node name → tensor) into constants, named in
    Kiln after `names` (node name → e.g. "fc1.weight") where given."""
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node.name in placeholders:
            attr = "_kiln_const_" + node.name
            gm.register_buffer(attr, placeholders[node.name])
            with gm.graph.inserting_before(node):
                getter = gm.graph.get_attr(attr)
            getter.meta = dict(node.meta)
            if names and node.name in names:
                getter.meta["kiln_name"] = names[node.name]
            node.replace_all_uses_with(getter)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


# A folded constant may take this many bytes beyond its operands' (a mask of S x S from two
# aranges); larger results stay computed, in Kiln or PyTorch.
_FOLD_GROWTH_BYTES = 16 << 20


def _foldable(node: fx.Node, values: dict) -> bool:
    """Whether `node` is a pure ATen op whose operands are all known constants."""
    if node.op != "call_function":
        return False
    operands = [a for a in _flatten((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    if not all(a in values for a in operands):
        return False
    if node.target is operator.getitem:
        return bool(operands)
    if not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in node.target.tags


def _is_view(node: fx.Node, views: set) -> bool:
    """An op whose result aliases an operand (or an element of a view op's results)."""
    if node.target is operator.getitem:
        return node.args[0] in views
    return any(r.alias_info is not None for r in node.target._schema.returns)


def _fold_constants(gm: fx.GraphModule) -> int:
    """Evaluates, with PyTorch, every op whose operands are all constants (weights, aranges,
    fulls, and what is computed from them only: position ids, masks) and makes its result a
    constant; returns how many nodes were folded. The parts Kiln runs then take these as
    constants, and no part is left without a tensor input. A result that reaches the graph's
    outputs stays computed (the caller owns what it is returned)."""
    values = {n: _fetch_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    values = {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}
    views: set = set()
    folded = 0
    for node in list(gm.graph.nodes):
        if not _foldable(node, values):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: values[a])
        try:
            with torch.no_grad():
                result = node.target(*args, **kwargs)
        except Exception:  # whatever cannot be evaluated here stays in the graph
            continue
        if isinstance(result, (tuple, list)) or _is_view(node, views):
            # Views (a weight's transpose that linear takes as is) and tuples stay in the graph;
            # the ops computed from them fold.
            values[node] = result
            views.add(node)
            continue
        if result is None and not node.users:  # a check (_assert_tensor_metadata) that passed
            gm.graph.erase_node(node)
            continue
        if not isinstance(result, torch.Tensor) or any(u.op == "output" for u in node.users):
            continue
        operand_bytes = sum(v.numel() * v.element_size() for v in _flatten((args, kwargs))
                            if isinstance(v, torch.Tensor))
        if result.numel() * result.element_size() > operand_bytes + _FOLD_GROWTH_BYTES:
            continue
        attr = "_kiln_folded_" + node.name
        gm.register_buffer(attr, result)
        with gm.graph.inserting_before(node):
            getter = gm.graph.get_attr(attr)
        values[getter] = result
        getter.meta = dict(node.meta)
        node.replace_all_uses_with(getter)
        gm.graph.erase_node(node)
        folded += 1
    for node in reversed(list(gm.graph.nodes)):  # views and tuples whose users all folded
        if node in views and not node.users:
            gm.graph.erase_node(node)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _fold_batch_norms(gm: fx.GraphModule) -> int:
    """Folds each inference batch norm that alone reads a convolution with constant weights
    into those weights (as PyTorch's own freezing and ONNX export do): the convolution then
    applies it, with no batch-norm kernel between it and what follows (and nothing to stop
    layout-nhwc keeping a chain of convolutions channels last). Returns how many folded."""
    from torch.nn.utils.fusion import fuse_conv_bn_weights

    def constant(a: Any) -> Any:
        return _fetch_attr(gm, a.target) if isinstance(a, fx.Node) and a.op == "get_attr" else None

    folded = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target != aten._native_batch_norm_legit_no_training.default:
            continue
        conv, w, b, mean, var = bn.args[:5]
        eps = bn.args[6] if len(bn.args) > 6 else bn.kwargs.get("eps", 1e-5)
        if not (isinstance(conv, fx.Node) and conv.target == aten.convolution.default and len(conv.users) == 1):
            continue
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in bn.users):
            continue  # the batch statistics are used: PyTorch computes them
        cw, cb, transposed = constant(conv.args[1]), constant(conv.args[2]), conv.args[6]
        stats = [constant(a) for a in (w, b, mean, var)]
        if transposed or cw is None or (conv.args[2] is not None and cb is None) or \
                any(s is None for s in stats[2:]) or any(a is not None and s is None for a, s in zip((w, b), stats)):
            continue
        with torch.no_grad():
            fw, fb = fuse_conv_bn_weights(cw, cb, stats[2], stats[3], eps, stats[0], stats[1])
        getters = []
        for suffix, value in (("weight", fw), ("bias", fb)):
            attr = f"_kiln_bn_{suffix}_{conv.name}"
            gm.register_buffer(attr, value.detach())
            with gm.graph.inserting_before(conv):
                getters.append(gm.graph.get_attr(attr))
            getters[-1].meta["val"] = value  # the types the converter reads (a bias may be new)
            getters[-1].meta["kiln_name"] = f"{conv.name}.{suffix}"
        conv.args = (conv.args[0], getters[0], getters[1]) + tuple(conv.args[3:])
        for use in list(bn.users):
            use.replace_all_uses_with(conv)
            gm.graph.erase_node(use)
        gm.graph.erase_node(bn)
        folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _partition(gm: fx.GraphModule, backend: str, targets: Sequence[str], pipeline: Any,
               passes: str | None) -> fx.GraphModule:
    """Replaces every maximal part of `gm` Kiln supports by a KilnGraphModule; the rest stays.
    Batch norms after convolutions and ops on constants only are folded first."""
    _fold_batch_norms(gm)
    _fold_constants(gm)
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    reasons: dict = {}

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules, node):
            if node.name not in reasons:  # by name: what stays keeps its name in the fused graph
                reasons[node.name] = _unsupported_reason(node)
            return reasons[node.name] is None

    partitioner = CapabilityBasedPartitioner(gm, Support(), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    # A part with no computation (only getitem or views of inputs) is not worth a call.
    partitions = [p for p in partitions if any(n.target is not operator.getitem for n in p.nodes)]
    fused = partitioner.fuse_partitions(partitions)
    refused: dict = {}
    for node in list(fused.graph.nodes):
        if node.op != "call_module" or not node.target.startswith("fused_"):
            continue
        sub = getattr(fused, node.target)
        # Weights reach the part as get_attr arguments: they become Kiln constants.
        constants = {i: (_fetch_attr(fused, a.target), a.meta.get("kiln_name", a.target))
                     for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"}
        if all(not isinstance(a, fx.Node) or a.op == "get_attr" or not _is_tensor_node(a) for a in node.args):
            continue  # constants only (a result too large to fold): PyTorch computes it
        try:
            part = KilnGraphModule(sub, node.target, backend, targets, pipeline, passes, constants)
        except Exception as e:  # whatever Kiln cannot take, PyTorch runs: never a failed model
            warnings.warn(f"kiln: part '{node.target}' stays in PyTorch: {type(e).__name__}: {e}")
            refused[f"part {node.target}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"] = 1
            continue
        setattr(fused, node.target, part)
    fused.recompile()
    fused.kiln_left_in_pytorch = _left_in_pytorch(fused, reasons, refused)
    return fused


def _left_in_pytorch(fused: fx.GraphModule, reasons: dict, refused: dict) -> dict:
    """"op: why" → count, for every op PyTorch computes between Kiln's parts (what splits a
    graph into several parts), and each part Kiln refused."""
    left = dict(refused)
    for node in fused.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        why = reasons.get(node.name) or "supported, but left out of the parts"
        key = f"{node.target}: {why}"
        left[key] = left.get(key, 0) + 1
    return left


def _decompositions() -> dict:
    """Core ATen, but linear and scaled_dot_product_attention stay whole: Kiln has both as ops
    (cuBLASLt GEMMs with epilogues, fused attention)."""
    table = torch.export.default_decompositions()
    for op in (aten.linear.default, aten.scaled_dot_product_attention.default):
        table.pop(op, None)
    return table


def _aten_graph(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes: Any) -> tuple:
    """torch.export → core ATen → a GraphModule whose parameters and buffers are constants,
    and the ExportedProgram."""
    with torch.no_grad():
        ep = torch.export.export(module, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
        ep = ep.run_decompositions(_decompositions())
    gm = ep.graph_module
    sig = ep.graph_signature
    from torch.export.graph_signature import InputKind, OutputKind

    frozen, names = {}, {}
    for spec in sig.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            names[spec.arg.name] = spec.target
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            frozen[spec.arg.name] = ep.state_dict[spec.target] if spec.target in ep.state_dict \
                else ep.constants[spec.target]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            frozen[spec.arg.name] = ep.constants[spec.target]
        elif spec.kind != InputKind.USER_INPUT:
            raise KilnError(f"kiln.torch: exported input kind {spec.kind} is not supported")
    if any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs):
        raise KilnError("kiln.torch: the module mutates its buffers; Kiln compiles pure inference graphs")
    _freeze_params(gm, {k: v.detach() for k, v in frozen.items()}, names)
    return gm, ep


def export_graph(module: torch.nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any = None,
                 name: str | None = None) -> kiln.Graph:
    """The whole module as one kiln.Graph (torch.export, then conversion); KilnError naming the
    first op Kiln cannot lower. Inputs are the module's tensor arguments, outputs output0...
    Use compile_module for modules with ops Kiln lacks."""
    gm, _ = _aten_graph(module, tuple(example_inputs), dynamic_shapes)
    return convert(gm, name or type(module).__name__)


def convert(gm: fx.GraphModule, name: str = "main") -> kiln.Graph:
    """A kiln.Graph from an ATen FX graph with `val` metadata (as torch.export and AOTAutograd
    make): placeholders become inputs, get_attr tensors constants."""
    try:
        return _Builder(gm, name).run()
    except Unsupported as e:
        raise KilnError(f"kiln.torch: {e}") from None


class CompiledModule(torch.nn.Module):
    """What compile_module returns: the module's graph with Kiln's parts, called like the module."""

    def __init__(self, module: torch.nn.Module, gm: fx.GraphModule, ep: Any, rebuild: Callable | None = None):
        """rebuild(args): (gm, ep) compiled again from the module's weights as they are now, for
        `args` as example inputs."""
        super().__init__()
        self._in_spec = ep.call_spec.in_spec
        self._out_spec = ep.call_spec.out_spec
        self._original = type(module).__name__
        # The common case, tensors in and a tensor or a tuple of them out, skips pytree per call.
        self._positional = _positional_count(self._in_spec)
        self._out_kind = _output_kind(self._out_spec)
        self._rebuild, self._module_call = rebuild, module.__call__  # closures: not registered submodules
        self._rebuilds, self._in_pytorch = 0, False
        self._install(gm, ep)

    def _install(self, gm: fx.GraphModule, ep: Any) -> None:
        self.graph_module = gm
        # Kiln took the whole graph: its part is called directly (Kiln's outputs never need
        # gradients, so neither does switching them off).
        self._direct = _direct_forward(gm)
        # The module's own parameters and buffers, which Kiln froze: checked on every call.
        weights = [t for t in list(ep.state_dict.values()) + list(ep.constants.values()) if isinstance(t, torch.Tensor)]
        self._weights = kiln._kiln._WeightWatch(weights, [-1] * len(weights))

    def _weights_changed(self, args: tuple, kwargs: dict) -> bool:
        """A weight was written in place or moved since Kiln froze it: compiles the module again
        from its weights as they are now and returns False, or, after _MAX_REBUILDS of those or
        for a call with keywords, returns True: the module itself (PyTorch) runs the call."""
        if self._in_pytorch:
            return True
        if kwargs or self._rebuild is None or self._rebuilds >= _MAX_REBUILDS:
            warnings.warn(f"kiln: the {self._original}'s weights changed since they were frozen; PyTorch runs it "
                          "from now on (compile_module again for Kiln)")
            self._in_pytorch = True
            self._weights = _NEVER_UNCHANGED
            return True
        self._rebuilds += 1
        self._install(*self._rebuild(args))
        return False

    def kiln_parts(self) -> list:
        """The KilnGraphModule of each part Kiln runs."""
        return [m for m in self.graph_module.children() if isinstance(m, KilnGraphModule)]

    def left_in_pytorch(self) -> dict:
        """"op: why" → count for each op PyTorch runs between Kiln's parts, and each part Kiln
        refused (torch.compile's backend: kiln_backend.last_left_in_pytorch)."""
        return dict(self.graph_module.kiln_left_in_pytorch)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._weights.unchanged(_NO_ARGS) and self._weights_changed(args, kwargs):
            with torch.no_grad():
                return self._module_call(*args, **kwargs)
        if kwargs or len(args) != self._positional:
            return self._forward_tree(args, kwargs)
        for a in args:  # a loop: all() over a generator costs more per call
            if not isinstance(a, torch.Tensor):
                return self._forward_tree(args, kwargs)
        if self._direct is not None:
            outs = self._direct(*args)
        elif torch.is_grad_enabled():
            with torch.no_grad():
                outs = self.graph_module.forward(*args)
        else:
            outs = self.graph_module.forward(*args)
        if self._out_kind == "one":
            return outs[0]
        return tuple(outs) if self._out_kind == "tuple" else self._unflatten(outs)

    def _forward_tree(self, args: tuple, kwargs: dict) -> Any:
        import torch.utils._pytree as pytree

        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise KilnError(f"kiln.torch: called with arguments of another structure than the example inputs")
        with torch.no_grad():
            outs = self.graph_module.forward(*flat)
        return self._unflatten(outs)

    def _unflatten(self, outs: Any) -> Any:
        import torch.utils._pytree as pytree

        return pytree.tree_unflatten(list(outs), self._out_spec) if self._out_spec is not None else outs


def _direct_forward(fused: fx.GraphModule) -> "Callable | None":
    """What fused.forward computes, without FX's generated code and the part's nn.Module call,
    when the graph is its inputs into one Kiln part whose results are the outputs (Kiln took
    the whole model; weights the part ignores may be passed to it). None otherwise."""
    part_node, placeholders, output = None, [], None
    for node in fused.graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node)
        elif node.op == "output":
            output = node
        elif node.op == "call_module" and part_node is None and \
                isinstance(getattr(fused, node.target, None), KilnGraphModule):
            part_node = node
        elif node.op != "get_attr" and not (node.target is operator.getitem and node.args[0] is part_node):
            return None
    if part_node is None or output is None or not isinstance(output.args[0], (tuple, list)):
        return None
    part = getattr(fused, part_node.target)
    if any(not isinstance(part_node.args[i], fx.Node) or part_node.args[i].op != "placeholder"
           for i in part.tensor_inputs):
        return None
    inputs = [placeholders.index(part_node.args[i]) for i in part.tensor_inputs]
    order = []
    for out in output.args[0]:
        if out is part_node and part.single:
            order.append(0)
        elif isinstance(out, fx.Node) and out.target is operator.getitem and out.args[0] is part_node:
            order.append(out.args[1])
        else:
            return None
    run = part.run_tensors
    if order == [0] and len(inputs) == 1:  # one tensor in, one out: the common case
        (first,) = inputs
        return lambda *args: (run([args[first]])[0],)
    return lambda *args: tuple(map(run([args[i] for i in inputs]).__getitem__, order))


def _leaf_marks(spec: Any) -> tuple:
    """`spec` filled with distinct markers, and the markers."""
    import torch.utils._pytree as pytree

    marks = [object() for _ in range(spec.num_leaves)]
    return pytree.tree_unflatten(marks, spec), marks


def _positional_count(in_spec: Any) -> int:
    """n when the call takes n positional leaves and no keywords; -1 otherwise."""
    if in_spec is None:
        return -1
    tree, marks = _leaf_marks(in_spec)
    ok = isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[0], tuple) and tree[1] == {} and \
        len(tree[0]) == len(marks) and all(a is b for a, b in zip(tree[0], marks))
    return len(marks) if ok else -1


def _output_kind(out_spec: Any) -> str:
    """"one" for a single leaf, "tuple" for a flat tuple of leaves, else "tree"."""
    if out_spec is None:
        return "tree"
    tree, marks = _leaf_marks(out_spec)
    if len(marks) == 1 and tree is marks[0]:
        return "one"
    if type(tree) is tuple and len(tree) == len(marks) and all(a is b for a, b in zip(tree, marks)):
        return "tuple"
    return "tree"


def compile_module(module: torch.nn.Module, example_inputs: Sequence[Any], *, dynamic_shapes: Any = None,
                   backend: str = "cpu", targets: Sequence[str] = (), pipeline: Any = None,
                   passes: str | None = None) -> CompiledModule:
    """Compiles `module` for the inputs' types (and the dims `dynamic_shapes` makes dynamic, as
    torch.export takes them) into a callable nn.Module. Kiln runs the parts of the graph it
    lowers; PyTorch runs the rest. backend: "cpu" or "reference" (in this process); targets
    (e.g. ["sm_90a"]): GPU artifacts, one per set of input sizes, on a kiln.Runtime.
    pipeline / passes: as kiln.compile; default: the standard passes in this process, and for
    GPU targets gpu_pipeline (the shipped CUDA pipelines' passes, TF32 as PyTorch's flags say)."""
    module = module.eval()

    def build(inputs: tuple) -> tuple:
        gm, ep = _aten_graph(module, inputs, dynamic_shapes)
        return _partition(gm, backend, targets, pipeline, passes), ep

    return CompiledModule(module, *build(tuple(example_inputs)), rebuild=build)


# ---- torch.compile(backend="kiln") ------------------------------------------------------------

# How often a graph's Kiln parts are rebuilt for weights changed since they were frozen before
# the graph runs in PyTorch for good (weights updated on every call: Kiln would only recompile).
_MAX_REBUILDS = 2


class _FrozenForward:
    """AOTAutograd's forward graph with its weights frozen into Kiln's parts, and what the
    per-call path needs: `forward` over the non-weight inputs (`keep`), and `watch`, which says
    whether every weight is still the tensor it froze, at the same address and not written since
    (_kiln._WeightWatch). When a weight changed, `changed` rebuilds the parts from the new
    weights (at most _MAX_REBUILDS times, then PyTorch runs the graph): a changed weight is never
    run stale."""

    def __init__(self, original: fx.GraphModule, weights: dict, lifted: int, backend: str, targets: Sequence[str],
                 pipeline: Any, passes: str | None):
        self.original, self.lifted = original, lifted
        self.options = (backend, targets, pipeline, passes)
        self.names = [n.name for n in original.graph.nodes if n.op == "placeholder"]
        self.specs = {j: (t.shape, t.stride(), t.dtype, t.device) for j, t in weights.items()}
        self.keep = [j for j in range(len(self.names)) if j not in weights]
        self.direct_keep = [j - lifted for j in self.keep]
        self.rebuilds = 0
        self.in_pytorch = False
        self._freeze(weights)

    def _freeze(self, weights: dict) -> None:
        import copy

        from torch._subclasses.fake_tensor import unset_fake_temporarily

        gm = fx.GraphModule(self.original, copy.deepcopy(self.original.graph))
        with unset_fake_temporarily(), torch.no_grad():
            _freeze_params(gm, {self.names[j]: t.detach() for j, t in weights.items()})
            fused = _partition(gm, *self.options)
        parts = [m for m in fused.children() if isinstance(m, KilnGraphModule)]
        # The parts of the latest graph compiled, for tests and for looking at what Kiln runs.
        kiln_backend.last_parts = parts
        kiln_backend.last_left_in_pytorch = fused.kiln_left_in_pytorch
        self.forward = _direct_forward(fused) or fused.forward  # fx's __call__ wrapper costs ~4 us a call
        tensors = list(weights.values())
        self.watch = kiln._kiln._WeightWatch(tensors, list(weights))
        self.direct_watch = kiln._kiln._WeightWatch(tensors, [j - self.lifted if j >= self.lifted else -1
                                                               for j in weights])

    def changed(self, args: list) -> Any:
        """The outputs for `args` (every input of the forward graph) when a weight changed."""
        if self.in_pytorch:
            return self.original.forward(*args)
        weights = {j: args[j] for j in self.specs}
        for j, t in weights.items():
            if not isinstance(t, torch.Tensor) or (t.shape, t.stride(), t.dtype, t.device) != self.specs[j]:
                raise KilnError(f"kiln: weight '{self.names[j]}' changed shape, layout, dtype or device since "
                                "it was compiled; compile again (torch._dynamo.reset())")
        if self.rebuilds >= _MAX_REBUILDS:
            warnings.warn(f"kiln: weights changed {self.rebuilds + 1} times since they were frozen; this graph "
                          "runs in PyTorch from now on")
            self.in_pytorch = True
            self.watch = self.direct_watch = _NEVER_UNCHANGED
            return self.original.forward(*args)
        self.rebuilds += 1
        self._freeze(weights)
        return self.forward(*[args[i] for i in self.keep])


_NO_ARGS = ()


class _NeverUnchanged:
    @staticmethod
    def unchanged(args: Any) -> bool:
        return False


_NEVER_UNCHANGED = _NeverUnchanged()


def kiln_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **unused: Any) -> Callable:
    """The dynamo backend: AOTAutograd turns the captured graph into core ATen, whose
    parameter inputs become constants; then the supported parts are compiled as in
    compile_module. options (torch.compile(..., options={...})): backend, targets, pipeline,
    passes. Graphs that need gradients run in PyTorch (Kiln compiles inference)."""
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    options = dict(options or {})
    unknown = set(options) - {"backend", "targets", "pipeline", "passes"}
    if unknown:
        raise KilnError(f"kiln: unknown option {sorted(unknown)[0]!r}; options: backend, targets, pipeline, passes")
    backend = options.get("backend", "cpu")
    targets = options.get("targets", ())
    pipeline = options.get("pipeline")
    passes = options.get("passes")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {i for i, (n, x) in enumerate(zip(placeholders, example_inputs))
              if isinstance(x, torch.nn.Parameter) or "_parameters_" in n.name or "_buffers_" in n.name}
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        warnings.warn("kiln: this graph needs gradients; it runs in PyTorch (compile under torch.no_grad() "
                      "or torch.inference_mode() for Kiln)")
        return gm.forward

    param_values = {i: example_inputs[i] for i in params}
    _contiguous_attention_masks(gm)
    direct: list = []  # the forward dynamo can call without AOTAutograd's runtime wrapper, if any
    # Read here: AOTAutograd switches autocast off while it traces (and its wrapper, around the calls).
    plain_mode = not torch.is_grad_enabled() and not torch._C._is_any_autocast_enabled()

    def forward_compiler(fw: fx.GraphModule, fw_inputs: list) -> Callable:
        import copy

        from torch._subclasses.fake_tensor import unset_fake_temporarily

        original = fx.GraphModule(fw, copy.deepcopy(fw.graph))
        with unset_fake_temporarily():  # AOTAutograd calls this under fake tensors; Kiln needs real weights
            try:
                return compile_forward(fw, original)
            except Exception as e:  # the graph runs in PyTorch rather than failing the model
                warnings.warn(f"kiln: the graph stays in PyTorch: {type(e).__name__}: {e}")
                return make_boxed_func(original.forward)

    def compile_forward(fw: fx.GraphModule, original: fx.GraphModule) -> Callable:
        from torch._guards import TracingContext

        n_inputs = sum(1 for n in fw.graph.nodes if n.op == "placeholder")
        # Parameters dynamo installed in its graph (rather than passing them) come first, lifted
        # by AOTAutograd, which passes them on every call.
        lifted = n_inputs - len(placeholders)
        held = list(getattr(TracingContext.get(), "params_flat", None) or []) if lifted > 0 else []
        if lifted < 0 or len(held) != lifted:
            return make_boxed_func(fw.forward)  # an unexpected calling convention: stay in PyTorch
        weights = {j: t for j, t in enumerate(held)}
        weights.update({lifted + i: param_values[i] for i in params})
        frozen = _FrozenForward(original, weights, lifted, backend, targets, pipeline, passes)
        kiln_backend.last_forward = frozen

        def run(args: list) -> Any:
            f = frozen
            outs = f.forward(*[args[i] for i in f.keep]) if f.watch.unchanged(args) else f.changed(args)
            args.clear()
            return outs

        run._boxed_call = True
        if plain_mode and _wrapper_passes_through():
            # Dynamo's arguments are the forward's less the lifted weights, which are held.
            def call(*args: Any) -> Any:
                f = frozen
                if f.direct_watch.unchanged(args):
                    return f.forward(*[args[i] for i in f.direct_keep])
                return f.changed(held + list(args))
            direct.append(call)
        return run

    # Attention stays one op (Kiln's fused attention) rather than core ATen's matmul/softmax.
    decompositions = {op: fn for op, fn in core_aten_decompositions().items() if op not in _FIRST_RESULT_ONLY}
    compiled = aot_autograd(fw_compiler=forward_compiler, decompositions=decompositions)(gm, example_inputs)
    kiln_backend.last_called_directly = bool(direct)
    return direct[0] if direct else compiled


def _wrapper_passes_through() -> bool:
    """Whether AOTAutograd's runtime wrapper around the forward being compiled would only pass
    arguments and results through, given gradients and autocast off when dynamo called the
    backend (the wrapper switches autocast off around a graph traced with it): no input mutated
    (nothing to copy back), every output a new tensor (no alias of an input or of another output
    to rebuild), no effect tokens, RNG states or grad-mode change, no tensor subclasses. Then
    dynamo can call the forward directly (about 2 us a call less on the development machine);
    otherwise, or when PyTorch's metadata reads differently than here (another version), the
    wrapper stays."""
    try:
        from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
        from torch._guards import TracingContext

        meta = TracingContext.get().fw_metadata
        return (not meta.tokens and meta.num_intermediate_bases == 0
                and getattr(meta, "grad_enabled_mutation", None) is None
                and not getattr(meta, "num_graphsafe_rng_states", 0)
                and not any(isinstance(m, SubclassCreationMeta) for m in meta.subclass_inp_meta)
                and not any(getattr(i, "mutates_data", True) or getattr(i, "mutates_metadata", True)
                            or getattr(i, "mutates_storage_metadata", False) for i in meta.input_info)
                and all(o.output_type == OutputType.non_alias for o in meta.output_info))
    except Exception:
        return False


kiln_backend.last_parts = []
kiln_backend.last_left_in_pytorch = {}
kiln_backend.last_called_directly = False  # the latest graph's forward called without AOTAutograd's wrapper
kiln_backend.last_forward = None  # the latest graph's _FrozenForward: its weights' watch, its forward


_SDPA_FUNCTIONS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


def _contiguous_attention_masks(gm: fx.GraphModule) -> int:
    """Makes each attention mask whose last dim is strided (an expanded [B, 1, S, 1] mask, as
    transformers' BERT builds it) contiguous before scaled_dot_product_attention sees it, and
    returns how many. On CUDA, PyTorch's fused attention kernels need the mask's last stride to
    be 1; otherwise SDPA falls back to its math form (matmul, safe softmax, matmul), which
    AOTAutograd then records instead of the one attention op Kiln runs as fused attention. A
    mask computed from constants still folds into a constant; the result is the same."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_FUNCTIONS:
            continue
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        val = mask.meta.get("example_value") if isinstance(mask, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.stride(-1) == 1 or val.shape[-1] == 1:
            continue
        with gm.graph.inserting_before(node):
            dense = gm.graph.call_method("contiguous", (mask,))
        dense.meta = {k: v for k, v in mask.meta.items() if k != "example_value"}
        node.replace_input_with(mask, dense)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _register_dynamo_backend() -> None:
    """torch.compile(backend="kiln") without an installed package's entry point (a build tree
    on PYTHONPATH); an installed package registers through `torch_dynamo_backends`."""
    try:
        from torch._dynamo.backends import registry

        registry._lazy_import()  # entry points first, so an installed kiln is not registered twice
        if "kiln" not in registry._BACKENDS:
            registry.register_backend(compiler_fn=kiln_backend, name="kiln")
    except (ImportError, AttributeError):  # private API moved: torch.compile(backend=kiln_backend) still works
        pass


_register_dynamo_backend()
