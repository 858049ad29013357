// GPU test (ctest label gpu; exit 77 without a GPU): per-rank programs over a mesh of one rank
// run on cuda-sm90 through NCCL (a world of one) and match the reference interpreter's whole-mesh
// run (run_mesh): every collective op, the packing kernels, local_shard of weights and
// activations, and CUDA-graph replay of a plan with collective steps on new inputs.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kiln/core/artifact.h"
#include "kiln/ir/mesh_run.h"
#include "kiln/runtime.h"

namespace kiln {
namespace {

/// A per-rank program over `mesh` of one collective (or local_shard) between x and y.
std::string program(const std::string& mesh, const std::string& in, const std::string& out,
                    const std::string& op) {
  return "graph @c(%x: " + in + ") -> (" + out + ") mesh<" + mesh + "> per_rank {\n  %y = " + op +
         " : " + out + "\n  return %y\n}\n";
}

/// Runs `g` with run_mesh: the reference every rank's outputs are checked against.
StatusOr<std::vector<Tensor>> reference(const Graph& g, const std::vector<Tensor>& inputs) {
  const Graph* programs[] = {&g};
  KILN_ASSIGN_OR_RETURN(auto outs, run_mesh(g.mesh(), programs, {inputs}));
  return outs[0];
}

// The shared comparator (tests/common/compare.h): NaN and misplaced infinities always fail.
std::string exact(const Tensor& want, const Tensor& got) { return test::allclose(want, got, test::kExact).why; }

std::string approx(const Tensor& want, const Tensor& got) { return test::sqnr_at_least(want, got, 100).why; }

/// Through the cuda-sm90 backend (compile_and_run: CudaExecutable loads the per-rank program as
/// a world of one, its plan replayed as a CUDA graph), against run_mesh.
std::string via_backend(const std::string& text, uint64_t seed, const OutputCheck& check) {
  auto g = parse_graph(text, "collective.kir");
  if (!g.ok()) return g.status().message();
  InputBindings b;
  b.random = true;
  b.seed = seed;
  auto inputs = bind_inputs(**g, b);
  if (!inputs.ok()) return inputs.status().message();
  auto want = reference(**g, *inputs);
  if (!want.ok()) return "run_mesh: " + want.status().message();
  auto got = compile_and_run(**g, StageSpec{"cuda-sm90", {}, {}}, Registry::global(), *inputs);
  if (!got.ok()) return got.status().message();
  for (size_t i = 0; i < want->size(); ++i)
    if (std::string why = check((*want)[i], (*got)[i]); !why.empty())
      return "output " + std::to_string(i) + ": " + why;
  return "";
}

std::string take(kiln_status* st) {
  std::string m = st ? kiln_status_get_message(st) : "";
  kiln_status_release(st);
  return m;
}

/// The C API path: an artifact loaded with kiln_model_load_memory_distributed as rank 0 of a
/// world of one, graphs on, run three times on new inputs (each a replay of the captured plan),
/// every run against run_mesh; the mesh and placement queries on the way.
std::string replays(const std::string& text) {
  auto g = parse_graph(text, "replay.kir");
  if (!g.ok()) return g.status().message();
  auto be = Registry::global().backend("cuda-sm90");
  if (!be.ok()) return be.status().message();
  auto opts = resolve_options((*be)->options, {}, "cuda-sm90");
  if (!opts.ok()) return opts.status().message();
  auto backend = (*be)->create(*opts);
  if (!backend.ok()) return backend.status().message();
  ArtifactContents art;
  art.meta = {{"kiln_version", "test"}, {"targets", "sm_90a"}};
  if (Status s = (*backend)->build_artifact(**g, {"sm_90a"}, art); !s.ok()) return s.message();
  const std::string bytes = serialize_artifact(art);
  kiln_runtime_options ro;
  kiln_runtime_options_initialize(&ro);
  kiln_runtime* rt = nullptr;
  kiln_model* m = nullptr;
  std::string why = take(kiln_runtime_create(&ro, &rt));
  kiln_distributed_options o;
  kiln_distributed_options_initialize(&o);
  o.from_environment = 0;  // rank 0 of 1, whatever the environment says
  o.collective_timeout_s = 60;
  if (why.empty())
    why = take(kiln_model_load_memory_distributed(rt, bytes.data(), bytes.size(), &o, &m));
  kiln_mesh_info mi{};
  mi.struct_size = sizeof mi;
  if (why.empty()) why = take(kiln_model_mesh_info(m, &mi));
  if (why.empty() && (mi.num_axes != 1 || mi.world_size != 1 || mi.rank != 0 ||
                      std::string(mi.axis_names[0]) != "tp"))
    why = "mesh info: " + std::to_string(mi.num_axes) + " axes, world " +
          std::to_string(mi.world_size);
  kiln_tensor_placement pl{};
  pl.struct_size = sizeof pl;
  if (why.empty()) why = take(kiln_model_input_placement(m, 1, &pl));
  if (why.empty() &&
      (pl.kinds[0] != KILN_PLACEMENT_SHARD || pl.shard_dims[0] != 0 || pl.global_dims[0] != 8))
    why = "placement of w1: kind " + std::to_string(pl.kinds[0]) + ", dim " +
          std::to_string(pl.shard_dims[0]);
  for (uint64_t seed = 1; seed <= 3 && why.empty(); ++seed) {
    InputBindings b;
    b.random = true;
    b.seed = seed;
    auto inputs = bind_inputs(**g, b);
    auto want = reference(**g, *inputs);
    if (!want.ok()) return want.status().message();
    std::vector<kiln_host_tensor> in, out;
    for (const Tensor& t : *inputs) in.push_back({const_cast<std::byte*>(t.data()), t.nbytes()});
    std::vector<Tensor> got;
    for (const Tensor& t : *want) got.emplace_back(t.dtype(), t.shape());
    for (Tensor& t : got) out.push_back({t.mutable_data(), t.nbytes()});
    why = take(kiln_model_run(m, in.data(), in.size(), out.data(), out.size()));
    for (size_t i = 0; why.empty() && i < got.size(); ++i) why = approx((*want)[i], got[i]);
    if (!why.empty()) why = "run " + std::to_string(seed) + ": " + why;
  }
  // The host all-gather of a world of one returns what it was given.
  const char send[4] = {1, 2, 3, 4};
  char recv[4] = {};
  if (why.empty()) why = take(kiln_model_all_gather_host(m, send, sizeof send, recv));
  if (why.empty() && std::memcmp(send, recv, sizeof send) != 0)
    why = "all_gather_host changed the bytes";
  kiln_model_release(m);
  kiln_runtime_release(rt);
  return why;
}

}  // namespace
}  // namespace kiln

int main() {
  using namespace kiln;
  if (int rc = start_gpu_test()) return rc;
  int failures = 0;
  const std::string one = "tp = 1", two_axes = "dp = 1, tp = 1";
  struct Case {
    std::string name, text;
  };
  const std::vector<Case> cases = {
      {"all_reduce sum f32",
       program(one, "f32[4, 8]", "f32[4, 8]", "all_reduce(%x) {axis = \"tp\"}")},
      {"all_reduce max bf16",
       program(one, "bf16[33]", "bf16[33]", "all_reduce(%x) {axis = \"tp\", reduce = \"max\"}")},
      {"all_reduce i32 over the second axis",
       program(two_axes, "i32[6]", "i32[6]", "all_reduce(%x) {axis = \"tp\"}")},
      {"all_gather dim 0",
       program(one, "f32[2, 3]", "f32[2, 3]", "all_gather(%x) {axis = \"tp\", dim = 0}")},
      {"all_gather dim 1 (packing kernel)",
       program(one, "f16[2, 3, 5]", "f16[2, 3, 5]", "all_gather(%x) {axis = \"tp\", dim = 1}")},
      {"reduce_scatter dim 1 (packing kernel)",
       program(one, "f32[3, 4]", "f32[3, 4]", "reduce_scatter(%x) {axis = \"tp\", dim = 1}")},
      {"all_to_all split 1 concat 0",
       program(one, "f32[4, 6]", "f32[4, 6]",
               "all_to_all(%x) {axis = \"tp\", split_dim = 1, concat_dim = 0}")},
      {"all_to_all split 0 concat 1",
       program(one, "i8[4, 6]", "i8[4, 6]",
               "all_to_all(%x) {axis = \"tp\", split_dim = 0, concat_dim = 1}")},
      {"broadcast",
       program(two_axes, "f32[7]", "f32[7]", "broadcast(%x) {axis = \"dp\", root = 0}")},
      {"local_shard of an activation",
       program(one, "f32[3, 4]", "f32[3, 4]", "local_shard(%x) {axis = \"tp\", dim = 1}")},
      {"local_shard of a weight",
       "graph @w(%x: f32[3, 4]) -> (f32[3, 2]) mesh<tp = 1> per_rank {\n"
       "  %w = constant() {value = dense<f32[2, 4]>[1, 2, 3, 4, 5, 6, 7, 8]} : f32[2, 4]\n"
       "  %s = local_shard(%w) {axis = \"tp\", dim = 0} : f32[2, 4]\n"
       "  %y = linear(%x, %s) : f32[3, 2]\n  return %y\n}\n"},
  };
  uint64_t seed = 11;
  for (const Case& c : cases) {
    const bool gemm = c.name.find("weight") != std::string::npos;
    failures += report_case(
        c.name, via_backend(c.text, seed++, gemm ? OutputCheck(approx) : OutputCheck(exact)));
  }
  const std::string mlp =
      "graph @mlp(%x: f32[3, 8]<R>, %w1: f32[8, 8]<S(0)>, %w2: f32[8, 8]<S(1)>) -> (f32[3, 8]<R>) "
      "mesh<tp = 1> "
      "per_rank {\n"
      "  %h = linear(%x, %w1) : f32[3, 8]<S(1)>\n  %a = relu(%h) : f32[3, 8]<S(1)>\n"
      "  %p = linear(%a, %w2) : f32[3, 8]<P(sum)>\n  %y = all_reduce(%p) {axis = \"tp\"} : f32[3, "
      "8]<R>\n"
      "  return %y\n}\n";
  failures += report_case("tensor-parallel MLP", via_backend(mlp, 5, approx));
  failures += report_case("CUDA graph replay of a plan with a collective, new inputs each run",
                          replays(mlp));
  std::printf("%s: %d failure%s\n", failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
