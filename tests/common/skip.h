// Skipping a doctest case that needs a plugin or library this machine lacks, so that ctest
// reports it skipped (exit 77 under SKIP_RETURN_CODE 77) instead of passed.
#pragma once

#include <doctest/doctest.h>

#include <string>

namespace kiln::test {

namespace detail {
/// Set by skip(); the shared doctest main (tests/doctest_main.cpp) reads and clears it per case.
inline bool current_case_skipped = false;
}  // namespace detail

/// Marks the running test case skipped because `why` names what is missing; the caller returns
/// right after. The shared doctest main exits 77 when every case it ran was skipped and none
/// failed: under ctest each case runs alone, so that case shows as skipped with this message.
inline void skip(const std::string& why) {
  MESSAGE("SKIP: " << why);
  detail::current_case_skipped = true;
}

}  // namespace kiln::test
