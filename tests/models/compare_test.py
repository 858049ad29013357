#!/usr/bin/env python3
"""The model checks' comparisons (compare.py): each passes a clean result and fails once a NaN,
a wrong infinity or a finite value where an infinity belongs is injected, naming the element."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import allclose, sqnr_at_least  # noqa: E402

WANT = np.array([[0.5, -1.25, 3.0], [0.0, 7.5, -2.0]], dtype=np.float32)


def inject(a, index, value):
    a = a.copy()
    a[index] = value
    return a


def both(want, got):
    """check_model.py's and check_quantized.py's checks of got against want."""
    return allclose(want, got, 1e-3, 1e-4), sqnr_at_least(want, got, 20)


class CompareTest(unittest.TestCase):
    def assert_fails_naming(self, v, text):
        self.assertFalse(v.ok, v.why)
        self.assertIn(text, v.why)

    def test_clean_result_passes(self):
        for v in both(WANT, WANT.copy()):
            self.assertTrue(v.ok, v.why)
        near = inject(WANT, (1, 1), 7.5 + 5e-4)  # within 1e-4 + 1e-3 * 7.5
        for v in both(WANT, near):
            self.assertTrue(v.ok, v.why)

    def test_nan_fails(self):
        got = inject(WANT, (0, 2), np.nan)
        for v in both(WANT, got):
            self.assert_fails_naming(v, "element (0, 2): got nan, expected 3 (got NaN)")
        # What np.allclose-style code without the NaN rule would let through:
        self.assertFalse(np.any(np.abs(got - WANT) > 1e-4 + 1e-3 * np.abs(WANT)))

    def test_unexpected_infinity_fails(self):
        for inf in (np.inf, -np.inf):
            for v in both(WANT, inject(WANT, (1, 2), inf)):
                self.assert_fails_naming(v, f"element (1, 2): got {inf}, expected -2 (got an infinity)")

    def test_finite_or_other_infinity_where_infinity_expected_fails(self):
        want = inject(WANT, (0, 1), np.inf)
        for got, shown in ((WANT, "-1.25"), (inject(WANT, (0, 1), -np.inf), "-inf")):
            for v in both(want, got):
                self.assert_fails_naming(v, f"element (0, 1): got {shown}, expected inf (expected an infinity)")
        for v in both(want, want.copy()):
            self.assertTrue(v.ok, v.why)

    def test_nan_expected_fails_unless_equal_nan(self):
        want = inject(WANT, (1, 0), np.nan)
        for v in both(want, want.copy()):
            self.assert_fails_naming(v, "element (1, 0): got nan, expected nan")
        self.assertTrue(allclose(want, want.copy(), 1e-3, 1e-4, equal_nan=True).ok)
        self.assertFalse(allclose(want, WANT, 1e-3, 1e-4, equal_nan=True).ok)

    def test_tolerance_floor_and_shape(self):
        v = allclose(WANT, inject(WANT, (0, 0), 0.6), 1e-3, 1e-4)
        self.assert_fails_naming(v, "1 of 6 elements differ; first element (0, 0): got 0.600000024, expected 0.5, |diff|")
        self.assertAlmostEqual(v.measure, 0.1, places=6)
        v = sqnr_at_least(np.ones(100), np.full(100, 1.01), 40.001)
        self.assertAlmostEqual(v.measure, 40.0, places=6)
        self.assert_fails_naming(v, "SQNR 40")
        self.assert_fails_naming(allclose(WANT, WANT[0], 0, 0), "shape [3], expected [2, 3]")


if __name__ == "__main__":
    unittest.main()
