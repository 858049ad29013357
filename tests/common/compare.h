// The one numeric comparator every GPU test uses: elementwise closeness (atol/rtol), an SQNR
// floor, a max-abs bound and a normwise relative error, all failing on NaN and misplaced ±inf.
// Standard C++ only, so that tests of any component (and CPU tests of the checks) include it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace kiln::test {

/// |got - want| <= atol + rtol * |want| passes (torch.testing.assert_close's rule).
struct Tolerance {
  double rtol = 0;
  double atol = 0;
};

/// torch.testing.assert_close's default tolerances per dtype.
inline constexpr Tolerance kAssertCloseF64{1e-7, 1e-7};
inline constexpr Tolerance kAssertCloseF32{1.3e-6, 1e-5};
inline constexpr Tolerance kAssertCloseF16{1e-3, 1e-5};
inline constexpr Tolerance kAssertCloseBF16{1.6e-2, 1e-5};
/// Integers, bools and anything that must match bit for bit in value.
inline constexpr Tolerance kExact{0, 0};

/// Element `i` of a result, widened to double (a Tensor's get_f64, a vector's operator[]).
using Read = std::function<double(int64_t)>;

/// What a check found: `why` is "" when it passed; `first` is the first offending element (-1
/// when none, or when the failure is not one element's); `measure` is the statistic the check
/// computed (largest |got - want|, SQNR in dB, relative L2 error) for printing.
struct Verdict {
  std::string why;
  int64_t first = -1;
  double measure = 0;
  bool ok() const { return why.empty(); }
};

/// A value as the messages print it: 9 significant digits, "nan", "inf", "-inf".
inline std::string show(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

/// Why `got` cannot stand for `want` whatever the tolerance, or nullptr: a NaN (unless both are
/// NaN and `equal_nan`), an infinity where a finite value was expected, a finite value or the
/// other infinity where an infinity was expected. Matching infinities pass.
inline const char* special_mismatch(double want, double got, bool equal_nan) {
  if (std::isnan(want) || std::isnan(got)) {
    if (std::isnan(want) && std::isnan(got)) return equal_nan ? nullptr : "NaN expected and got";
    return std::isnan(got) ? "got NaN" : "expected NaN";
  }
  if (std::isinf(want)) return got == want ? nullptr : "expected an infinity";
  if (std::isinf(got)) return "got an infinity";
  return nullptr;
}

namespace detail {

inline std::string element(int64_t i, double want, double got) {
  return "element " + std::to_string(i) + ": got " + show(got) + ", expected " + show(want);
}

/// The first element breaking the NaN/inf rules, as a failed verdict; ok() when there is none.
inline Verdict first_special(int64_t n, const Read& want, const Read& got, bool equal_nan) {
  for (int64_t i = 0; i < n; ++i) {
    const double w = want(i), g = got(i);
    if (const char* why = special_mismatch(w, g, equal_nan))
      return {element(i, w, g) + " (" + why + ")", i, NAN};
  }
  return {};
}

/// Σ want² and Σ (got - want)², leaving out the (matching) infinities.
inline std::pair<double, double> energies(int64_t n, const Read& want, const Read& got) {
  double signal = 0, noise = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double w = want(i), g = got(i);
    if (std::isinf(w)) continue;
    signal += w * w;
    noise += (g - w) * (g - w);
  }
  return {signal, noise};
}

}  // namespace detail

/// Every element within `tol` (after the NaN/inf rules); counts the offenders and names the
/// first. `measure` is the largest |got - want| over finite pairs.
inline Verdict allclose(int64_t n, const Read& want, const Read& got, Tolerance tol,
                        bool equal_nan = false) {
  Verdict v;
  int64_t bad = 0;
  std::string first;
  for (int64_t i = 0; i < n; ++i) {
    const double w = want(i), g = got(i);
    const char* special = special_mismatch(w, g, equal_nan);
    const bool finite = std::isfinite(w) && std::isfinite(g);
    const double diff = finite ? std::fabs(g - w) : 0;
    if (finite && diff > v.measure) v.measure = diff;
    // Matching infinities (and NaNs under equal_nan) pass without a difference to bound.
    if (!special && (!finite || diff <= tol.atol + tol.rtol * std::fabs(w))) continue;
    if (bad++ > 0) continue;
    v.first = i;
    first = detail::element(i, w, g) +
            (special ? std::string(" (") + special + ")"
                     : ", |diff| " + show(diff) + " > atol " + show(tol.atol) + " + rtol " +
                           show(tol.rtol) + " * |expected|");
  }
  if (bad > 0)
    v.why = std::to_string(bad) + " of " + std::to_string(n) + " elements differ; first " + first;
  return v;
}

/// Signal-to-quantization-noise ratio of `got` against `want` (the signal) at least `floor_db`,
/// after the NaN/inf rules; matching infinities are left out of both sums. `measure` is the
/// SQNR in dB (infinite when the two are equal).
inline Verdict sqnr_at_least(int64_t n, const Read& want, const Read& got, double floor_db) {
  if (Verdict s = detail::first_special(n, want, got, false); !s.ok()) return s;
  const auto [signal, noise] = detail::energies(n, want, got);
  Verdict v;
  v.measure = noise == 0 ? INFINITY : 10 * std::log10(signal / noise);
  // Written so that a NaN SQNR (0/0 cannot happen here, but overflow can) fails too.
  if (!(v.measure >= floor_db))
    v.why = "SQNR " + show(v.measure) + " dB < floor " + show(floor_db) + " dB";
  return v;
}

/// Largest |got - want| at most `limit`, after the NaN/inf rules; names the worst element.
inline Verdict max_abs_within(int64_t n, const Read& want, const Read& got, double limit) {
  if (Verdict s = detail::first_special(n, want, got, false); !s.ok()) return s;
  Verdict v;
  for (int64_t i = 0; i < n; ++i) {
    const double w = want(i), g = got(i);
    const double diff = std::isinf(w) ? 0 : std::fabs(g - w);
    if (diff > v.measure) v.measure = diff, v.first = i;
  }
  if (v.measure <= limit) return {"", -1, v.measure};
  v.why = "max |diff| " + show(v.measure) + " > " + show(limit);
  if (v.first >= 0) v.why += " at " + detail::element(v.first, want(v.first), got(v.first));
  return v;
}

/// Normwise relative error ||got - want||₂ / ||want||₂ at most `limit`, after the NaN/inf rules
/// (for sums whose rounding elementwise tolerances would flag where they cancel). A zero `want`
/// has error 0 when `got` is zero too, else infinite.
inline Verdict rel_l2_within(int64_t n, const Read& want, const Read& got, double limit) {
  if (Verdict s = detail::first_special(n, want, got, false); !s.ok()) return s;
  const auto [den, num] = detail::energies(n, want, got);
  Verdict v;
  v.measure = num == 0 ? 0 : den == 0 ? INFINITY : std::sqrt(num / den);
  if (!(v.measure <= limit)) v.why = "relative L2 error " + show(v.measure) + " > " + show(limit);
  return v;
}

/// Reads a vector of any arithmetic type as doubles.
template <class T>
Read read(const std::vector<T>& v) {
  return [&v](int64_t i) { return static_cast<double>(v[static_cast<size_t>(i)]); };
}

/// allclose on two vectors; their sizes must match.
template <class W, class G>
Verdict allclose(const std::vector<W>& want, const std::vector<G>& got, Tolerance tol,
                 bool equal_nan = false) {
  if (want.size() != got.size())
    return {std::to_string(got.size()) + " elements, expected " + std::to_string(want.size())};
  return allclose(static_cast<int64_t>(want.size()), read(want), read(got), tol, equal_nan);
}

}  // namespace kiln::test
