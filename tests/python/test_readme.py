"""The README's Python quick start runs as written: its first ```python block, from a scratch
folder that sees the repository's examples/ (as the repository root does)."""
import os
import re
import sys
import tempfile
import unittest

try:
    import numpy as np
    import torch
except ImportError:
    print("SKIP: torch is not installed (scripts/setup-python.sh installs it)")
    sys.exit(77)

import kiln

SRC = os.environ.get("KILN_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


@unittest.skipUnless("cpu" in {p["name"] for p in kiln.plugins()}, "the quick start runs on the cpu backend, "
                     "which this build lacks (a carried build leaves LLVM behind)")
class ReadmeQuickStart(unittest.TestCase):
    def test_python_block_runs(self):
        with open(os.path.join(SRC, "README.md")) as f:
            block = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
        scope: dict = {}
        here = os.getcwd()
        with tempfile.TemporaryDirectory() as scratch:
            os.symlink(os.path.abspath(os.path.join(SRC, "examples")), os.path.join(scratch, "examples"))
            os.chdir(scratch)
            try:
                exec(compile(block, "README.md (python quick start)", "exec"), scope)
            finally:
                os.chdir(here)
            self.assertGreater(os.path.getsize(os.path.join(scratch, "mlp.kiln")), 0)
        self.assertEqual(scope["probs"].shape, (4, 10))
        np.testing.assert_allclose(scope["probs"].sum(-1), np.ones(4), rtol=1e-5)
        self.assertEqual(scope["art"].inspect()["targets"], ["sm_80", "sm_90a"])
        with torch.no_grad():
            want = scope["model"](scope["x"])
            torch.testing.assert_close(scope["y"], want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(scope["fast"](scope["x"]), want, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    unittest.main()
