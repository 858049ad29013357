// GPU check of autotuning: a graph with a strided-batched bf16 matmul, an f16 linear with bias
// and relu, and a bf16 cuDNN conv is compiled twice with autotune on (the second compile takes
// every choice from the kernel cache), each tuned step carries its algo=, the outputs match the
// reference interpreter, and a plan whose gemm algo= does not fit falls back to the heuristic.
// Exits 77 (skip) without a GPU; needs libcudnn.so.9 on the loader path.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "artifact_run.h"
#include "gpu_test_util.h"
#include "kiln/core/artifact.h"
#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "kiln/runtime.h"

namespace {

using namespace kiln;

const char* kGraph = R"(graph @g(%a: bf16[3, 128, 256], %b: bf16[3, 256, 192], %x: f16[96, 256], %w: f16[128, 256], %bias: f16[128], %i: bf16[2, 8, 16, 16], %k: bf16[16, 8, 3, 3]) -> (bf16[3, 128, 192], f16[96, 128], bf16[2, 16, 16, 16]) {
  %m = matmul(%a, %b) : bf16[3, 128, 192]
  %h = linear(%x, %w, %bias) : f16[96, 128]
  %y = relu(%h) : f16[96, 128]
  %c = conv(%i, %k) {pads = [1, 1, 1, 1]} : bf16[2, 16, 16, 16]
  return %m, %y, %c })";

/// The cuda-sm90 artifact for `g` with autotune on; `summary` receives meta's autotune line.
StatusOr<ArtifactContents> build(const Graph& g, Registry& reg) {
  KILN_ASSIGN_OR_RETURN(const BackendInfo* info, reg.backend("cuda-sm90"));
  KILN_ASSIGN_OR_RETURN(Options opts, resolve_options(info->options, {{"autotune", true}}, "cuda-sm90"));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, info->create(opts));
  ArtifactContents art;
  art.meta = {{"created_by", "autotune_gpu_test"}, {"targets", "sm_90a"}};
  KILN_RETURN_IF_ERROR(backend->build_artifact(g, info->targets, art));
  return art;
}

std::vector<std::string> plan_lines(const std::string& plan, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(plan);
  for (std::string line; std::getline(in, line);)
    if (line.starts_with(prefix)) out.push_back(line);
  return out;
}

/// PyTorch's assert_close rtol, atol = rtol for the half types (one rounding apart); NaN and
/// misplaced infinities fail (tensor_compare.h).
std::string compare(const std::vector<Tensor>& want, const std::vector<Tensor>& got) {
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = got[i].dtype() == DType::kBF16 ? 1.6e-2 : 1e-3;
    if (const test::Verdict v = test::allclose(want[i], got[i], {tol, tol}); !v.ok())
      return "output " + std::to_string(i) + ": " + v.why;
  }
  return "";
}

std::string contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos ? "" : "'" + text + "' lacks '" + part + "'";
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  // A fresh kernel cache: the first compile must tune, the second must find every choice.
  char dir[] = "/tmp/kiln-autotune-gpu-XXXXXX";
  if (!mkdtemp(dir)) return std::printf("FAIL: mkdtemp\n"), 1;
  setenv("KILN_CACHE_DIR", dir, 1);
  Registry& reg = Registry::global();
  int failures = 0;

  auto g = parse_graph(kGraph, "autotune");
  if (!g.ok()) return std::printf("FAIL: %s\n", g.status().message().c_str()), 1;
  InputBindings b;
  b.random = true;
  b.seed = 11;
  auto inputs = bind_inputs(**g, b);
  auto want = compile_and_run(**g, StageSpec{"reference", {}, {}}, reg, *inputs);
  if (!want.ok()) return std::printf("FAIL: reference: %s\n", want.status().message().c_str()), 1;
  auto fresh_outputs = [&] {
    std::vector<Tensor> got;
    for (const Value* v : (*g)->outputs()) got.emplace_back(v->dtype(), static_sizes(v->shape()));
    return got;
  };

  auto first = build(**g, reg);
  auto second = first.ok() ? build(**g, reg) : first;
  std::string why = !first.ok() ? first.status().message() : !second.ok() ? second.status().message() : "";
  std::string plan1, plan2, bytes;
  if (why.empty()) {
    plan1 = first->plan, plan2 = second->plan;
    std::printf("first compile:  %s\nsecond compile: %s\n", first->meta["autotune"].c_str(), second->meta["autotune"].c_str());
    why = contains(first->meta["autotune"], "autotune: 2 gemm problems (0 from cache), 1 conv (0 from cache) on sm_90");
    bytes = serialize_artifact(*first);
  }
  failures += report_case("first compile tunes 2 gemm problems and 1 conv", why);
  if (why.empty()) {
    why = contains(second->meta["autotune"], "autotune: 2 gemm problems (2 from cache), 1 conv (1 from cache)");
    if (why.empty() && plan2 != plan1) why = "the second compile's plan differs from the first's";
  }
  failures += report_case("second compile takes every choice from the kernel cache", why);

  if (!plan1.empty()) {
    why.clear();
    for (const std::string& prefix : {std::string("step gemm "), std::string("step conv ")}) {
      const auto lines = plan_lines(plan1, prefix);
      if (lines.empty()) why = "the plan has no '" + prefix + "' line";
      for (const std::string& l : lines)
        if (why.empty() && l.find(" algo=") == std::string::npos) why = "untuned step: " + l;
    }
    failures += report_case("every gemm and conv step carries its algo=", why);

    std::vector<Tensor> got = fresh_outputs();
    std::vector<std::string> problems;
    why = run_artifact(bytes, *inputs, got, {.problems = &problems});
    if (why.empty()) why = compare(*want, got);
    failures += report_case("the tuned plan matches the reference", why);
    if (why.empty() && problems.size() != 3) why = std::to_string(problems.size()) + " tunable steps, expected 3";
    for (const std::string& p : problems) std::printf("  problem: %s\n", p.c_str());
    if (why.empty()) why = contains(problems[0] + problems[1] + problems[2], "gemm 128x192x256 batch 3 bf16 | ");
    if (why.empty()) why = contains(problems[0] + problems[1] + problems[2], " device=");
    failures += report_case("step descriptors name the problem and the device", why);

    // A choice cuBLASLt does not recognise (another GPU's or library's): noted, heuristic used.
    ArtifactContents bad = *first;
    const size_t at = bad.plan.find("step gemm ");
    const size_t algo = bad.plan.find(" algo=", at);
    bad.plan.replace(algo + 6, 128, std::string(128, '0'));
    got = fresh_outputs();
    why = run_artifact(serialize_artifact(bad), *inputs, got);
    if (why.empty()) why = compare(*want, got);
    failures += report_case("a gemm algo= that does not fit falls back to the heuristic", why);
  }
  std::filesystem::remove_all(dir);
  std::printf("%d failed\n", failures);
  return failures == 0 ? 0 : 1;
}
