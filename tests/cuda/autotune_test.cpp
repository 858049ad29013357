// Autotuning without a GPU: the backend option in a pipeline TOML, tuned-choice cache entries
// (key, payload round trip, corrupt entries), writing choices into plan lines, matching the
// device to a target, and the note a compile with autotune on gives where no GPU is present.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "kiln/artifact_reader.h"
#include "kiln/core/kernel_cache.h"
#include "kiln/core/pipeline.h"
#include "kiln/cuda/autotune.h"
#include "kiln/cuda/backend.h"
#include "kiln/ir/text.h"
#include "kiln/runtime.h"

namespace kiln::cuda {
namespace {

Registry& registry() {
  static Registry r;
  static const bool registered = [] {
    Capabilities caps;
    caps.plugin = "cuda-test";
    caps.version = "0.1.0";
    caps.targets = {"sm_90a"};
    return register_backend(r, caps).ok();
  }();
  REQUIRE(registered);
  return r;
}

/// True when the runtime finds no GPU here (CI); the GPU test covers the other case.
bool no_gpu() {
  kiln_runtime* rt = nullptr;
  kiln_status* st = kiln_runtime_create(nullptr, &rt);
  const bool none = st && kiln_status_get_code(st) == KILN_STATUS_NO_DEVICE;
  kiln_status_release(st);
  kiln_runtime_release(rt);
  return none;
}

/// A fresh cache folder for one test, removed at the end.
struct TempCache {
  std::string dir;
  TempCache() {
    char tmpl[] = "/tmp/kiln-autotune-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    dir = tmpl;
  }
  ~TempCache() { std::filesystem::remove_all(dir); }
};

const TunedChoice kChoice{"algo=" + std::string(128, 'a'), 0.25, 0.3125};

}  // namespace

TEST_CASE("autotune is a bool option of the cuda backends validated in a pipeline TOML") {
  const std::string head = "[backend]\nname = \"cuda-test\"\ntargets = [\"sm_90a\"]\n";
  auto p = parse_pipeline_toml(head + "options = { autotune = true }\n", "p.toml", registry());
  REQUIRE_MESSAGE(p.ok(), p.status().message());
  CHECK(p->backend.options.get_bool("autotune"));
  CHECK(p->canonical(registry()).find("autotune=true") != std::string::npos);
  auto off = parse_pipeline_toml(head, "p.toml", registry());
  REQUIRE(off.ok());
  CHECK(off->canonical(registry()).find("autotune") == std::string::npos);
  auto bad = parse_pipeline_toml(head + "options = { autotune = \"yes\" }\n", "p.toml", registry());
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("autotune") != std::string::npos);
  CHECK(bad.status().message().find("bool") != std::string::npos);
}

TEST_CASE("tuned choices round-trip through cache payloads and anything else is refused") {
  const std::string payload = encode_tuned_choice(kChoice);
  CHECK(payload == "kiln-autotune 1\nchoice " + kChoice.choice + "\nms 0.250000 0.312500\n");
  CHECK(decode_tuned_choice(payload) == kChoice);
  const TunedChoice conv{"algo=implicit_precomp_gemm algo_math=tensor_op", 1.5, 2};
  CHECK(decode_tuned_choice(encode_tuned_choice(conv)) == conv);
  for (const std::string& bad :
       {std::string(""), std::string("kiln-autotune 2\nchoice algo=x\nms 1 1\n"), std::string("kiln-autotune 1\nchoice algo=\nms 1 1\n"),
        std::string("kiln-autotune 1\nchoice bias=b1\nms 1 1\n"), std::string("kiln-autotune 1\nchoice algo=x\nms 1\n"),
        std::string("kiln-autotune 1\nchoice algo=x\nms 1 0\n"), std::string("kiln-autotune 1\nchoice algo=x\nms 1 2 3\n"),
        std::string("kiln-autotune 1\nchoice algo=x\nms 1 2"), payload.substr(0, payload.size() - 3) + "x\n"}) {
    INFO(bad);
    CHECK(!decode_tuned_choice(bad).has_value());
  }
}

TEST_CASE("tuned-choice cache keys cover the problem and the Kiln version and corrupt entries re-tune") {
  const std::string a = "gemm 8x8x8 bf16 | m=8 n=8 k=8 device=NVIDIA H200 sm_90 sms=132 cublasLt=130000";
  CHECK(autotune_cache_key(a).digest() == autotune_cache_key(a).digest());
  CHECK(autotune_cache_key(a).digest() != autotune_cache_key(a + "1").digest());
  CHECK(autotune_cache_key(a).producer.find("kiln@") == 0);
  // A kernel with the problem as its source does not share the entry.
  CHECK(autotune_cache_key(a).digest() != KernelCacheKey{a, "sm_90a", "nvrtc 13.0", {}, "kiln"}.digest());

  TempCache tmp;
  KernelCache cache(tmp.dir);
  REQUIRE(cache.store(autotune_cache_key(a), encode_tuned_choice(kChoice)).ok());
  auto hit = cache.lookup(autotune_cache_key(a));
  REQUIRE(hit.has_value());
  CHECK(decode_tuned_choice(*hit) == kChoice);
  // Flip a payload byte: the entry is reported, removed and missed, so the step is re-tuned.
  const std::string digest = autotune_cache_key(a).digest();
  const std::string path = tmp.dir + "/" + digest.substr(0, 2) + "/" + digest + ".bin";
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('#');
  }
  std::string warning;
  CHECK(!cache.lookup(autotune_cache_key(a), &warning).has_value());
  CHECK(warning.find("corrupt entry") != std::string::npos);
  CHECK(!std::filesystem::exists(path));
}

TEST_CASE("tuned choices are appended to their steps' plan lines") {
  const std::string plan = "kiln-plan 1\narena bytes=0\nworkspace bytes=0\nstep launch kernel=k0\nstep gemm a=b0\nstep conv x=b1\n";
  auto out = apply_tuned_choices(plan, {{1, "algo=ff"}, {2, "algo=direct algo_math=fma"}});
  REQUIRE_MESSAGE(out.ok(), out.status().message());
  CHECK(*out == "kiln-plan 1\narena bytes=0\nworkspace bytes=0\nstep launch kernel=k0\nstep gemm a=b0 algo=ff\n"
                "step conv x=b1 algo=direct algo_math=fma\n");
  CHECK(*apply_tuned_choices(plan, {}) == plan);
  auto again = apply_tuned_choices(*out, {{1, "algo=ee"}});
  REQUIRE(!again.ok());
  CHECK(again.status().message() == "autotune: plan step 1 already has an algo=");
  auto past = apply_tuned_choices(plan, {{3, "algo=ee"}});
  REQUIRE(!past.ok());
  CHECK(past.status().message() == "autotune: the plan has 3 steps, a choice names step 3");
}

TEST_CASE("the device is matched to a target by architecture") {
  CHECK(autotune_target_for("sm_90", {"sm_80", "sm_90a"}) == "sm_90a");
  CHECK(autotune_target_for("sm_100", {"compute_100f"}) == "compute_100f");
  CHECK(autotune_target_for("sm_80", {"sm_90a", "sm_100a"}).empty());
  CHECK(autotune_target_for("sm_9", {"sm_90a"}).empty());
  CHECK(autotune_target_for("", {"sm_90a"}).empty());
}

TEST_CASE("a compile with autotune on and no GPU succeeds with the libraries' own choices and says so") {
  if (!no_gpu()) return;  // with a GPU, the choices are made (the GPU test checks them)
  auto g = parse_graph(R"(graph @g(%a: bf16[64, 32], %b: bf16[32, 16]) -> (bf16[64, 16]) {
  %y = matmul(%a, %b) : bf16[64, 16]
  return %y })");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto info = registry().backend("cuda-test");
  REQUIRE(info.ok());
  auto opts = resolve_options((*info)->options, {{"autotune", true}}, "cuda-test");
  REQUIRE(opts.ok());
  auto backend = (*info)->create(*opts);
  REQUIRE(backend.ok());
  ArtifactContents art;
  const Status s = (*backend)->build_artifact(**g, {"sm_90a"}, art);
  REQUIRE_MESSAGE(s.ok(), s.message());
  CHECK(art.plan.find("step gemm ") != std::string::npos);
  CHECK(art.plan.find(" algo=") == std::string::npos);
  CHECK(art.meta.at("autotune") ==
        "autotune: no CUDA device for sm_90a here; steps keep cuBLASLt's heuristic and cuDNN's load-time search");
  // What autotune_artifact loads on a GPU: the backend's part alone, before the driver adds meta.
  std::string error;
  CHECK_MESSAGE(artifact::read_artifact(serialize_artifact(art), "tuning", &error) != nullptr, error);
}

}  // namespace kiln::cuda
