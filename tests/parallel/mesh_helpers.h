// Test helpers: a per-rank program run for every rank in this process against the whole graph.
#pragma once

#include <doctest/doctest.h>

#include <vector>

#include "kiln/core/driver.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/mesh_run.h"

namespace kiln::testing {

/// Output 0 of per-rank program `g` on whole inputs `whole`, every rank run here, put together.
inline Tensor run_sharded(const Graph& g, const std::vector<Tensor>& whole) {
  auto pieces = split_inputs_by_rank(g, whole);
  REQUIRE_MESSAGE(pieces.ok(), pieces.status().message());
  const Graph* programs[] = {&g};
  auto by_rank = run_mesh(g.mesh(), programs, *pieces);
  REQUIRE_MESSAGE(by_rank.ok(), by_rank.status().message());
  auto outs = assemble_outputs(g, *by_rank);
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  return (*outs)[0];
}

/// Output 0 of `g` on the reference interpreter.
inline Tensor run_whole(const Graph& g, const std::vector<Tensor>& inputs) {
  auto outs = Interpreter().run(g, inputs);
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  return (*outs)[0];
}

}  // namespace kiln::testing
