// Test helpers for the CUDA lowering: lower a .kir text (failing the test on errors) and pick
// lines out of the resulting plan.
#pragma once

#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "kiln/cuda/lowering.h"
#include "kiln/ir/text.h"

namespace kiln::cuda {

/// Parses and lowers `text`; a parse or lowering error fails the test with its message.
inline LoweredGraph lower_text(const std::string& text, const LoweringOptions& opts = {}) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g, opts);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  return *l;
}

/// Lines of `plan` starting with `prefix` ("step launch", "step ", "buffer "), in order.
inline std::vector<std::string> plan_lines(const std::string& plan, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(plan);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  return out;
}

/// The plan's kernel launches.
inline std::vector<std::string> launches(const std::string& plan) { return plan_lines(plan, "step launch"); }

/// Every plan step.
inline std::vector<std::string> steps(const std::string& plan) { return plan_lines(plan, "step "); }

}  // namespace kiln::cuda
