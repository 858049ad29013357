// Test helpers for the CUDA lowering: lower a .kir text (failing the test on errors), pick
// lines out of the resulting plan, compile its source for every target.
#pragma once

#include <doctest/doctest.h>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
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

/// The options the cuda-sm90 plugin lowers with: its target (the Hopper plan) and its shared
/// memory per block.
inline LoweringOptions hopper_lowering() {
  LoweringOptions o;
  o.target = "cuda-sm90: target sm_90a";
  o.max_smem_per_block = 232448;
  return o;
}

/// Compiles the lowered source with NVRTC for sm_80, sm_90a and sm_100a: a failure stops the test
/// with NVRTC's log and the source; every image must be an ELF cubin.
inline void compiles_everywhere(const LoweredGraph& l) {
  for (const char* target : {"sm_80", "sm_90a", "sm_100a"}) {
    CAPTURE(target);
    auto cubin = compile_cuda(l.source, target, "test@0");
    REQUIRE_MESSAGE(cubin.ok(), std::string(cubin.status().message() + "\n" + l.source));
    CHECK(cubin->substr(0, 4) == "\x7f" "ELF");
  }
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

/// The plan's named buffers: name -> ("bID", its buffer line).
inline std::map<std::string, std::pair<std::string, std::string>> named_buffers(const std::string& plan) {
  std::map<std::string, std::pair<std::string, std::string>> out;
  for (const std::string& line : plan_lines(plan, "buffer ")) {
    const size_t at = line.find(" name=");
    if (at == std::string::npos) continue;
    out[line.substr(at + 6)] = {"b" + line.substr(7, line.find(' ', 7) - 7), line};
  }
  return out;
}

}  // namespace kiln::cuda
