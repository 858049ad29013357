"""The kiln package's bindings: plugins, pipelines, graphs built in Python, compiling to
in-process models and to artifacts, running on NumPy arrays, errors as kiln.KilnError."""
import os
import tempfile
import unittest

import numpy as np

import kiln

SRC = os.environ.get("KILN_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
MLP = os.path.join(SRC, "examples", "kir", "mlp.kir")


def mlp_reference(x, w1, b1, w2, b2, w3, b3):
    h = np.maximum(x @ w1.T + b1, 0)
    h = np.maximum(h @ w2.T + b2, 0)
    logits = h @ w3.T + b3
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def mlp_inputs(batch, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(batch, 784), (128, 784), (128,), (64, 128), (64,), (10, 64), (10,)]
    return [rng.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]


def backends():
    names = {p["name"] for p in kiln.plugins() if p["kind"] == "backend"}
    return [b for b in ("reference", "cpu") if b in names]


class Plugins(unittest.TestCase):
    def test_lists_front_ends_passes_and_backends(self):
        rows = kiln.plugins()
        kinds = {(p["kind"], p["name"]) for p in rows}
        for want in [("frontend", "kir"), ("frontend", "onnx"), ("pass", "cse"), ("backend", "reference")]:
            self.assertIn(want, kinds)
        cse = next(p for p in rows if p["name"] == "canonicalize")
        self.assertIn("max-iterations", [o["name"] for o in cse["options"]])
        self.assertTrue(cse["library"].endswith(".so"))

    def test_missing_plugin_folder_is_an_error(self):
        with self.assertRaisesRegex(kiln.KilnError, "does not exist"):
            kiln.load_plugins(["/nonexistent/plugins"])


class Pipelines(unittest.TestCase):
    def test_from_toml(self):
        p = kiln.Pipeline.from_toml(os.path.join(SRC, "examples", "pipelines", "default.toml"))
        self.assertEqual(p.frontend, "kir")
        self.assertEqual(p.passes, ["canonicalize", "cse", "dce"])
        self.assertEqual(p.backend, "reference")
        self.assertEqual(p.targets, ["cpu"])

    def test_canonical_form_round_trips(self):
        p = kiln.Pipeline.from_string("kir | canonicalize{max-iterations=2},cse,dce | reference@cpu")
        self.assertEqual(p.canonical, "kir | canonicalize{max-iterations=2},cse,dce | reference@cpu")
        self.assertEqual(kiln.Pipeline.from_string(p.canonical), p)

    def test_toml_text(self):
        p = kiln.Pipeline.from_string('frontend = "kir"\npasses = ["cse"]\n[backend]\nname = "reference"\n')
        self.assertEqual(p.passes, ["cse"])

    def test_errors_carry_kiln_messages(self):
        with self.assertRaisesRegex(kiln.KilnError, "unknown pass 'cse2'.*did you mean 'cse'"):
            kiln.Pipeline.from_string("cse2")
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.toml")
            with open(bad, "w") as f:
                f.write('frontend = "kir"\nbogus = 1\n')
            with self.assertRaisesRegex(kiln.KilnError, r"bad.toml:2:1"):
                kiln.Pipeline.from_toml(bad)
        self.assertTrue(issubclass(kiln.KilnError, RuntimeError))


class CompileFiles(unittest.TestCase):
    def test_mlp_file_on_each_backend(self):
        inputs = mlp_inputs(3)
        want = mlp_reference(*inputs)
        for backend in backends():
            with self.subTest(backend=backend):
                m = kiln.compile(MLP, backend=backend)
                self.assertIsInstance(m, kiln.CompiledModel)
                self.assertEqual([i["name"] for i in m.inputs], ["x", "w1", "b1", "w2", "b2", "w3", "b3"])
                self.assertEqual(m.inputs[0]["shape"], ["B", 784])
                (y,) = m.run(inputs)
                self.assertEqual(y.shape, (3, 10))
                self.assertEqual(y.dtype, np.float32)
                np.testing.assert_allclose(y, want, rtol=1.3e-6 * 10, atol=1e-5)

    def test_inputs_by_name_and_bound_symbols(self):
        inputs = mlp_inputs(2, seed=1)
        names = ["x", "w1", "b1", "w2", "b2", "w3", "b3"]
        m = kiln.compile(MLP, pipeline=os.path.join(SRC, "examples", "pipelines", "default.toml"), symbols={"B": 2})
        self.assertEqual(m.inputs[0]["shape"], [2, 784])
        self.assertIn("reference", m.pipeline)
        (y,) = m.run(dict(zip(names, inputs)))
        np.testing.assert_allclose(y, mlp_reference(*inputs), rtol=1e-5, atol=1e-6)

    def test_bad_inputs_are_named(self):
        m = kiln.compile(MLP, passes="", backend="reference")
        inputs = mlp_inputs(2)
        with self.assertRaisesRegex(kiln.KilnError, "takes 7 inputs, got 1"):
            m.run([inputs[0]])
        bad = list(inputs)
        bad[1] = bad[1][:, :10].copy()
        with self.assertRaisesRegex(kiln.KilnError, "w1"):
            m.run(bad)
        bad = list(inputs)
        bad[0] = bad[0].astype(np.float64)
        with self.assertRaisesRegex(kiln.KilnError, "x"):
            m.run(bad)
        with self.assertRaisesRegex(kiln.KilnError, "unknown input 'y'"):
            m.run({"y": inputs[0]})

    def test_non_contiguous_inputs_are_accepted(self):
        inputs = mlp_inputs(4, seed=2)
        m = kiln.compile(MLP, passes="", backend="reference")
        x = np.asfortranarray(inputs[0])
        (y,) = m.run([x] + inputs[1:])
        np.testing.assert_allclose(y, mlp_reference(*inputs), rtol=1e-5, atol=1e-6)

    def test_missing_file_and_unknown_backend(self):
        with self.assertRaisesRegex(kiln.KilnError, "does not exist"):
            kiln.compile("/nonexistent/model.kir")
        with self.assertRaisesRegex(kiln.KilnError, "unknown backend 'refrence'"):
            kiln.compile(MLP, backend="refrence")


class BuildGraphs(unittest.TestCase):
    def build_mlp(self, w1, b1, w2, b2):
        g = kiln.Graph("mlp2")
        x = g.add_input("x", "f32", ["B", w1.shape[1]])
        h = g.add_node("linear", [x, g.constant(w1, "fc1.weight"), g.constant(b1, "fc1.bias")])[0]
        h = g.add_node("gelu", [h], {"approximate": "tanh"})[0]
        y = g.add_node("linear", [h, g.constant(w2, "fc2.weight"), g.constant(b2, "fc2.bias")])[0]
        g.set_outputs([y], ["logits"])
        return g

    def test_graph_from_python_matches_numpy(self):
        rng = np.random.default_rng(3)
        w1 = rng.standard_normal((32, 16)).astype(np.float32)
        b1 = rng.standard_normal(32).astype(np.float32)
        w2 = rng.standard_normal((8, 32)).astype(np.float32)
        b2 = rng.standard_normal(8).astype(np.float32)
        g = self.build_mlp(w1, b1, w2, b2)
        self.assertEqual(g.outputs, [{"name": "logits", "dtype": "f32", "shape": ["B", 8]}])
        self.assertIn("fc1.weight", str(g))
        x = rng.standard_normal((5, 16)).astype(np.float32)
        h = x @ w1.T + b1
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        want = h @ w2.T + b2
        for backend in backends():
            with self.subTest(backend=backend):
                (y,) = kiln.compile(g, backend=backend).run(x)
                np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)

    def test_constants_share_the_arrays_memory(self):
        w = np.ones((4, 4), np.float32)
        g = kiln.Graph()
        x = g.add_input("x", "f32", [2, 4])
        y = g.add_node("matmul", [x, g.constant(w, "w")])[0]
        g.set_outputs([y])
        del w  # the graph keeps the array alive
        (out,) = kiln.compile(g, passes="").run(np.ones((2, 4), np.float32))
        np.testing.assert_array_equal(out, np.full((2, 4), 4, np.float32))

    def test_values_carry_types(self):
        g = kiln.Graph()
        x = g.add_input("x", "f16", ["N", 3])
        y = g.add_node("cast", [x], {"to": "f32"})[0]
        self.assertEqual((y.dtype, y.shape), ("f32", ["N", 3]))
        s = g.add_node("split", [x], {"axis": 1, "sizes": [1, 2]}, num_results=2)
        self.assertEqual([v.shape for v in s], [["N", 1], ["N", 2]])

    def test_bad_nodes_are_refused_with_the_reason(self):
        g = kiln.Graph()
        x = g.add_input("x", "f32", [2, 3])
        with self.assertRaisesRegex(kiln.KilnError, "unknown op 'matmull'"):
            g.add_node("matmull", [x, x])
        with self.assertRaisesRegex(kiln.KilnError, "matmul"):
            g.add_node("matmul", [x, x])  # [2, 3] x [2, 3]
        with self.assertRaisesRegex(kiln.KilnError, "no attribute 'axs'"):
            g.add_node("softmax", [x], {"axs": 1})
        with self.assertRaisesRegex(kiln.KilnError, "unknown dtype 'f33'"):
            g.add_input("y", "f33", [1])
        other = kiln.Graph()
        with self.assertRaisesRegex(kiln.KilnError, "another graph"):
            other.add_node("relu", [x])
        self.assertEqual(g.num_nodes, 0)


class Artifacts(unittest.TestCase):
    def test_compile_inspect_save_load(self):
        art = kiln.compile(MLP, targets=["sm_80"], symbols={"B": 2})
        self.assertIsInstance(art, kiln.Artifact)
        info = art.inspect()
        self.assertEqual(info["targets"], ["sm_80"])
        self.assertEqual([i["name"] for i in info["inputs"]], ["x", "w1", "b1", "w2", "b2", "w3", "b3"])
        self.assertIn("mlp.kir", str(art))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "mlp.kiln")
            art.save(path)
            again = kiln.Artifact.load(path)
            self.assertEqual(again.to_bytes(), art.to_bytes())
            with open(path, "r+b") as f:
                f.seek(len(art) // 2)
                f.write(b"\xff" * 16)
            with self.assertRaises(kiln.KilnError):
                kiln.Artifact.load(path)

    def test_symbols_are_required_for_artifacts(self):
        with self.assertRaisesRegex(kiln.KilnError, "symbolic dimension 'B'"):
            kiln.compile(MLP, targets=["sm_80"])
        with self.assertRaisesRegex(kiln.KilnError, "no backend builds target 'sm_12'"):
            kiln.compile(MLP, targets=["sm_12"], symbols={"B": 1})

    def test_runtime_without_a_gpu_raises(self):
        try:
            rt = kiln.Runtime()
        except kiln.KilnError as e:
            self.assertRegex(str(e).lower(), "gpu|device|driver")
            return
        art = kiln.compile(MLP, targets=[rt.device_name.replace("sm_90", "sm_90a")], symbols={"B": 2})
        model = rt.load(art)
        inputs = mlp_inputs(2)
        (y,) = model.run(inputs)
        np.testing.assert_allclose(y, mlp_reference(*inputs), rtol=1e-3, atol=1e-4)


class RealModels(unittest.TestCase):
    """The small exported models of tests/models (ResNet-18, GPT-2, BERT, a Llama-style decoder,
    each from both ONNX exporters) through kiln.compile, against onnxruntime's saved outputs."""

    def test_models_match_onnxruntime(self):
        import glob

        folders = sorted(glob.glob(os.path.join(SRC, "tests", "models", "*", "model.onnx")))
        self.assertGreaterEqual(len(folders), 8)
        backend = backends()[-1]
        for model in folders:
            folder = os.path.dirname(model)
            with self.subTest(model=os.path.basename(folder)):
                symbols = {}
                if os.path.exists(os.path.join(folder, "dims.txt")):
                    with open(os.path.join(folder, "dims.txt")) as f:
                        for line in filter(str.strip, f):
                            name, size = line.strip().split("=")
                            symbols[name] = int(size)
                m = kiln.compile(model, passes="canonicalize,cse,dce", backend=backend, symbols=symbols)
                inputs = {os.path.basename(p)[6:-4]: np.load(p) for p in glob.glob(os.path.join(folder, "input_*.npy"))}
                outs = dict(zip([o["name"] for o in m.outputs], m.run(inputs)))
                for path in glob.glob(os.path.join(folder, "output_*.npy")):
                    name = os.path.basename(path)[7:-4]
                    np.testing.assert_allclose(outs[name], np.load(path), rtol=1e-3, atol=1e-4, err_msg=name)


if __name__ == "__main__":
    unittest.main()
