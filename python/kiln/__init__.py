"""Kiln for Python: compile models (model files, graphs built in Python, PyTorch modules) with
Kiln's pipelines and run them on NumPy arrays and torch tensors.

    import kiln
    art = kiln.compile("model.onnx", targets=["sm_90a"], symbols={"B": 8})
    art.save("model.kiln")
    model = kiln.Runtime().load(art)          # needs a GPU
    (y,) = model.run([x])

    cpu = kiln.compile("model.kir", backend="cpu", symbols={"B": 8})   # runs in this process
    (y,) = cpu.run({"x": x})

PyTorch: `kiln.torch.compile_module(module, example_inputs)` and
`torch.compile(module, backend="kiln")` (docs/python.md).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping, Sequence


def _share_pytorchs_nccl() -> None:
    """PyTorch's wheels bring an NCCL newer than the CUDA toolkit's, and PyTorch needs its
    newer symbols. Kiln's runtime links libnccl.so.2 too: whichever loads first serves both, so
    load the wheel's first; otherwise `import torch` after `import kiln` fails."""
    import ctypes
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return
    for folder in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(folder, "nccl", "lib", "libnccl.so.2")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


_share_pytorchs_nccl()
from . import _kiln  # noqa: E402
from ._kiln import Graph, KilnError, Pipeline, Value, __version__, load_plugins, plugins  # noqa: E402

__all__ = [
    "Artifact", "CompiledModel", "Graph", "KilnError", "Model", "Pipeline", "Runtime", "Value",
    "compile", "load_plugins", "plugins", "__version__",
]

_here = os.path.dirname(os.path.abspath(__file__))
# Installed wheel: kiln/lib/kiln/plugins; build tree: build/python/kiln next to build/lib/kiln/plugins.
_kiln._set_plugin_dirs([
    os.path.join(_here, "lib", "kiln", "plugins"),
    os.path.normpath(os.path.join(_here, "..", "..", "lib", "kiln", "plugins")),
])


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def _ordered(interface: list, inputs: Any) -> list:
    """The inputs in the model's order, from a list, a dict by name or one array."""
    if isinstance(inputs, Mapping):
        names = [i["name"] for i in interface]
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise KilnError(f"unknown input {unknown[0]!r}; the model's inputs: {', '.join(names)}")
        missing = [n for n in names if n not in inputs]
        if missing:
            raise KilnError(f"input {missing[0]!r} not given")
        return [inputs[n] for n in names]
    if not isinstance(inputs, (list, tuple)):
        return [inputs]
    return list(inputs)


def _host_inputs(inputs: list) -> tuple[list, bool, Any]:
    """The inputs (in the model's order) as C-contiguous host arrays, whether torch tensors were
    given (outputs are then torch tensors), and the device those were on."""
    import numpy as np

    arrays, torch_out, device = [], False, None
    for x in inputs:
        if type(x) is np.ndarray:
            arrays.append(x if x.flags.c_contiguous else np.ascontiguousarray(x))
        elif _is_torch(x):
            torch_out = True
            device = x.device
            x = x.detach()
            if x.device.type != "cpu":
                x = x.cpu()  # Model.run takes host memory; CUDA tensors make a round trip
            arrays.append(x.contiguous())
        else:
            arrays.append(np.ascontiguousarray(x))
    return arrays, torch_out, device


def _outputs(outs: list, torch_out: bool, device: Any) -> list:
    if torch_out and device is not None and device.type != "cpu":
        return [o.to(device) for o in outs]
    return outs


class _Runnable:
    """What CompiledModel and Model share: the interface and run()."""

    _impl: Any

    @property
    def inputs(self) -> list:
        """[{name, dtype, shape}] in the order run() takes them."""
        return self._impl.inputs

    @property
    def outputs(self) -> list:
        return self._impl.outputs

    def run(self, inputs: Any) -> list:
        """Runs on NumPy arrays or torch tensors (a list in input order, a dict by name, or
        one array); returns the outputs as NumPy arrays, or torch tensors when given torch.
        CUDA tensors are copied through host memory."""
        xs = inputs if type(inputs) is list else _ordered(self._impl.inputs, inputs)
        # Dense host torch tensors go in and out without per-input Python (None: not those).
        outs = self._impl._run_torch(xs)
        return outs if outs is not None else self._run_host(xs)

    def _run_host(self, xs: list) -> list:
        arrays, torch_out, device = _host_inputs(xs)
        return _outputs(self._impl._run(arrays, torch_out), torch_out, device)

    def __call__(self, inputs: Any) -> list:
        return self.run(inputs)


class CompiledModel(_Runnable):
    """A model compiled for this process by the `reference` or `cpu` backend."""

    def __init__(self, impl: Any):
        self._impl = impl

    @property
    def pipeline(self) -> str:
        """The canonical one-line pipeline it was compiled with."""
        return self._impl.pipeline


class Artifact:
    """A compiled .kiln artifact: kernel images for each target, the plan and the weights."""

    def __init__(self, impl: Any):
        self._impl = impl

    @staticmethod
    def load(path: str | os.PathLike) -> "Artifact":
        """Reads and checks a .kiln file."""
        return Artifact(_kiln.Artifact.load(os.fspath(path)))

    @staticmethod
    def from_bytes(data: bytes) -> "Artifact":
        return Artifact(_kiln.Artifact.from_bytes(data))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the artifact (through a temporary file and a rename)."""
        self._impl.save(os.fspath(path))

    def to_bytes(self) -> bytes:
        return self._impl.to_bytes()

    def inspect(self) -> dict:
        """What `kiln inspect --json` prints: version, targets, pipeline, images, inputs, outputs."""
        return json.loads(self._impl._describe_json())

    def __len__(self) -> int:
        return len(self._impl)

    def __str__(self) -> str:
        return str(self._impl)


class Model(_Runnable):
    """An artifact loaded on a GPU by a Runtime. One call at a time."""

    def __init__(self, impl: Any, runtime: "Runtime"):
        self._impl = impl
        self._runtime = runtime  # the runtime outlives its models
        self._cuda = None  # (input specs, output specs) as torch dtypes and sizes, made on first use

    def memory_report(self) -> dict:
        """Device bytes Kiln holds for the model, by category (kiln_memory_report)."""
        return self._impl.memory_report()

    def run(self, inputs: Any) -> list:
        """As CompiledModel.run. CUDA tensors (all inputs on the runtime's device) stay on the
        device: the run is ordered on PyTorch's current stream and returns CUDA tensors without
        waiting (kiln_model_run_device); other inputs go through host memory."""
        xs = inputs if type(inputs) is list else _ordered(self._impl.inputs, inputs)
        # Dense torch tensors of the model's types, all on the host or all on this GPU: the
        # whole call is in C++ (None: not those; the paths below convert, copy or explain).
        outs = self._impl._run_torch(xs)
        if outs is not None:
            return outs
        torch = sys.modules.get("torch")  # never imported here: CUDA tensors mean it is loaded
        if xs and torch is not None and all(isinstance(x, torch.Tensor) and x.is_cuda for x in xs):
            return self._run_cuda(xs)
        return self._run_host(xs)

    def _cuda_interface(self) -> tuple:
        """(inputs as (dtype, shape), outputs as (dtype, shape), a device's current raw stream,
        torch.empty, the runtime's torch.device) in torch's terms, made once: the CUDA path
        below runs per call."""
        import torch

        def spec(info):
            return getattr(torch, _TORCH_DTYPES[info["dtype"]]), torch.Size(info["shape"])

        try:  # what torch.cuda.current_stream(i).cuda_stream is, without making a Stream object
            from torch._C import _cuda_getCurrentRawStream as raw_stream
        except ImportError:
            def raw_stream(index):
                return torch.cuda.current_stream(index).cuda_stream
        self._cuda = ([spec(i) for i in self._impl.inputs], [spec(o) for o in self._impl.outputs], raw_stream,
                      torch.empty, torch.device("cuda", self._runtime.device))
        return self._cuda

    def _run_cuda(self, xs: list) -> list:
        """Inputs: CUDA tensors of the model's dtypes and shapes. Their pointers and new outputs'
        go to kiln_model_run_device on PyTorch's current stream of the runtime's device. What
        _run_torch does in C++; kept for the inputs it leaves (non-contiguous ones, which are
        copied) and for the errors it explains."""
        in_specs, out_specs, raw_stream, empty, device = self._cuda or self._cuda_interface()
        index = self._runtime.device
        if len(xs) != len(in_specs):
            raise KilnError(f"the model takes {len(in_specs)} inputs, got {len(xs)}")
        pointers, keep = [], None
        for (dtype, shape), x in zip(in_specs, xs):
            if x.dtype is not dtype or x.shape != shape or x.get_device() != index:
                info = self._impl.inputs[len(pointers)]
                raise KilnError(f"input '{info['name']}': expected {info['dtype']}{info['shape']} on cuda:{index}, "
                                f"got {x.dtype} {list(x.shape)} on {x.device}")
            if not x.is_contiguous():
                x = x.contiguous()
                keep = (keep or []) + [x]  # alive until the run is queued (then the stream orders its reuse)
            pointers.append(x.data_ptr())
        outs = [empty(shape, dtype=dtype, device=device) for dtype, shape in out_specs]
        self._impl._run_device_pointers(pointers, [o.data_ptr() for o in outs], raw_stream(index))
        del keep
        return outs


_TORCH_DTYPES = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16", "i64": "int64",
                 "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8", "bool": "bool",
                 "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


class Runtime:
    """Kiln's runtime on one GPU. Fails with KilnError when there is none."""

    def __init__(self, device: int = 0, cuda_graphs: bool = True, memory_limit: int = 0):
        self._impl = _kiln.Runtime(device, cuda_graphs, memory_limit)
        self.device = device

    @property
    def device_name(self) -> str:
        return self._impl.device_name

    def load(self, artifact: "Artifact | str | os.PathLike") -> Model:
        """Loads an Artifact or a .kiln file."""
        if isinstance(artifact, Artifact):
            return Model(self._impl._load_bytes(artifact.to_bytes()), self)
        return Model(self._impl._load_file(os.fspath(artifact)), self)


def compile(model: "str | os.PathLike | Graph", pipeline: "Pipeline | str | os.PathLike | None" = None, *,
            targets: Sequence[str] = (), symbols: Mapping[str, int] | None = None, passes: str | None = None,
            backend: str | None = None, verify_each: bool = True) -> "Artifact | CompiledModel":
    """Compiles a model file (any front end: .kir, .onnx, ...) or a kiln.Graph.

    pipeline: a Pipeline, a .toml path, or a one-line pipeline; default: the standard passes
    (those of `kiln compile`). passes: a pass list instead ("cse,dce"; "" for none).
    targets: GPU targets ("sm_80", "sm_90a", ...) give an Artifact; `["cpu"]`, or no targets,
    give a CompiledModel that runs in this process on the pipeline's backend (backend= picks
    one: "reference" by default, or "cpu"). symbols binds symbolic dims (artifacts need all).
    """
    if isinstance(pipeline, (str, os.PathLike)):
        text = os.fspath(pipeline)
        pipeline = Pipeline.from_toml(text) if text.endswith(".toml") else Pipeline.from_string(text)
    if not isinstance(model, Graph):
        model = os.fspath(model)
        if not os.path.exists(model):
            raise KilnError(f"model file '{model}' does not exist")
    result = _kiln._compile(model, pipeline, list(targets), dict(symbols or {}), passes, backend, verify_each)
    if isinstance(result, _kiln.Artifact):
        return Artifact(result)
    return CompiledModel(result)
