"""bench/peer/torch_compile_kiln.py's verdicts on fabricated results: issue 29's goals (Kiln
through torch.compile no slower than its ONNX path, faster than Inductor where the ONNX path is,
Python's host overhead), the accuracy and NaN checks, and the Markdown table. Needs no torch."""
import math
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.environ.get("KILN_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                                "bench", "peer"))
import torch_compile_kiln as tck  # noqa: E402


def row(kiln=1.0, onnx=1.0, inductor=(1.2,), accuracy=True, accuracy_onnx=True):
    modes = {"eager": {"ms": 2.0, "max_abs_err_vs_f64": 1e-6}}
    for i, ms in enumerate(inductor):
        modes["torch.compile" + (" reduce-overhead" if i else "")] = {"ms": ms, "max_abs_err_vs_f64": 1e-6}
    modes["kiln"] = {"ms": kiln, "max_abs_err_vs_f64": 2e-6, "kiln_parts": 1} if kiln is not None else {"error": "E"}
    if onnx is not None:
        modes["kiln-onnx"] = {"ms": onnx, "max_abs_err_vs_f64": 2e-6}
    return {"model": "m", "shape": "fp32", "modes": modes, "accuracy": {"pass": accuracy, "kiln_err": 1, "bound": 0},
            "accuracy_onnx": {"pass": accuracy_onnx, "kiln_err": 1, "bound": 0}}


class ModelGoals(unittest.TestCase):
    def goals(self, r, noise=1.05, speed=True):
        return tck.model_goals(r, noise, speed)

    def test_met(self):
        g = self.goals(row(kiln=1.0, onnx=0.98, inductor=(1.3, 1.2)))
        self.assertEqual(g["missed"], [])
        self.assertAlmostEqual(g["kiln_vs_onnx"], 1.0 / 0.98, places=4)
        self.assertAlmostEqual(g["kiln_vs_inductor"], 1.0 / 1.2, places=4)  # the fastest torch.compile mode
        self.assertAlmostEqual(g["onnx_vs_inductor"], 0.98 / 1.2, places=4)

    def test_slower_than_onnx_beyond_noise(self):
        g = self.goals(row(kiln=1.06, onnx=1.0))
        self.assertEqual(len(g["missed"]), 1)
        self.assertIn("1.06x Kiln's ONNX path", g["missed"][0])
        self.assertEqual(self.goals(row(kiln=1.06, onnx=1.0), noise=1.1)["missed"], [])
        self.assertEqual(self.goals(row(kiln=1.04, onnx=1.0))["missed"], [])

    def test_side_by_side_timing_decides_the_ratio(self):
        # Sequential timings say 1.10x; the two timed side by side say 1.02x: the latter counts.
        r = row(kiln=1.1, onnx=1.0)
        r["paired_ms"] = {"kiln": 1.02, "kiln-onnx": 1.0}
        g = self.goals(r)
        self.assertEqual((g["kiln_vs_onnx"], g["missed"]), (1.02, []))
        r["paired_ms"] = {"kiln": 1.2, "kiln-onnx": 1.0}
        self.assertIn("1.2x Kiln's ONNX path", self.goals(r)["missed"][0])
        r["paired_ms"] = {"kiln": float("nan"), "kiln-onnx": 1.0}
        self.assertEqual(self.goals(r)["missed"], ["paired_ms: kiln is NaN"])

    def test_slower_than_inductor_where_onnx_is_faster(self):
        g = self.goals(row(kiln=1.22, onnx=1.19, inductor=(1.2,)))
        self.assertEqual(len(g["missed"]), 1)
        self.assertIn("not faster than torch.compile", g["missed"][0])
        # The ONNX path slower than Inductor too: only Kiln ÷ ONNX is a goal there.
        self.assertEqual(self.goals(row(kiln=1.3, onnx=1.25, inductor=(1.2,)))["missed"], [])
        # No Inductor mode run (--no-inductor): nothing to compare.
        g = self.goals(row(kiln=1.3, onnx=1.25, inductor=()))
        self.assertEqual(g["missed"], [])
        self.assertNotIn("kiln_vs_inductor", g)

    def test_speed_not_enforced(self):
        g = self.goals(row(kiln=2.0, onnx=1.0, inductor=(1.5,)), speed=False)
        self.assertEqual(g["missed"], [])
        self.assertEqual(g["kiln_vs_onnx"], 2.0)

    def test_accuracy_and_nan(self):
        self.assertIn("kiln: accuracy", self.goals(row(accuracy=False))["missed"][0])
        self.assertIn("kiln-onnx: accuracy", self.goals(row(accuracy_onnx=False))["missed"][0])
        r = row()
        r["modes"]["kiln-onnx"]["max_abs_err_vs_f64"] = float("nan")
        self.assertEqual(self.goals(r, speed=False)["missed"], ["kiln-onnx: max_abs_err_vs_f64 is NaN"])
        r = row()
        r["modes"]["kiln"]["ms"] = float("nan")
        self.assertEqual(self.goals(r)["missed"], ["kiln: ms is NaN"])

    def test_missing_path(self):
        missed = self.goals(row(kiln=None, onnx=1.0))["missed"]
        self.assertTrue(any("no time for kiln:" in m for m in missed), missed)
        r = row()
        r["modes"]["kiln-onnx"] = {"error": "OnnxExporterError: Module onnx is not installed!"}
        self.assertEqual(self.goals(r)["missed"], ["no time for kiln-onnx: Kiln ÷ ONNX unknown"])
        # --no-onnx: no ONNX mode, no ONNX goal.
        r = row(onnx=None)
        del r["accuracy_onnx"]
        self.assertEqual(self.goals(r)["missed"], [])


class AccuracyVerdict(unittest.TestCase):
    def test_onnx_judged_against_pytorch_modes_only(self):
        modes = {"eager": {"max_abs_err_vs_f64": 1e-6}, "kiln": {"max_abs_err_vs_f64": 1.0},
                 "kiln-onnx": {"max_abs_err_vs_f64": 3e-6}}
        v = tck.accuracy_verdict(modes, 1e-5, "kiln-onnx")
        self.assertTrue(v["pass"])
        self.assertEqual(v["worst_pytorch_mode"], "eager")  # Kiln's own error sets no bound
        self.assertFalse(tck.accuracy_verdict(modes, 1e-5)["pass"])
        modes["kiln-onnx"]["max_abs_err_vs_f64"] = math.nan
        self.assertFalse(tck.accuracy_verdict(modes, 1e-5, "kiln-onnx")["pass"])
        self.assertFalse(tck.accuracy_verdict({"eager": {"max_abs_err_vs_f64": 1e-6}}, 1e-5, "kiln-onnx")["pass"])


class HostGoal(unittest.TestCase):
    def test_limit(self):
        self.assertEqual(tck.host_goal({"python_over_c_api_us": 9.5}, 10.0), [])
        self.assertIn("12.95 us above", tck.host_goal({"python_over_c_api_us": 12.95}, 10.0)[0])
        self.assertEqual(len(tck.host_goal({"python_over_c_api_us": float("nan")}, 10.0)), 1)
        self.assertEqual(tck.host_goal({"CompiledModel._run_us": 2.0}, 10.0), [])  # CPU runs: not measured
        self.assertEqual(tck.host_goal(None, 10.0), [])


class Table(unittest.TestCase):
    def test_columns(self):
        r = row(kiln=1.1, onnx=1.0, inductor=(1.2,))
        r["modes"]["kiln"].update(part_ms=1.01, guards_skipped_ms=1.02)
        r["goals"] = tck.model_goals(r, 1.05)
        result = {"device": "d", "torch": "t", "kiln": "k", "models": [r, {"model": "bert", "skipped": "no transformers"}],
                  "host_overhead": {"python_over_c_api_us": 3.0}, "missed": ["m: x"]}
        text = tck.markdown(result)
        header = next(line for line in text.splitlines() if line.startswith("| model"))
        data = next(line for line in text.splitlines() if line.startswith("| m fp32"))
        self.assertEqual(header.count("|"), data.count("|"))
        cells = [c.strip() for c in data.split("|")[1:-1]]
        self.assertEqual(cells[4:7], ["1.100", "1.000", "1.10x"])
        self.assertIn("**missed**", cells[-1])
        self.assertIn("skipped: no transformers", text)
        self.assertIn("python_over_c_api_us 3.0", text)
        self.assertIn("guards skipped: m 1.01 / 1.02", text)
        self.assertIn("- m: x", text)


if __name__ == "__main__":
    unittest.main()
