// Helpers the quantizer plugin tests share: running passes, finding ops, SQNR.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../core/plugin_test_util.h"
#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

namespace kiln::test {

/// Runs `passes` (one-line form, e.g. "quantize-int4{group-size=64}") on `g`.
inline Status run_passes(Graph& g, const std::string& passes, Registry& reg) {
  Pipeline p;
  KILN_ASSIGN_OR_RETURN(p.passes, parse_pass_list(passes, reg));
  return run_pipeline_passes(g, p, reg, {});
}

inline std::unique_ptr<Graph> parse(const std::string& text) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}

inline std::vector<std::string> op_names(const Graph& g) {
  std::vector<std::string> out;
  for (const auto& n : g.nodes()) out.push_back(n->op_name());
  return out;
}

inline const Node* find_op(const Graph& g, const std::string& op) {
  for (const auto& n : g.nodes())
    if (n->op_name() == op) return n.get();
  return nullptr;
}

/// Signal-to-quantization-noise ratio of `got` against `ref`, in dB, over all outputs.
inline double sqnr_db(const std::vector<Tensor>& ref, const std::vector<Tensor>& got) {
  double signal = 0, noise = 0;
  for (size_t o = 0; o < ref.size(); ++o)
    for (int64_t i = 0; i < ref[o].numel(); ++i) {
      const double r = ref[o].get_f64(i), d = r - got[o].get_f64(i);
      signal += r * r;
      noise += d * d;
    }
  return 10 * std::log10(signal / noise);
}

/// SQNR of `passes` on the graph `text` over random inputs drawn with `seed`, on the reference
/// backend.
inline double graph_sqnr(Registry& reg, const std::string& text, const std::string& passes, uint32_t seed) {
  auto g = parse(text);
  std::mt19937 rng(seed);
  const std::vector<Tensor> inputs = random_inputs(*g, rng);
  const std::vector<Tensor> ref = run_reference(reg, *g, inputs);
  Status s = run_passes(*g, passes, reg);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(verify(*g).ok());
  return sqnr_db(ref, run_reference(reg, *g, inputs));
}

}  // namespace kiln::test
