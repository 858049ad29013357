// GPU test (ctest label gpu; exit 77 without a GPU) of a failing collective on one GPU: a world
// of one rank whose plan sends to itself with no receive. NCCL 2.28 refuses it (ncclInvalidUsage,
// seen on an H200) rather than waiting, so this checks the abort path on an NCCL error: the run
// fails with COLLECTIVE_FAILED naming the step, within timeout + 10 s, and the model refuses later
// runs. A true stall needs a peer: bench/parallel/check.py kills one of two ranks mid-run. A
// binary of its own: the aborted work may linger on the device.
#include <chrono>
#include <cstdio>
#include <string>

#include "gpu_test_util.h"
#include "kiln/core/artifact.h"
#include "kiln/runtime.h"

namespace kiln {
namespace {

const char* kStall =
    "graph @stall(%x: f32[4]) -> (f32[4]) mesh<tp = 1> per_rank {\n"
    "  send(%x) {peer = 0, tag = 1}\n"
    "  %y = neg(%x) : f32[4]\n  return %y\n}\n";

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

StatusOr<std::string> artifact_bytes() {
  KILN_ASSIGN_OR_RETURN(auto g, parse_graph(kStall, "stall.kir"));
  KILN_ASSIGN_OR_RETURN(const BackendInfo* be, Registry::global().backend("cuda-sm90"));
  KILN_ASSIGN_OR_RETURN(Options opts, resolve_options(be->options, {}, "cuda-sm90"));
  KILN_ASSIGN_OR_RETURN(auto backend, be->create(opts));
  ArtifactContents art;
  art.meta = {{"kiln_version", "test"}, {"targets", "sm_90a"}};
  KILN_RETURN_IF_ERROR(backend->build_artifact(*g, {"sm_90a"}, art));
  return serialize_artifact(art);
}

/// Loads the stalling plan (graphs on: the warm-up run at load stalls; off: the first run does)
/// with a 3 s collective timeout, and checks the failure and how long it took.
std::string stalls(bool graphs) {
  auto bytes = artifact_bytes();
  if (!bytes.ok()) return bytes.status().message();
  kiln_runtime_options ro;
  kiln_runtime_options_initialize(&ro);
  ro.use_cuda_graphs = graphs ? 1 : 0;
  kiln_runtime* rt = nullptr;
  if (kiln_status* st = kiln_runtime_create(&ro, &rt)) {
    const std::string m = kiln_status_get_message(st);
    kiln_status_release(st);
    return m;
  }
  kiln_distributed_options o;
  kiln_distributed_options_initialize(&o);
  o.from_environment = 0;
  o.collective_timeout_s = 3;
  kiln_model* m = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  kiln_status* st = kiln_model_load_memory_distributed(rt, bytes->data(), bytes->size(), &o, &m);
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  kiln_host_tensor in{x, sizeof x}, out{y, sizeof y};
  if (!st) st = kiln_model_run(m, &in, 1, &out, 1);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string why;
  if (!st) {
    why = "the stalled plan ran to the end";
  } else {
    const std::string msg = kiln_status_get_message(st);
    std::printf("  %s after %.1f s: %s\n", graphs ? "load" : "run", secs, msg.c_str());
    if (kiln_status_get_code(st) != KILN_STATUS_COLLECTIVE_FAILED)
      why = "code " + std::to_string(kiln_status_get_code(st));
    else if (!contains(msg, "send to rank 0 of 4 f32"))
      why = "the message does not name the step: " + msg;
    else if (secs > 13)
      why = "took " + std::to_string(secs) + " s, more than the timeout + 10 s";
    kiln_status_release(st);
  }
  if (why.empty() && m) {
    // The aborted model refuses to run again.
    kiln_status* again = kiln_model_run(m, &in, 1, &out, 1);
    if (!again || kiln_status_get_code(again) != KILN_STATUS_COLLECTIVE_FAILED)
      why = "a second run did not fail";
    else if (!contains(kiln_status_get_message(again), "cannot run again") &&
             !contains(kiln_status_get_message(again), "aborted by an earlier failure"))
      why = kiln_status_get_message(again);
    kiln_status_release(again);
  }
  kiln_model_release(m);
  kiln_runtime_release(rt);
  return why;
}

}  // namespace
}  // namespace kiln

int main() {
  using namespace kiln;
  if (int rc = start_gpu_test()) return rc;
  int failures = report_case("a failing collective fails the run (no CUDA graph)", stalls(false));
  failures +=
      report_case("a failing collective fails the warm-up at load (CUDA graph)", stalls(true));
  std::printf("%s: %d failure%s\n", failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
