"""The comparisons the model checks make (check_model.py, check_quantized.py), with the rules of
tests/common/compare.h: a NaN (unless both are NaN and equal_nan), an infinity where a finite
value was expected, or a finite value or the other infinity where an infinity was expected fails
whatever the tolerance; matching infinities pass. Each failure names the element, the expected
and the got value."""
from collections import namedtuple

import numpy as np

# ok: passed; why: "" or the reason; measure: the statistic (max |diff|, SQNR in dB) for printing.
Verdict = namedtuple("Verdict", "ok why measure")


def _show(v):
    return f"{float(v):.9g}"


def special_mismatch(want, got, equal_nan=False):
    """Boolean mask of the elements that fail the NaN/inf rules (want, got: float64 arrays)."""
    wn, gn = np.isnan(want), np.isnan(got)
    nan_bad = (wn | gn) & ~(wn & gn & equal_nan)
    inf_bad = ~wn & ~gn & (np.isinf(want) | np.isinf(got)) & (want != got)
    return nan_bad | inf_bad


def _element(want, got, i):
    """"element (i, j, ...): got G, expected W" for flat index i."""
    index = tuple(int(k) for k in np.unravel_index(i, want.shape))
    return f"element {index}: got {_show(got.flat[i])}, expected {_show(want.flat[i])}"


def _special_reason(w, g):
    if np.isnan(w) and np.isnan(g):
        return "NaN expected and got"
    if np.isnan(g) or np.isnan(w):
        return "got NaN" if np.isnan(g) else "expected NaN"
    return "expected an infinity" if np.isinf(w) else "got an infinity"


def _prepare(want, got):
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    if want.shape != got.shape:
        return want, got, f"shape {list(got.shape)}, expected {list(want.shape)}"
    return want, got, None


def allclose(want, got, rtol, atol, equal_nan=False):
    """Every element of got within atol + rtol * |want| of want, after the NaN/inf rules.
    measure: the largest |got - want| over finite pairs."""
    want, got, bad_shape = _prepare(want, got)
    if bad_shape:
        return Verdict(False, bad_shape, float("nan"))
    finite = np.isfinite(want) & np.isfinite(got)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, left out by `finite`
        diff = np.where(finite, np.abs(got - want), 0.0)
    worst = float(diff.max()) if diff.size else 0.0
    special = special_mismatch(want, got, equal_nan)
    far = finite & (diff > atol + rtol * np.abs(np.where(finite, want, 0.0)))
    bad = special | far
    if not bad.any():
        return Verdict(True, "", worst)
    i = int(np.flatnonzero(bad)[0])
    first = _element(want, got, i)
    if special.flat[i]:
        first += f" ({_special_reason(want.flat[i], got.flat[i])})"
    else:
        first += f", |diff| {_show(diff.flat[i])} > atol {_show(atol)} + rtol {_show(rtol)} * |expected|"
    return Verdict(False, f"{int(bad.sum())} of {bad.size} elements differ; first {first}", worst)


def sqnr_at_least(want, got, floor_db):
    """SQNR of got against want (the signal) at least floor_db dB, after the NaN/inf rules;
    matching infinities are left out of the sums. measure: the SQNR (inf when equal)."""
    want, got, bad_shape = _prepare(want, got)
    if bad_shape:
        return Verdict(False, bad_shape, float("nan"))
    special = special_mismatch(want, got)
    if special.any():
        i = int(np.flatnonzero(special)[0])
        return Verdict(False, f"{_element(want, got, i)} ({_special_reason(want.flat[i], got.flat[i])})",
                       float("nan"))
    keep = ~np.isinf(want)
    with np.errstate(divide="ignore", over="ignore"):
        noise = float(np.sum((want[keep] - got[keep]) ** 2))
        signal = float(np.sum(want[keep] ** 2))
        db = float("inf") if noise == 0 else float(10 * np.log10(signal / noise))
    if not db >= floor_db:  # a NaN SQNR fails too
        return Verdict(False, f"SQNR {_show(db)} dB < floor {_show(floor_db)} dB", db)
    return Verdict(True, "", db)
