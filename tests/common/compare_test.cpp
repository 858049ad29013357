// The shared GPU-test comparator (compare.h) on the CPU: each check passes a clean result and
// fails once a NaN, a wrong infinity or a finite value where an infinity belongs is injected,
// naming the element, the expected and the got value.
#include "compare.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace kiln::test;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

const std::vector<double> kWant = {0.5, -1.25, 3.0, 0.0, 7.5, -2.0};

/// Every check the GPU tests use, on the same result: "" from each when it passes.
struct AllChecks {
  Verdict close, sqnr, max_abs, rel_l2;
};

AllChecks run_all(const std::vector<double>& want, const std::vector<double>& got) {
  const auto n = static_cast<int64_t>(want.size());
  return {allclose(want, got, kAssertCloseF32), sqnr_at_least(n, read(want), read(got), 40),
          max_abs_within(n, read(want), read(got), 1e-3),
          rel_l2_within(n, read(want), read(got), 1e-3)};
}

/// `got` = `want` with element `at` replaced by `value`.
std::vector<double> inject(std::vector<double> want, size_t at, double value) {
  want[at] = value;
  return want;
}

void check_fails_naming(const Verdict& v, int64_t at, const std::string& got,
                        const std::string& expected) {
  CAPTURE(v.why);
  CHECK_FALSE(v.ok());
  CHECK(v.first == at);
  CHECK(v.why.find("element " + std::to_string(at) + ": got " + got + ", expected " + expected) !=
        std::string::npos);
}

}  // namespace

TEST_CASE("every check passes the clean result and one within its tolerance") {
  const AllChecks same = run_all(kWant, kWant);
  CHECK_MESSAGE(same.close.ok(), same.close.why);
  CHECK_MESSAGE(same.sqnr.ok(), same.sqnr.why);
  CHECK(std::isinf(same.sqnr.measure));
  CHECK_MESSAGE(same.max_abs.ok(), same.max_abs.why);
  CHECK_MESSAGE(same.rel_l2.ok(), same.rel_l2.why);
  // 7.5 off by 8e-6: under atol 1e-5 + rtol 1.3e-6 * 7.5.
  const AllChecks near = run_all(kWant, inject(kWant, 4, 7.5 + 8e-6));
  CHECK_MESSAGE(near.close.ok(), near.close.why);
  CHECK(near.close.measure == doctest::Approx(8e-6));
  CHECK_MESSAGE(near.sqnr.ok(), near.sqnr.why);
  CHECK_MESSAGE(near.max_abs.ok(), near.max_abs.why);
  CHECK_MESSAGE(near.rel_l2.ok(), near.rel_l2.why);
}

TEST_CASE("a NaN in the result fails every check, naming the element") {
  const AllChecks r = run_all(kWant, inject(kWant, 2, kNaN));
  for (const Verdict* v : {&r.close, &r.sqnr, &r.max_abs, &r.rel_l2})
    check_fails_naming(*v, 2, "nan", "3");
  CHECK(r.close.why == "1 of 6 elements differ; first element 2: got nan, expected 3 (got NaN)");
  // What the old comparisons did with it: fabs(w - g) > tol and SQNR < floor are both false.
  CHECK_FALSE(std::fabs(3.0 - kNaN) > 1e-5);
}

TEST_CASE("an unexpected infinity fails every check") {
  for (double inf : {kInf, -kInf}) {
    const AllChecks r = run_all(kWant, inject(kWant, 5, inf));
    for (const Verdict* v : {&r.close, &r.sqnr, &r.max_abs, &r.rel_l2})
      check_fails_naming(*v, 5, inf > 0 ? "inf" : "-inf", "-2");
  }
}

TEST_CASE(
    "a finite value, or the other infinity, where an infinity was expected fails every check") {
  const std::vector<double> want = inject(kWant, 1, kInf);
  const AllChecks finite = run_all(want, inject(want, 1, 1e300));
  for (const Verdict* v : {&finite.close, &finite.sqnr, &finite.max_abs, &finite.rel_l2})
    check_fails_naming(*v, 1, "1e+300", "inf");
  const AllChecks flipped = run_all(want, inject(want, 1, -kInf));
  for (const Verdict* v : {&flipped.close, &flipped.sqnr, &flipped.max_abs, &flipped.rel_l2})
    check_fails_naming(*v, 1, "-inf", "inf");
  // The same infinity passes, also under an exact tolerance (where 0 * inf would be NaN).
  const AllChecks same = run_all(want, want);
  for (const Verdict* v : {&same.close, &same.sqnr, &same.max_abs, &same.rel_l2})
    CHECK_MESSAGE(v->ok(), v->why);
  CHECK(allclose(want, want, kExact).ok());
}

TEST_CASE("a NaN where a number was expected, or in both, fails unless equal_nan") {
  const std::vector<double> want = inject(kWant, 3, kNaN);
  const AllChecks r = run_all(want, kWant);
  for (const Verdict* v : {&r.close, &r.sqnr, &r.max_abs, &r.rel_l2})
    check_fails_naming(*v, 3, "0", "nan");
  const AllChecks both = run_all(want, want);
  for (const Verdict* v : {&both.close, &both.sqnr, &both.max_abs, &both.rel_l2})
    check_fails_naming(*v, 3, "nan", "nan");
  // equal_nan (a kernel that must give NaN where the reference does) passes NaN for NaN only.
  CHECK(allclose(want, want, kAssertCloseF32, true).ok());
  check_fails_naming(allclose(want, kWant, kAssertCloseF32, true), 3, "0", "nan");
  check_fails_naming(allclose(kWant, inject(kWant, 0, kNaN), kAssertCloseF32, true), 0, "nan",
                     "0.5");
}

TEST_CASE(
    "beyond the tolerance fails with the difference and the bound; the count covers every "
    "offender") {
  std::vector<double> got = inject(kWant, 4, 7.5 + 2e-5);
  got[0] = 0.6;
  const Verdict v = allclose(kWant, got, kAssertCloseF32);
  CHECK(v.why ==
        "2 of 6 elements differ; first element 0: got 0.6, expected 0.5, |diff| 0.1 > atol 1e-05 + "
        "rtol 1.3e-06 * |expected|");
  CHECK(v.first == 0);
  CHECK(v.measure == doctest::Approx(0.1));
  CHECK(allclose(kWant, got, {0, 0.2}).ok());
  CHECK(allclose(std::vector<double>{1, 2}, std::vector<float>{1}, kExact).why ==
        "1 elements, expected 2");
}

TEST_CASE("the SQNR, max-abs and relative-L2 checks fail below their floor or above their bound") {
  const std::vector<double> want(100, 1.0);
  std::vector<double> got(100, 1.01);  // noise 1e-4 of the signal: SQNR 40 dB
  const auto n = static_cast<int64_t>(want.size());
  const Verdict forty = sqnr_at_least(n, read(want), read(got), 40.0001);
  CHECK(forty.measure == doctest::Approx(40));
  CHECK(forty.why.rfind("SQNR 40", 0) == 0);
  CHECK(sqnr_at_least(n, read(want), read(got), 39.99).ok());
  const Verdict worst = max_abs_within(n, read(want), read(inject(got, 7, 1.5)), 0.1);
  CHECK(worst.why == "max |diff| 0.5 > 0.1 at element 7: got 1.5, expected 1");
  CHECK(worst.first == 7);
  CHECK(max_abs_within(n, read(want), read(got), 0.02).ok());
  CHECK(rel_l2_within(n, read(want), read(got), 0.0101).ok());
  CHECK(rel_l2_within(n, read(want), read(got), 0.0099).why.rfind("relative L2 error 0.01", 0) ==
        0);
  // A zero reference: equal passes, anything else is an infinite relative error.
  const std::vector<double> zeros(4, 0.0), small(4, 1e-30);
  CHECK(rel_l2_within(4, read(zeros), read(zeros), 0).ok());
  CHECK_FALSE(rel_l2_within(4, read(zeros), read(small), 1).ok());
}
