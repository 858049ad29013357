// The schedule-memory pass from its plugin: reorders to lower the estimated peak, keeps the
// order when nothing is better, leaves outputs unchanged, and checks its options.
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "kiln/core/memory_estimate.h"
#include "kiln/core/pass_manager.h"
#include "kiln/ir/text.h"

#include "plugin_test_util.h"

using namespace kiln;

namespace {

Registry& registry() {
  static Registry& reg = test::registry_with({"kiln-plugin-schedule.so", "kiln-plugin-backend-reference.so"});
  return reg;
}

std::string ops(const Graph& g) {
  std::string s;
  for (const auto& n : g.nodes()) s += (s.empty() ? "" : ",") + n->result()->name();
  return s;
}

/// Runs `passes` on `text`; checks outputs against the unscheduled graph on random inputs.
std::unique_ptr<Graph> schedule(const std::string& text, const std::string& passes, bool& changed) {
  auto before = parse_graph(text, "test.kir");
  REQUIRE_MESSAGE(before.ok(), before.status().message());
  auto after = (*before)->clone();
  auto stages = parse_pass_list(passes, registry());
  REQUIRE_MESSAGE(stages.ok(), stages.status().message());
  PassManager pm(registry(), PassManagerOptions{});
  const Status s = pm.run(*after, *stages, passes);
  REQUIRE_MESSAGE(s.ok(), s.message());
  changed = false;
  for (const PassTiming& t : pm.timings()) changed |= t.changed;
  std::mt19937 rng(5);
  const std::vector<Tensor> inputs = test::random_inputs(**before, rng);
  const std::vector<Tensor> want = test::run_reference(registry(), **before, inputs);
  const std::vector<Tensor> got = test::run_reference(registry(), *after, inputs);
  REQUIRE(want.size() == got.size());
  for (size_t k = 0; k < want.size(); ++k)
    for (int64_t i = 0; i < want[k].numel(); ++i) CHECK(want[k].get_f64(i) == got[k].get_f64(i));
  return after;
}

// Two branches of x, each reduced: the import order makes both branch tensors before
// reducing either.
const char* kBranches = R"(graph @g(%x: f32[256]) -> (f32[1]) {
  %a1 = exp(%x) : f32[256]
  %a2 = neg(%x) : f32[256]
  %r1 = reduce_sum(%a1) {axes = [0]} : f32[1]
  %r2 = reduce_sum(%a2) {axes = [0]} : f32[1]
  %y = add(%r1, %r2) : f32[1]
  return %y
})";

}  // namespace

TEST_CASE("schedule-memory: finishing one branch before starting the next lowers the peak") {
  for (const char* algorithm : {"best", "greedy", "dfs"}) {
    CAPTURE(algorithm);
    auto original = parse_graph(kBranches, "test.kir");
    REQUIRE(original.ok());
    CHECK(peak_activation_bytes(**original) == 3072);
    bool changed = false;
    auto g = schedule(kBranches, std::string("schedule-memory{algorithm=") + algorithm + "}", changed);
    CHECK(changed);
    CHECK(ops(*g) == "a1,r1,a2,r2,y");
    CHECK(peak_activation_bytes(*g) == 2052);
  }
}

TEST_CASE("schedule-memory: lookahead sees that delaying 0.5 * x in tanh-gelu frees x sooner") {
  // The exporters' gelu: 0.5 * x first, held to the end. Every next step allocates one tensor
  // either way; only a window of several steps shows that running the pow branch first lets
  // add free x (peak 4 KiB -> 3 KiB).
  const char* text = R"(graph @g(%in: f32[256]) -> (f32[256]) {
  %x = exp(%in) : f32[256]
  %c0 = constant() {value = dense<f32[]>[0.5]} : f32[]
  %m0 = mul(%x, %c0) : f32[256]
  %c1 = constant() {value = dense<f32[]>[3]} : f32[]
  %p = pow(%x, %c1) : f32[256]
  %c2 = constant() {value = dense<f32[]>[0.044715]} : f32[]
  %m1 = mul(%p, %c2) : f32[256]
  %a = add(%x, %m1) : f32[256]
  %c3 = constant() {value = dense<f32[]>[0.7978846]} : f32[]
  %m2 = mul(%a, %c3) : f32[256]
  %t = tanh(%m2) : f32[256]
  %c4 = constant() {value = dense<f32[]>[1]} : f32[]
  %a2 = add(%t, %c4) : f32[256]
  %y = mul(%m0, %a2) : f32[256]
  return %y
})";
  auto original = parse_graph(text, "test.kir");
  REQUIRE(original.ok());
  CHECK(peak_activation_bytes(**original) == 4096);
  bool changed = true;
  auto one = schedule(text, "schedule-memory{algorithm=greedy,lookahead=1}", changed);
  CHECK_FALSE(changed);
  CHECK(peak_activation_bytes(*one) == 4096);
  auto four = schedule(text, "schedule-memory{algorithm=greedy,lookahead=4}", changed);
  CHECK(changed);
  CHECK(peak_activation_bytes(*four) == 3072);
  // Constants go as soon as they are ready (they cost nothing); m0 waits until a has read x.
  CHECK(ops(*four) == "c0,c1,c2,c3,c4,x,p,m1,a,m0,m2,t,a2,y");
}

TEST_CASE("schedule-memory: a chain, and a graph already in its best order, stay as they are") {
  bool changed = true;
  auto g = schedule(R"(graph @g(%x: f32[256]) -> (f32[256]) {
  %a = exp(%x) : f32[256]
  %b = neg(%a) : f32[256]
  %c = tanh(%b) : f32[256]
  return %c
})", "schedule-memory", changed);
  CHECK_FALSE(changed);
  CHECK(ops(*g) == "a,b,c");
  auto h = schedule(R"(graph @g(%x: f32[256]) -> (f32[1]) {
  %a1 = exp(%x) : f32[256]
  %r1 = reduce_sum(%a1) {axes = [0]} : f32[1]
  %a2 = neg(%x) : f32[256]
  %r2 = reduce_sum(%a2) {axes = [0]} : f32[1]
  %y = add(%r1, %r2) : f32[1]
  return %y
})", "schedule-memory", changed);
  CHECK_FALSE(changed);
  CHECK(ops(*h) == "a1,r1,a2,r2,y");
}

TEST_CASE("schedule-memory: bad options are named") {
  for (const auto& [passes, message] : std::vector<std::pair<std::string, std::string>>{
           {"schedule-memory{algorithm=random}", "schedule-memory: algorithm must be greedy, dfs or best, got 'random'"},
           {"schedule-memory{lookahead=0}", "schedule-memory: lookahead must be in [1, 64], got 0"}}) {
    CAPTURE(passes);
    auto stages = parse_pass_list(passes, registry());
    REQUIRE_MESSAGE(stages.ok(), stages.status().message());
    auto g = parse_graph(kBranches, "test.kir");
    REQUIRE(g.ok());
    PassManager pm(registry(), PassManagerOptions{});
    const Status s = pm.run(**g, *stages, passes);
    REQUIRE_FALSE(s.ok());
    CHECK(s.message().find(message) != std::string::npos);
  }
}
