// Test helper: the lines of a lowered plan that start with a given prefix.
#pragma once

#include <sstream>
#include <string>
#include <vector>

namespace kiln::cuda {

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
