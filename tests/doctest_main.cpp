// doctest's main(), shared by every unit-test binary: exits 77 (ctest's skip code) when every
// test case it ran called kiln::test::skip (common/skip.h) and none failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "common/skip.h"

namespace {

int cases_started = 0, cases_skipped = 0;

/// Counts the test cases that ran and those that skipped themselves.
struct SkipCounter : doctest::IReporter {
  explicit SkipCounter(const doctest::ContextOptions&) {}
  void test_case_start(const doctest::TestCaseData&) override {
    ++cases_started;
    kiln::test::detail::current_case_skipped = false;
  }
  void test_case_end(const doctest::CurrentTestCaseStats&) override {
    cases_skipped += kiln::test::detail::current_case_skipped ? 1 : 0;
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

DOCTEST_REGISTER_LISTENER("kiln-skip-counter", 1, SkipCounter);

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;
  return rc == 0 && cases_started > 0 && cases_skipped == cases_started ? 77 : rc;
}
