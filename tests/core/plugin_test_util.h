// Helpers shared by the tests that drive in-tree plugins: loading them, random inputs, and
// running a graph on the reference backend.
#pragma once

#include <doctest/doctest.h>

#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "kiln/core/loader.h"
#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/tensor.h"

namespace kiln::test {

/// The global registry with `libraries` (file names in KILN_PLUGIN_DIR) loaded; the loader
/// skips a library it already loaded, so every test may ask for what it needs.
inline Registry& registry_with(std::initializer_list<const char*> libraries) {
  Registry& r = Registry::global();
  for (const char* lib : libraries) {
    Status s = load_plugin(std::string(KILN_PLUGIN_DIR) + "/" + lib, r);
    REQUIRE_MESSAGE(s.ok(), s.message());
  }
  return r;
}

/// Random values for each graph input: floats in [-2, 2], integers in [-5, 5]. Every
/// symbolic dim is 3.
inline std::vector<Tensor> random_inputs(const Graph& g, std::mt19937& rng) {
  std::vector<Tensor> ins;
  std::uniform_real_distribution<double> real(-2.0, 2.0);
  std::uniform_int_distribution<int64_t> integer(-5, 5);
  for (const Value* v : g.inputs()) {
    std::vector<int64_t> sizes;
    for (const Dim& d : v->shape()) sizes.push_back(d.is_static() ? d.value() : 3);
    Tensor t(v->dtype(), sizes);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (is_float(v->dtype())) t.set_f64(i, real(rng));
      else t.set_i64(i, integer(rng));
    }
    ins.push_back(std::move(t));
  }
  return ins;
}

/// Runs `g` through the reference backend, looked up in `reg` like any backend.
inline std::vector<Tensor> run_reference(const Registry& reg, const Graph& g,
                                         const std::vector<Tensor>& inputs) {
  auto info = reg.backend("reference");
  REQUIRE_MESSAGE(info.ok(), info.status().message());
  auto backend = (*info)->create(Options());
  REQUIRE(backend.ok());
  auto exe = (*backend)->compile(g);
  REQUIRE_MESSAGE(exe.ok(), exe.status().message());
  auto outs = (*exe)->run(inputs);
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  return std::move(outs).value();
}

}  // namespace kiln::test
