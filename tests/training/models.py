"""Small training tasks for `kiln train`, each with a NumPy float64 reference of the same model,
loss and optimizer (forward, hand-written backward, optimizer step), so that a Kiln run can be
compared step by step with an implementation that shares no code with Kiln.

  gpt: a GPT-2-style decoder (token + position embeddings, pre-norm blocks of causal attention and
       a tanh-gelu MLP, final norm, head tied to the token embedding), cross-entropy, AdamW with
       decoupled weight decay and gradient clipping by global norm.
  mlp: a two-layer tanh regression net, mean squared error, SGD with Nesterov momentum and weight
       decay.

Used by train_curve.py (CI) and bench/training/torch_reference.py (against PyTorch).
"""
import io
import struct

import numpy as np


def f32(a):
    """Rounds to float32 and back: Kiln's f32 weights and the float64 reference start equal."""
    return np.asarray(a, dtype=np.float32).astype(np.float64)


# --- .kir emission --------------------------------------------------------------------------


def fmt_type(dtype, shape):
    return f"{dtype}[{', '.join(str(s) for s in shape)}]"


def fmt_attr(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, float):
        return repr(v) if "." in repr(v) or "e" in repr(v) else repr(v) + ".0"
    if isinstance(v, str):
        return v if v in ("f32", "f64", "i64", "i32") else '"' + v + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt_attr(x) for x in v) + "]"
    raise TypeError(v)


def read_checkpoint(path):
    """A `kiln train --checkpoint` file (kiln/core/checkpoint.h's format): name -> array."""
    blob = open(path, "rb").read()
    assert blob[:8] == b"KILNCKPT", path
    _, count = struct.unpack_from("<II", blob, 8)
    at, out = 16, {}
    for _ in range(count):
        (n,) = struct.unpack_from("<I", blob, at)
        name = blob[at + 4: at + 4 + n].decode()
        at += 4 + n + 1
        (length,) = struct.unpack_from("<Q", blob, at)
        at += 8
        out[name] = np.load(io.BytesIO(blob[at: at + length]))
        at += length
    return out


class Kir:
    """Writes a .kir graph one node at a time; each node's result type is given by the caller."""

    def __init__(self, name):
        self.name, self.inputs, self.lines, self.count = name, [], [], 0

    def input(self, name, dtype, shape):
        self.inputs.append(f"%{name}: {fmt_type(dtype, shape)}")
        return name

    def node(self, op, operands, dtype, result_shape, name=None, **attrs):
        if name is None:
            self.count += 1
            name = f"v{self.count}"
        a = ", ".join(f"{k} = {fmt_attr(v)}" for k, v in sorted(attrs.items()))
        args = ", ".join("%" + o for o in operands)
        self.lines.append(f"  %{name} = {op}({args}){' {' + a + '}' if a else ''} : {fmt_type(dtype, result_shape)}")
        return name

    def const(self, name, value):
        value = np.asarray(value, dtype=np.float32)
        vals = ", ".join(repr(float(x)) for x in value.reshape(-1))
        t = fmt_type("f32", value.shape)
        self.lines.append(f"  %{name} = constant() {{value = dense<{t}>[{vals}]}} : {t}")
        return name

    def text(self, output, dtype, shape):
        return (f"graph @{self.name}({', '.join(self.inputs)}) -> (%{output}: {fmt_type(dtype, shape)}) {{\n"
                + "\n".join(self.lines) + f"\n  return %{output}\n}}\n")


# --- shared numpy pieces --------------------------------------------------------------------


def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    rstd = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    return xhat * g + b, (xhat, rstd, g)


def layer_norm_back(dy, cache):
    xhat, rstd, g = cache
    dxhat = dy * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    red = tuple(range(dy.ndim - 1))
    return dx, (dy * xhat).sum(red), dy.sum(red)


def linear_back(dy, x, w):
    """y = x @ w.T + b: gradients of x, w, b."""
    return dy @ w, dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]).sum(0)


GELU_C = np.sqrt(2 / np.pi)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))


def gelu_tanh_back(dy, x):
    t = np.tanh(GELU_C * (x + 0.044715 * x ** 3))
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * x * x))


class AdamW:
    """torch.optim.AdamW's single-tensor update, in float64."""

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, weight_decay
        self.m, self.v, self.t = {}, {}, 0

    def step(self, params, grads):
        self.t += 1
        for k in params:
            g = grads[k]
            m = self.m.setdefault(k, np.zeros_like(g))
            v = self.v.setdefault(k, np.zeros_like(g))
            params[k] = params[k] * (1 - self.lr * self.wd)
            m += (1 - self.b1) * (g - m)
            v *= self.b2
            v += (1 - self.b2) * g * g
            denom = np.sqrt(v) / np.sqrt(1 - self.b2 ** self.t) + self.eps
            params[k] = params[k] - (self.lr / (1 - self.b1 ** self.t)) * m / denom


class Sgd:
    """torch.optim.SGD (dampening 0), in float64."""

    def __init__(self, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
        self.lr, self.mu, self.nesterov, self.wd, self.buf = lr, momentum, nesterov, weight_decay, {}

    def step(self, params, grads):
        for k in params:
            d = grads[k] + self.wd * params[k]
            if self.mu:
                buf = self.buf.get(k)
                buf = d.copy() if buf is None else self.mu * buf + d
                self.buf[k] = buf
                d = d + self.mu * buf if self.nesterov else buf
            params[k] = params[k] - self.lr * d


def clip_by_global_norm(grads, max_norm):
    total = np.sqrt(sum((g * g).sum() for g in grads.values()))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return {k: g * coef for k, g in grads.items()}


# --- the GPT task ---------------------------------------------------------------------------


class Gpt:
    V, T, B, D, H, LAYERS = 32, 8, 4, 16, 2, 2
    LR, WD, CLIP = 3e-3, 0.01, 1.0
    PIPELINE_OPTIMIZER = f'{{ algorithm = "adamw", lr = {LR}, weight-decay = {WD}, max-grad-norm = {CLIP} }}'

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        d, V, T = self.D, self.V, self.T
        p = {"wte": rng.normal(0, 0.02, (V, d)), "wpe": rng.normal(0, 0.02, (T, d))}
        for i in range(self.LAYERS):
            p.update({f"l{i}.ln1.g": np.ones(d), f"l{i}.ln1.b": np.zeros(d),
                      f"l{i}.qkv.w": rng.normal(0, 0.02, (3 * d, d)), f"l{i}.qkv.b": np.zeros(3 * d),
                      f"l{i}.proj.w": rng.normal(0, 0.02 / np.sqrt(2 * self.LAYERS), (d, d)), f"l{i}.proj.b": np.zeros(d),
                      f"l{i}.ln2.g": np.ones(d), f"l{i}.ln2.b": np.zeros(d),
                      f"l{i}.fc.w": rng.normal(0, 0.02, (4 * d, d)), f"l{i}.fc.b": np.zeros(4 * d),
                      f"l{i}.out.w": rng.normal(0, 0.02 / np.sqrt(2 * self.LAYERS), (d, 4 * d)), f"l{i}.out.b": np.zeros(d)})
        p.update({"lnf.g": np.ones(d), "lnf.b": np.zeros(d)})
        self.params = {k: f32(v) for k, v in p.items()}

    @classmethod
    def batches(cls, steps, seed=1):
        """Token streams where the next token is mostly (token * 5 + 3) mod V: learnable."""
        rng = np.random.default_rng(seed)
        toks = np.zeros((steps, cls.B, cls.T + 1), dtype=np.int64)
        toks[:, :, 0] = rng.integers(0, cls.V, (steps, cls.B))
        for t in range(1, cls.T + 1):
            noise = rng.random((steps, cls.B)) < 0.1
            toks[:, :, t] = np.where(noise, rng.integers(0, cls.V, (steps, cls.B)), (toks[:, :, t - 1] * 5 + 3) % cls.V)
        return {"tokens": toks[:, :, :-1], "targets": toks[:, :, 1:]}

    def kir(self, writer=None):
        """The model as .kir text; `writer` (a Kir subclass) may store the weights elsewhere."""
        B, T, d, H, V = self.B, self.T, self.D, self.H, self.V
        hd = d // H
        k = (writer or Kir)("gpt")
        k.input("tokens", "i64", [B, T])
        k.input("targets", "i64", [B, T])
        for name, value in self.params.items():
            k.const(name, value)
        h = k.node("gather", ["wte", "tokens"], "f32", [B, T, d], axis=0)
        h = k.node("add", [h, "wpe"], "f32", [B, T, d])
        heads = lambda x: k.node("transpose", [k.node("reshape", [x], "f32", [B, T, H, hd], shape=[B, T, H, hd])],
                                 "f32", [B, H, T, hd], perm=[0, 2, 1, 3])
        for i in range(self.LAYERS):
            a = k.node("layer_norm", [h, f"l{i}.ln1.g", f"l{i}.ln1.b"], "f32", [B, T, d], epsilon=1e-5)
            qkv = k.node("linear", [a, f"l{i}.qkv.w", f"l{i}.qkv.b"], "f32", [B, T, 3 * d])
            q, kk, v = f"l{i}.q", f"l{i}.k", f"l{i}.v"
            k.lines.append(f"  %{q}, %{kk}, %{v} = split(%{qkv}) {{axis = 2, sizes = [{d}, {d}, {d}]}} : "
                           + ", ".join([fmt_type("f32", [B, T, d])] * 3))
            y = k.node("attention", [heads(q), heads(kk), heads(v)], "f32", [B, H, T, hd], scale=float(1 / np.sqrt(hd)), causal=1)
            y = k.node("reshape", [k.node("transpose", [y], "f32", [B, T, H, hd], perm=[0, 2, 1, 3])], "f32", [B, T, d],
                       shape=[B, T, d])
            h = k.node("add", [h, k.node("linear", [y, f"l{i}.proj.w", f"l{i}.proj.b"], "f32", [B, T, d])], "f32", [B, T, d])
            m = k.node("layer_norm", [h, f"l{i}.ln2.g", f"l{i}.ln2.b"], "f32", [B, T, d], epsilon=1e-5)
            f = k.node("gelu", [k.node("linear", [m, f"l{i}.fc.w", f"l{i}.fc.b"], "f32", [B, T, 4 * d])], "f32",
                       [B, T, 4 * d], approximate="tanh")
            h = k.node("add", [h, k.node("linear", [f, f"l{i}.out.w", f"l{i}.out.b"], "f32", [B, T, d])], "f32", [B, T, d])
        h = k.node("layer_norm", [h, "lnf.g", "lnf.b"], "f32", [B, T, d], epsilon=1e-5)
        logits = k.node("linear", [h, "wte"], "f32", [B, T, V], name="logits")
        k.node("cross_entropy", [logits, "targets"], "f32", [], name="loss")
        return k.text("loss", "f32", [])

    def loss_and_grads(self, tokens, targets):
        p, B, T, d, H = self.params, self.B, self.T, self.D, self.H
        hd = d // H
        g = {k: np.zeros_like(v) for k, v in p.items()}
        h = p["wte"][tokens] + p["wpe"]
        caches = []
        split_heads = lambda x: x.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(self.LAYERS):
            c = {"h_in": h}
            a, c["ln1"] = layer_norm(h, p[f"l{i}.ln1.g"], p[f"l{i}.ln1.b"])
            qkv = a @ p[f"l{i}.qkv.w"].T + p[f"l{i}.qkv.b"]
            q, kk, v = (split_heads(x) for x in np.split(qkv, 3, axis=-1))
            s = q @ kk.transpose(0, 1, 3, 2) / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            pr = s / s.sum(-1, keepdims=True)
            y = (pr @ v).transpose(0, 2, 1, 3).reshape(B, T, d)
            h = h + y @ p[f"l{i}.proj.w"].T + p[f"l{i}.proj.b"]
            m, c["ln2"] = layer_norm(h, p[f"l{i}.ln2.g"], p[f"l{i}.ln2.b"])
            u = m @ p[f"l{i}.fc.w"].T + p[f"l{i}.fc.b"]
            f = gelu_tanh(u)
            h = h + f @ p[f"l{i}.out.w"].T + p[f"l{i}.out.b"]
            c.update(a=a, q=q, k=kk, v=v, pr=pr, y=y, m=m, u=u, f=f)
            caches.append(c)
        hf, lnf = layer_norm(h, p["lnf.g"], p["lnf.b"])
        logits = hf @ p["wte"].T
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        n = tokens.size
        loss = -np.take_along_axis(logp, targets[..., None], -1).sum() / n
        dlogits = np.exp(logp)
        np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
        dlogits /= n
        dhf, g["wte"], _ = linear_back(dlogits, hf, p["wte"])
        dh, g["lnf.g"], g["lnf.b"] = layer_norm_back(dhf, lnf)
        merge_heads = lambda x: x.transpose(0, 2, 1, 3).reshape(B, T, d)
        for i in reversed(range(self.LAYERS)):
            c = caches[i]
            df, g[f"l{i}.out.w"], g[f"l{i}.out.b"] = linear_back(dh, c["f"], p[f"l{i}.out.w"])
            dm, g[f"l{i}.fc.w"], g[f"l{i}.fc.b"] = linear_back(gelu_tanh_back(df, c["u"]), c["m"], p[f"l{i}.fc.w"])
            dx, g[f"l{i}.ln2.g"], g[f"l{i}.ln2.b"] = layer_norm_back(dm, c["ln2"])
            dh = dh + dx
            dy, g[f"l{i}.proj.w"], g[f"l{i}.proj.b"] = linear_back(dh, c["y"], p[f"l{i}.proj.w"])
            dy = split_heads(dy)
            pr, q, kk, v = c["pr"], c["q"], c["k"], c["v"]
            dv = pr.transpose(0, 1, 3, 2) @ dy
            dp = dy @ v.transpose(0, 1, 3, 2)
            ds = pr * (dp - (dp * pr).sum(-1, keepdims=True)) / np.sqrt(hd)
            dq, dk = ds @ kk, ds.transpose(0, 1, 3, 2) @ q
            dqkv = np.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], -1)
            da, g[f"l{i}.qkv.w"], g[f"l{i}.qkv.b"] = linear_back(dqkv, c["a"], p[f"l{i}.qkv.w"])
            dx, g[f"l{i}.ln1.g"], g[f"l{i}.ln1.b"] = layer_norm_back(da, c["ln1"])
            dh = dh + dx
        np.add.at(g["wte"], tokens, dh)
        g["wpe"] = dh.sum(0)
        return loss, g

    def reference_losses(self, data, steps):
        opt = AdamW(self.LR, weight_decay=self.WD)
        losses = []
        for s in range(steps):
            loss, grads = self.loss_and_grads(data["tokens"][s % len(data["tokens"])], data["targets"][s % len(data["targets"])])
            losses.append(loss)
            opt.step(self.params, clip_by_global_norm(grads, self.CLIP))
        return np.array(losses)


# --- the MLP task ---------------------------------------------------------------------------


class Mlp:
    B, IN, HID, OUT = 16, 8, 32, 4
    LR, MOMENTUM, WD = 0.05, 0.9, 1e-4
    PIPELINE_OPTIMIZER = f'{{ algorithm = "sgd", lr = {LR}, momentum = {MOMENTUM}, nesterov = true, weight-decay = {WD} }}'

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.params = {k: f32(v) for k, v in {
            "w1": rng.normal(0, 1 / np.sqrt(self.IN), (self.HID, self.IN)), "b1": np.zeros(self.HID),
            "w2": rng.normal(0, 1 / np.sqrt(self.HID), (self.OUT, self.HID)), "b2": np.zeros(self.OUT)}.items()}

    @classmethod
    def batches(cls, steps, seed=1):
        rng = np.random.default_rng(seed)
        x = rng.normal(0, 1, (steps, cls.B, cls.IN))
        teacher = rng.normal(0, 1, (cls.IN, cls.OUT))
        return {"x": f32(x).astype(np.float32), "y": f32(np.sin(x @ teacher)).astype(np.float32)}

    def kir(self):
        k = Kir("mlp")
        k.input("x", "f32", [self.B, self.IN])
        k.input("y", "f32", [self.B, self.OUT])
        for name, value in self.params.items():
            k.const(name, value)
        h = k.node("tanh", [k.node("linear", ["x", "w1", "b1"], "f32", [self.B, self.HID])], "f32", [self.B, self.HID])
        out = k.node("linear", [h, "w2", "b2"], "f32", [self.B, self.OUT])
        k.node("mse_loss", [out, "y"], "f32", [], name="loss")
        return k.text("loss", "f32", [])

    def loss_and_grads(self, x, y):
        p = self.params
        x, y = x.astype(np.float64), y.astype(np.float64)
        u = x @ p["w1"].T + p["b1"]
        h = np.tanh(u)
        out = h @ p["w2"].T + p["b2"]
        loss = ((out - y) ** 2).mean()
        dout = 2 * (out - y) / out.size
        dh, gw2, gb2 = linear_back(dout, h, p["w2"])
        _, gw1, gb1 = linear_back(dh * (1 - h * h), x, p["w1"])
        return loss, {"w1": gw1, "b1": gb1, "w2": gw2, "b2": gb2}

    def reference_losses(self, data, steps):
        opt = Sgd(self.LR, self.MOMENTUM, nesterov=True, weight_decay=self.WD)
        losses = []
        for s in range(steps):
            loss, grads = self.loss_and_grads(data["x"][s % len(data["x"])], data["y"][s % len(data["y"])])
            losses.append(loss)
            opt.step(self.params, grads)
        return np.array(losses)


TASKS = {"gpt": Gpt, "mlp": Mlp}
