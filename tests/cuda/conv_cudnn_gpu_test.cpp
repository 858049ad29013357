// GPU check of cuDNN conv steps against the reference interpreter: f32 (strict and tf32), f16
// and bf16; stride, padding, dilation, groups (depthwise too), 1x1, 1-D and 3-D; bias, relu
// and a residual (plain add and a fuse-pointwise group); each with CUDA graphs on and off.
// Needs libcudnn.so.9 on the loader path. Exits 77 (skip) without a GPU.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kiln/core/artifact.h"
#include "kiln/core/driver.h"
#include "kiln/ir/text.h"
#include "kiln/runtime.h"
#include "artifact_run.h"
#include "gpu_test_util.h"

namespace {

using namespace kiln;

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

// T is replaced by the dtype.
const char* kCases[][2] = {
    {"bias-relu-groups-stride", R"(graph @g(%x: T[2, 4, 9, 9], %w: T[6, 2, 3, 3], %b: T[6]) -> (T[2, 6, 5, 5], T[2, 6, 4, 4]) {
  %c = conv(%x, %w, %b) {groups = 2, strides = [2, 2], pads = [1, 1, 1, 1]} : T[2, 6, 5, 5]
  %y = relu(%c) : T[2, 6, 5, 5]
  %d = conv(%x, %w) {groups = 2, strides = [2, 2], dilations = [2, 2], pads = [1, 1, 1, 1]} : T[2, 6, 4, 4]
  return %y, %d })"},
    {"residual-1x1-depthwise", R"(graph @g(%x: T[2, 8, 8, 8], %w: T[8, 8, 3, 3], %b: T[8], %v: T[16, 8, 1, 1], %dw: T[8, 1, 3, 3]) -> (T[2, 8, 8, 8], T[2, 16, 8, 8], T[2, 8, 8, 8]) {
  %c = conv(%x, %w, %b) {pads = [1, 1, 1, 1]} : T[2, 8, 8, 8]
  %s = add(%c, %x) : T[2, 8, 8, 8]
  %y = relu(%s) : T[2, 8, 8, 8]
  %p = conv(%x, %v) : T[2, 16, 8, 8]
  %d = conv(%x, %dw) {groups = 8, pads = [1, 1, 1, 1]} : T[2, 8, 8, 8]
  return %y, %p, %d })"},
    {"fused-residual-downsample", R"(graph @g(%x: T[2, 4, 8, 8], %w: T[8, 4, 3, 3], %b: T[8], %v: T[8, 4, 1, 1], %e: T[8]) -> (T[2, 8, 4, 4]) {
  %c = conv(%x, %w, %b) {strides = [2, 2], pads = [1, 1, 1, 1]} : T[2, 8, 4, 4]
  %d = conv(%x, %v, %e) {strides = [2, 2]} : T[2, 8, 4, 4]
  %y = fused(%c, %d) : T[2, 8, 4, 4] {
    graph @fused(%p: T[2, 8, 4, 4], %q: T[2, 8, 4, 4]) -> (T[2, 8, 4, 4]) {
      %s = add(%p, %q) : T[2, 8, 4, 4]
      %r = relu(%s) : T[2, 8, 4, 4]
      return %r
    }
  }
  return %y })"},
    // Channels last (the layout-nhwc pass): H != W so a swapped stride shows; bias, residual
    // and relu, 1x1, depthwise, strided.
    {"nhwc", R"(graph @g(%x: T[2, 6, 10, 8], %w: T[8, 3, 3, 8], %b: T[8], %v: T[16, 1, 1, 8], %dw: T[8, 3, 3, 1], %u: T[12, 3, 3, 8]) -> (T[2, 6, 10, 8], T[2, 6, 10, 16], T[2, 6, 10, 8], T[2, 3, 5, 12]) {
  %c = conv(%x, %w, %b) {pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 6, 10, 8]
  %s = add(%c, %x) : T[2, 6, 10, 8]
  %y = relu(%s) : T[2, 6, 10, 8]
  %p = conv(%x, %v) {layout = "nhwc"} : T[2, 6, 10, 16]
  %d = conv(%x, %dw) {groups = 8, pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 6, 10, 8]
  %e = conv(%x, %u) {strides = [2, 2], pads = [1, 1, 1, 1], layout = "nhwc"} : T[2, 3, 5, 12]
  return %y, %p, %d, %e })"},
    // With tf32 these take the stem kernel (conv_stem.cpp): partial bands and pixel tiles, 72
    // output channels (one pixel tile per warp), asymmetric pads, 3-tap rows.
    {"rgb-stems", R"(graph @g(%x: T[2, 3, 37, 45], %w: T[16, 3, 7, 7], %b: T[16], %v: T[1, 4, 20, 13], %u: T[72, 4, 3, 3]) -> (T[2, 16, 19, 23], T[1, 72, 21, 12]) {
  %c = conv(%x, %w, %b) {strides = [2, 2], pads = [3, 3, 3, 3]} : T[2, 16, 19, 23]
  %y = relu(%c) : T[2, 16, 19, 23]
  %d = conv(%v, %u) {pads = [1, 0, 2, 1]} : T[1, 72, 21, 12]
  return %y, %d })"},
    {"1d-3d", R"(graph @g(%s: T[2, 4, 12], %sw: T[3, 4, 3], %sb: T[3], %t: T[1, 2, 5, 5, 5], %tw: T[3, 2, 2, 2, 2]) -> (T[2, 3, 6], T[1, 3, 3, 3, 3]) {
  %d = conv(%s, %sw, %sb) {strides = [2], pads = [1, 1]} : T[2, 3, 6]
  %e = conv(%t, %tw) {strides = [2, 2, 2], pads = [1, 1, 1, 1, 1, 1]} : T[1, 3, 3, 3, 3]
  return %d, %e })"},
};


/// Builds the cuda-sm90 artifact for `g` with the given backend options; its plan must hold a
/// cuDNN conv step, or for `stem` graphs the TF32 stem kernel's launches.
StatusOr<std::string> build(const Graph& g, Registry& reg, bool tf32, bool stem) {
  KILN_ASSIGN_OR_RETURN(const BackendInfo* info, reg.backend("cuda-sm90"));
  KILN_ASSIGN_OR_RETURN(Options opts, resolve_options(info->options,
                                                      {{"conv", std::string("cudnn")}, {"allow-tf32", tf32}},
                                                      "cuda-sm90"));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, info->create(opts));
  ArtifactContents art;
  std::string targets;
  for (const std::string& t : info->targets) targets += (targets.empty() ? "" : ",") + t;
  art.meta = {{"created_by", "conv_cudnn_gpu_test"}, {"targets", targets}};
  KILN_RETURN_IF_ERROR(backend->build_artifact(g, info->targets, art));
  if (stem && art.plan.find("_conv_stem ") == std::string::npos) return internal_error("the plan has no stem kernel");
  if (!stem && art.plan.find("step conv ") == std::string::npos) return internal_error("the plan has no conv step");
  return serialize_artifact(art);
}

}  // namespace

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  Registry& reg = Registry::global();
  int failures = 0, cases = 0;
  struct Config { const char* dtype; bool tf32; };
  for (const Config& cfg : {Config{"f32", false}, Config{"f32", true}, Config{"f16", false}, Config{"bf16", false}})
    for (const auto& c : kCases)
      for (bool graphs : {true, false}) {
        const std::string name = std::string(c[0]) + " " + cfg.dtype + (cfg.tf32 ? " tf32" : "") +
                                 (graphs ? " graphs" : " eager");
        std::string why;
        auto g = parse_graph(replace_all(c[1], "T[", std::string(cfg.dtype) + "["), "conv");
        if (!g.ok()) {
          why = g.status().message();
        } else {
          InputBindings b;
          b.random = true;
          b.seed = 5;
          auto inputs = bind_inputs(**g, b);
          auto want = inputs.ok() ? compile_and_run(**g, StageSpec{"reference", {}, {}}, reg, *inputs) : inputs.status();
          auto bytes = build(**g, reg, cfg.tf32, cfg.tf32 && std::string(c[0]) == "rgb-stems");
          if (!want.ok()) why = "reference: " + want.status().message();
          else if (!bytes.ok()) why = bytes.status().message();
          std::vector<Tensor> got;
          for (const Value* v : (*g)->outputs()) got.emplace_back(v->dtype(), static_sizes(v->shape()));
          if (why.empty())
            why = run_artifact(*bytes, *inputs, got, {.cuda_graphs = graphs, .runs = 2});
          for (size_t i = 0; why.empty() && i < got.size(); ++i)
            if (const test::Verdict v =
                    test::allclose((*want)[i], got[i], test::fused_conv_tolerance(*parse_dtype(cfg.dtype), cfg.tf32));
                !v.ok())
              why = "output " + std::to_string(i) + ": " + v.why;
        }
        std::printf("%s %s%s%s\n", why.empty() ? "PASS" : "FAIL", name.c_str(), why.empty() ? "" : ": ", why.c_str());
        failures += !why.empty();
        ++cases;
      }
  std::printf("%d of %d cases failed\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
