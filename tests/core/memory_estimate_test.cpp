// The peak activation memory estimate on small graphs whose peaks are worked out by hand.
#include <doctest/doctest.h>

#include "kiln/core/memory_estimate.h"
#include "kiln/ir/text.h"

using namespace kiln;

namespace {

std::unique_ptr<Graph> parse(const std::string& text) {
  auto g = parse_graph(text, "test.kir");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(g).value();
}

std::vector<const Node*> nodes_of(const Graph& g) {
  std::vector<const Node*> out;
  for (const auto& n : g.nodes()) out.push_back(n.get());
  return out;
}

}  // namespace

TEST_CASE("memory estimate: a chain keeps two values live at a time") {
  auto g = parse(R"(graph @g(%x: f32[256]) -> (f32[256]) {
  %a = exp(%x) : f32[256]
  %b = neg(%a) : f32[256]
  %c = tanh(%b) : f32[256]
  return %c
})");
  CHECK(peak_activation_bytes(*g) == 2048);
}

TEST_CASE("memory estimate: views extend their base's life; constants and what folds from them are free") {
  auto g = parse(R"(graph @g(%x: f32[2, 8]) -> (f32[16], f32[2, 8]) {
  %c = constant() {value = dense<f32[8]>[1, 2, 3, 4, 5, 6, 7, 8]} : f32[8]
  %cc = exp(%c) : f32[8]
  %a = add(%x, %cc) : f32[2, 8]
  %v = reshape(%a) {shape = [16]} : f32[16]
  %b = exp(%x) : f32[2, 8]
  %d = neg(%v) : f32[16]
  return %d, %b
})");
  // x, a (still read through v) and b are live while b runs: 3 x 64 bytes. Were v not an
  // alias, a would be dead there (128); were the constants counted, 64 more.
  CHECK(peak_activation_bytes(*g) == 192);
  const StorageMap s(*g);
  const std::vector<const Node*> n = nodes_of(*g);
  CHECK(s.root_of(n[3]->result()) == n[2]->result());
  CHECK(s.is_free(n[1]->result()));
  CHECK_FALSE(s.is_free(n[2]->result()));
}

TEST_CASE("memory estimate: the order matters; dead results live for their own step") {
  auto g = parse(R"(graph @g(%x: f32[256]) -> (f32[1]) {
  %a1 = exp(%x) : f32[256]
  %a2 = neg(%x) : f32[256]
  %r1 = reduce_sum(%a1) {axes = [0]} : f32[1]
  %r2 = reduce_sum(%a2) {axes = [0]} : f32[1]
  %unused = tanh(%r2) : f32[1]
  %y = add(%r1, %r2) : f32[1]
  return %y
})");
  CHECK(peak_activation_bytes(*g) == 3072);  // x, a1 and a2 while a2 runs
  const std::vector<const Node*> n = nodes_of(*g);
  const std::vector<const Node*> better = {n[0], n[2], n[1], n[3], n[4], n[5]};
  CHECK(peak_activation_bytes(*g, better) == 2052);  // x, a1, r1; then x, r1, a2
}

TEST_CASE("memory estimate: symbolic dims count as kSymbolicDimEstimate; inputs and outputs are live") {
  auto g = parse(R"(graph @g(%x: f16[B, 4], %unused: f32[10]) -> (f16[B, 4]) {
  return %x
})");
  CHECK(value_bytes(*g->input(0)) == kSymbolicDimEstimate * 4 * 2);
  CHECK(peak_activation_bytes(*g) == kSymbolicDimEstimate * 8 + 40);
}
