// Device meshes, placements in .kir, collective ops and whole-mesh reference runs (run_mesh).
#include <doctest/doctest.h>

#include <chrono>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/mesh_run.h"
#include "kiln/ir/text.h"
#include "kiln/ir/verifier.h"

using namespace kiln;

namespace {

std::unique_ptr<Graph> parse_ok(const std::string& text) {
  auto g = parse_graph(text, "t.kir");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return std::move(*g);
}

std::string parse_error(const std::string& text) {
  auto g = parse_graph(text, "t.kir");
  REQUIRE_FALSE(g.ok());
  return g.status().message();
}

DeviceMesh mesh_of(std::vector<std::pair<std::string, int64_t>> axes) {
  DeviceMesh m;
  for (auto& [n, s] : axes) m.axes.push_back({n, s});
  return m;
}

Tensor iota(std::vector<int64_t> shape, double scale = 1.0, double offset = 0.0) {
  Tensor t(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, offset + scale * static_cast<double>(i));
  return t;
}

std::vector<double> values(const Tensor& t) { return t.to_f64(); }

}  // namespace

TEST_CASE("mesh: ranks are row-major, groups run along one axis") {
  const DeviceMesh m = mesh_of({{"dp", 2}, {"tp", 3}});
  CHECK(m.num_ranks() == 6);
  CHECK(m.coords(4) == std::vector<int64_t>{1, 1});
  CHECK(m.rank_at({1, 2}) == 5);
  CHECK(m.group(4, 1) == std::vector<int64_t>{3, 4, 5});  // tp group of rank 4
  CHECK(m.group(4, 0) == std::vector<int64_t>{1, 4});     // dp group of rank 4
  CHECK(m.str() == "<dp = 2, tp = 3>");
  CHECK(mesh_of({{"dp", 2}, {"dp", 2}}).validate().message() == "mesh axis 'dp' is named twice");
  CHECK(mesh_of({{"tp", 0}}).validate().message() == "mesh axis 'tp' has size 0, expected >= 1");
}

TEST_CASE("placements: local pieces tile the global tensor, several axes split a dim outer-first") {
  const DeviceMesh m = mesh_of({{"dp", 2}, {"tp", 2}});
  const Tensor t = iota({4, 6});
  const Sharding s = {Placement::shard(0), Placement::shard(1)};
  CHECK(local_shape(shape_of({4, 6}), s, m) == shape_of({2, 3}));
  auto p3 = local_piece(t, s, m, 3);  // dp 1, tp 1: rows 2-3, cols 3-5
  REQUIRE(p3.ok());
  CHECK(values(*p3) == std::vector<double>{15, 16, 17, 21, 22, 23});
  // Both axes on dim 0: dp picks the outer half, tp the quarter inside it.
  const Sharding rows = {Placement::shard(0), Placement::shard(0)};
  auto p1 = local_piece(t, rows, m, 1);
  REQUIRE(p1.ok());
  CHECK(values(*p1) == std::vector<double>{6, 7, 8, 9, 10, 11});
  for (const Sharding& layout : {s, rows, Sharding{Placement::replicate(), Placement::shard(1)}, Sharding{}}) {
    std::vector<Tensor> pieces;
    for (int64_t r = 0; r < 4; ++r) pieces.push_back(*local_piece(t, layout, m, r));
    auto back = assemble(pieces, layout, m);
    REQUIRE_MESSAGE(back.ok(), back.status().message());
    CHECK(back->identical(t));
  }
  // Partial terms are summed; replicas that disagree are an error, not a silent pick.
  std::vector<Tensor> terms = {iota({2}), iota({2}, 1, 10), iota({2}), iota({2}, 1, 10)};
  auto sum = assemble(terms, {Placement::replicate(), Placement::partial()}, m);
  REQUIRE(sum.ok());
  CHECK(values(*sum) == std::vector<double>{10, 12});
  CHECK(assemble(terms, {}, m).status().message() == "replicated value differs between rank 0 and rank 1");
  CHECK(local_piece(iota({3, 6}), s, m, 0).status().message() ==
        "placement <S(0), S(1)> splits dim 0 of f32[3, 6] into 2 blocks, which does not divide 3");
}

TEST_CASE("kir text: meshes and placements round-trip and are verified") {
  const std::string text =
      "graph @tp(%x: f32[4, 8]<R, R>, %w: f32[6, 8]<R, S(0)>) -> (f32[4, 6]<R, P(sum)>) mesh<dp = 2, tp = 2> {\n"
      "  %y = linear(%x, %w) : f32[4, 6]<R, P(sum)>\n"
      "  return %y\n"
      "}\n";
  auto g = parse_ok(text);
  CHECK(print_graph(*g) == text);
  CHECK(g->mesh().num_ranks() == 4);
  CHECK(g->input(1)->sharding() == Sharding{Placement::replicate(), Placement::shard(0)});
  CHECK(g->clone()->output(0)->sharding() == Sharding{Placement::replicate(), Placement::partial()});

  CHECK(parse_error("graph @g(%x: f32[4]<S(1)>) -> (f32[4]) mesh<tp = 2> {\n  return %x\n}\n") ==
        "graph @g: %x: placement S(1) on mesh axis 'tp' of a value of type f32[4]: dim out of range");
  CHECK(parse_error("graph @g(%x: f32[3]<S(0)>) -> (f32[3]) mesh<tp = 2> {\n  return %x\n}\n") ==
        "graph @g: %x: placement <S(0)> splits dim 0 of f32[3] into 2 blocks, which does not divide 3");
  CHECK(parse_error("graph @g(%x: f32[4]<R, R>) -> (f32[4]) mesh<tp = 2> {\n  return %x\n}\n") ==
        "graph @g: %x: placement <R, R> has 2 entries for a mesh of 1 axes <tp = 2>");
  CHECK(parse_error("graph @g(%x: f32[4]<Q>) -> (f32[4]) mesh<tp = 2> {\n  return %x\n}\n") ==
        "t.kir:1:21: expected placement R, S(dim) or P(sum|max), got 'Q'");
  CHECK(parse_error("graph @g(%x: f32[4]) -> (f32[4]) mesh<tp = 2, tp = 2> {\n  return %x\n}\n") ==
        "t.kir:1:38: mesh axis 'tp' is named twice");
  // A per-rank program's types are local: no divisibility to check.
  auto local = parse_ok("graph @g(%x: f32[3]<S(0)>) -> (f32[3]<S(0)>) mesh<tp = 2> per_rank {\n  return %x\n}\n");
  CHECK(local->is_per_rank());
}

namespace {

/// Runs one per-rank program on a mesh, rank r's input being `inputs[r]`.
std::vector<Tensor> run_all(const std::string& text, const std::vector<Tensor>& inputs) {
  auto g = parse_ok(text);
  std::vector<std::vector<Tensor>> per_rank;
  for (const Tensor& t : inputs) per_rank.push_back({t});
  const Graph* programs[] = {g.get()};
  auto outs = run_mesh(g->mesh(), programs, per_rank);
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  std::vector<Tensor> first;
  for (auto& o : *outs) first.push_back(o[0]);
  return first;
}

}  // namespace

TEST_CASE("collectives: reference kernels over each group of a 2 x 2 mesh") {
  const std::vector<Tensor> in = {iota({2, 2}, 1, 0), iota({2, 2}, 1, 10), iota({2, 2}, 1, 20), iota({2, 2}, 1, 30)};
  const std::string head = "graph @c(%x: f32[2, 2]) -> (";

  // tp groups are {0, 1} and {2, 3}.
  auto sum = run_all(head + "f32[2, 2]) mesh<dp = 2, tp = 2> per_rank {\n"
                            "  %y = all_reduce(%x) {axis = \"tp\"} : f32[2, 2]\n  return %y\n}\n", in);
  CHECK(values(sum[0]) == std::vector<double>{10, 12, 14, 16});
  CHECK(values(sum[3]) == std::vector<double>{50, 52, 54, 56});
  auto mx = run_all(head + "f32[2, 2]) mesh<dp = 2, tp = 2> per_rank {\n"
                           "  %y = all_reduce(%x) {axis = \"dp\", reduce = \"max\"} : f32[2, 2]\n  return %y\n}\n", in);
  CHECK(values(mx[1]) == std::vector<double>{30, 31, 32, 33});

  auto gathered = run_all(head + "f32[2, 4]) mesh<dp = 2, tp = 2> per_rank {\n"
                                 "  %y = all_gather(%x) {axis = \"tp\", dim = 1} : f32[2, 4]\n  return %y\n}\n", in);
  CHECK(values(gathered[1]) == std::vector<double>{0, 1, 10, 11, 2, 3, 12, 13});

  auto scattered = run_all(head + "f32[1, 2]) mesh<dp = 2, tp = 2> per_rank {\n"
                                  "  %y = reduce_scatter(%x) {axis = \"tp\"} : f32[1, 2]\n  return %y\n}\n", in);
  CHECK(values(scattered[0]) == std::vector<double>{10, 12});
  CHECK(values(scattered[1]) == std::vector<double>{14, 16});

  auto a2a = run_all(head + "f32[4, 1]) mesh<dp = 2, tp = 2> per_rank {\n"
                            "  %y = all_to_all(%x) {axis = \"tp\", split_dim = 1, concat_dim = 0} : f32[4, 1]\n"
                            "  return %y\n}\n", in);
  CHECK(values(a2a[0]) == std::vector<double>{0, 2, 10, 12});
  CHECK(values(a2a[1]) == std::vector<double>{1, 3, 11, 13});

  auto bc = run_all(head + "f32[2, 2]) mesh<dp = 2, tp = 2> per_rank {\n"
                           "  %y = broadcast(%x) {axis = \"dp\", root = 1} : f32[2, 2]\n  return %y\n}\n", in);
  CHECK(values(bc[0]) == values(in[2]));
  CHECK(values(bc[3]) == values(in[3]));
}

TEST_CASE("collectives: send and recv between pipeline stages, one program per rank") {
  auto first = parse_ok(
      "graph @s0(%x: f32[2]) -> (f32[2]) mesh<pp = 2> per_rank {\n"
      "  %h = neg(%x) : f32[2]\n  send(%h) {peer = 1}\n  return %h\n}\n");
  auto second = parse_ok(
      "graph @s1(%x: f32[2]) -> (f32[2]) mesh<pp = 2> per_rank {\n"
      "  %h = recv() {dtype = f32, peer = 0, shape = [2]} : f32[2]\n  %y = add(%h, %x) : f32[2]\n  return %y\n}\n");
  const Graph* programs[] = {first.get(), second.get()};
  auto outs = run_mesh(first->mesh(), programs, {{iota({2}, 1, 1)}, {iota({2}, 1, 10)}});
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  CHECK(values((*outs)[1][0]) == std::vector<double>{9, 9});
}

TEST_CASE("collectives: a rank that never arrives fails the run in time instead of hanging") {
  // Rank 1 receives from rank 0, which never sends: the wait times out with a clear error.
  auto idle = parse_ok("graph @a(%x: f32[2]) -> (f32[2]) mesh<pp = 2> per_rank {\n  return %x\n}\n");
  auto waiting = parse_ok(
      "graph @b(%x: f32[2]) -> (f32[2]) mesh<pp = 2> per_rank {\n"
      "  %h = recv() {dtype = f32, peer = 0, shape = [2]} : f32[2]\n  return %h\n}\n");
  const Graph* programs[] = {idle.get(), waiting.get()};
  const auto t0 = std::chrono::steady_clock::now();
  auto outs = run_mesh(idle->mesh(), programs, {{iota({2})}, {iota({2})}}, std::chrono::milliseconds(200));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  REQUIRE_FALSE(outs.ok());
  CHECK(outs.status().message().find("rank 1: recv from rank 0 waited 200 ms") != std::string::npos);
  // A failing rank aborts the others' waits at once; its own error is the one reported.
  auto bad = parse_ok(
      "graph @c(%x: f32[2]) -> (f32[2]) mesh<tp = 2> per_rank {\n"
      "  %y = all_reduce(%x) {axis = \"tp\"} : f32[2]\n  return %y\n}\n");
  const Graph* one[] = {bad.get()};
  auto mismatch = run_mesh(bad->mesh(), one, {{iota({2})}, {iota({3})}});
  REQUIRE_FALSE(mismatch.ok());
  CHECK(mismatch.status().message().find("rank 1") != std::string::npos);
  // Outside a mesh run a collective is refused, not silently skipped.
  Interpreter plain;
  Tensor x = iota({2});
  CHECK(plain.run(*bad, {&x, 1}).status().message().find("a collective runs only as part of a mesh run") !=
        std::string::npos);
}

TEST_CASE("run_mesh: a hand-partitioned tensor-parallel MLP matches the unsharded one") {
  // Column-parallel up projection (w1 rows split), row-parallel down projection (w2 columns
  // split), one all_reduce: Megatron's MLP on two ranks.
  auto whole = parse_ok(
      "graph @mlp(%x: f32[3, 4], %w1: f32[8, 4], %w2: f32[4, 8]) -> (f32[3, 4]) {\n"
      "  %h = linear(%x, %w1) : f32[3, 8]\n  %a = relu(%h) : f32[3, 8]\n  %y = linear(%a, %w2) : f32[3, 4]\n"
      "  return %y\n}\n");
  auto rank = parse_ok(
      "graph @mlp(%x: f32[3, 4]<R>, %w1: f32[4, 4]<S(0)>, %w2: f32[4, 4]<S(1)>) -> (f32[3, 4]<R>) mesh<tp = 2> per_rank {\n"
      "  %h = linear(%x, %w1) : f32[3, 4]<S(1)>\n  %a = relu(%h) : f32[3, 4]<S(1)>\n"
      "  %p = linear(%a, %w2) : f32[3, 4]<P(sum)>\n  %y = all_reduce(%p) {axis = \"tp\"} : f32[3, 4]<R>\n"
      "  return %y\n}\n");
  const Tensor x = iota({3, 4}, 0.25, -1), w1 = iota({8, 4}, 0.125, -2), w2 = iota({4, 8}, -0.0625, 1);
  Interpreter interp;
  const Tensor args[] = {x, w1, w2};
  auto want = interp.run(*whole, args);
  REQUIRE(want.ok());
  std::vector<std::vector<Tensor>> per_rank;
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<Tensor> in;
    for (int i = 0; i < 3; ++i) in.push_back(*local_piece(args[i], rank->input(i)->sharding(), rank->mesh(), r));
    per_rank.push_back(std::move(in));
  }
  const Graph* programs[] = {rank.get()};
  auto outs = run_mesh(rank->mesh(), programs, per_rank);
  REQUIRE_MESSAGE(outs.ok(), outs.status().message());
  std::vector<Tensor> ys = {(*outs)[0][0], (*outs)[1][0]};
  auto got = assemble(ys, rank->output(0)->sharding(), rank->mesh());
  REQUIRE(got.ok());
  const auto w = values((*want)[0]), g = values(*got);
  for (size_t i = 0; i < w.size(); ++i) CHECK(g[i] == doctest::Approx(w[i]).epsilon(1e-6));
}

TEST_CASE("MeshRunner: each rank's variables persist across runs; state reads whole and splits back") {
  // A data-parallel SGD step by hand: each rank's rows give a partial gradient, all-reduced, so
  // the replicated weight moves alike everywhere; `seen` keeps each rank's own rows (split).
  auto g = parse_ok(
      "graph @step(%x: f32[2, 2]<S(0)>) -> (f32[2]<R>) mesh<dp = 2> per_rank {\n"
      "  %w = variable() {init = dense<f32[2]>[1.0, 2.0], name = \"w\"} : f32[2]<R>\n"
      "  %seen = variable() {init = dense<f32[2, 2]>[0.0, 0.0, 0.0, 0.0], name = \"seen\"} : f32[2, 2]<S(0)>\n"
      "  %p = reduce_sum(%x) {axes = [0], keepdims = 0} : f32[2]<P(sum)>\n"
      "  %grad = all_reduce(%p) {axis = \"dp\"} : f32[2]<R>\n"
      "  %lr = constant() {value = dense<f32[]>[0.125]} : f32[]<R>\n"
      "  %d = mul(%grad, %lr) : f32[2]<R>\n  %w1 = sub(%w, %d) : f32[2]<R>\n"
      "  %s1 = add(%seen, %x) : f32[2, 2]<S(0)>\n"
      "  assign(%w1) {name = \"w\"}\n  assign(%s1) {name = \"seen\"}\n"
      "  return %w1\n}\n");
  MeshRunner runner(g->mesh(), {g.get()});
  const Tensor x = iota({4, 2}, 1, 1);  // column sums 16 and 20
  auto pieces = split_inputs_by_rank(*g, std::vector<Tensor>{x});
  REQUIRE(pieces.ok());
  for (int step = 0; step < 3; ++step) REQUIRE_MESSAGE(runner.run(*pieces).ok(), "step " << step);
  // Every rank's weight holds the same bits.
  const auto r0 = runner.rank(0).state_of(*g), r1 = runner.rank(1).state_of(*g);
  CHECK(r0.at("w").identical(r1.at("w")));
  CHECK(values(r0.at("w")) == std::vector<double>{1 - 3 * 2.0, 2 - 3 * 2.5});
  CHECK_FALSE(r0.at("seen").identical(r1.at("seen")));
  auto whole = runner.read_state();
  REQUIRE_MESSAGE(whole.ok(), whole.status().message());
  CHECK(values(whole->at("seen")) == std::vector<double>{3, 6, 9, 12, 15, 18, 21, 24});
  CHECK(whole->at("seen").shape() == std::vector<int64_t>{4, 2});
  // Written back whole: each rank takes its block.
  std::map<std::string, Tensor> reset = {{"seen", iota({4, 2}, 0, 0)}, {"w", iota({2}, 0, 5)}};
  REQUIRE(runner.write_state(reset).ok());
  CHECK(values(runner.rank(1).state_of(*g).at("seen")) == std::vector<double>{0, 0, 0, 0});
  CHECK(values(runner.rank(1).state_of(*g).at("w")) == std::vector<double>{5, 5});
  // A whole value of the wrong shape changes nothing.
  CHECK_FALSE(runner.write_state({{"seen", iota({2, 2})}}).ok());
  CHECK_FALSE(runner.write_state({{"nope", iota({2})}}).ok());
}

TEST_CASE("MeshRunner: a replicated variable that differs between ranks cannot be read whole") {
  auto g = parse_ok(
      "graph @bad(%x: f32[1, 2]<S(0)>) -> (f32[1, 2]<S(0)>) mesh<dp = 2> per_rank {\n"
      "  %v = variable() {init = dense<f32[1, 2]>[0.0, 0.0], name = \"v\"} : f32[1, 2]<R>\n"
      "  assign(%x) {name = \"v\"}\n  return %x\n}\n");
  MeshRunner runner(g->mesh(), {g.get()});
  auto pieces = split_inputs_by_rank(*g, std::vector<Tensor>{iota({2, 2})});
  REQUIRE(pieces.ok());
  REQUIRE(runner.run(*pieces).ok());
  auto whole = runner.read_state();
  REQUIRE_FALSE(whole.ok());
  CHECK(whole.status().message().find("variable 'v'") != std::string::npos);
  CHECK(whole.status().message().find("differs") != std::string::npos);
}
