// Fuzz target for pipeline files: the TOML loader and the one-line form never crash, and a
// pipeline that loads prints to a canonical line that parses back to the same pipeline.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "kiln/core/pipeline.h"

namespace {

kiln::PluginEntry entry(std::string name, std::vector<kiln::OptionSpec> options) {
  kiln::PluginEntry e;
  e.name = std::move(name);
  e.version = "0.1.0";
  e.summary = "fuzz stand-in";
  e.options = std::move(options);
  return e;
}

/// Stand-ins shaped like the in-tree plugins (the loader only reads their option specs), with
/// every option type, so the fuzzer needs no shared libraries.
const kiln::Registry& registry() {
  static const kiln::Registry reg = [] {
    using kiln::OptionType;
    kiln::Registry r;
    // The registry wants callable entries; the loader never calls them.
    const auto no_pass = [](const kiln::Options&) -> kiln::StatusOr<std::unique_ptr<kiln::Pass>> {
      return kiln::unimplemented("fuzz stand-in");
    };
    const auto no_backend = [](const kiln::Options&) -> kiln::StatusOr<std::unique_ptr<kiln::Backend>> {
      return kiln::unimplemented("fuzz stand-in");
    };
    const auto no_import = [](const std::string&, const kiln::Options&)
        -> kiln::StatusOr<std::unique_ptr<kiln::Graph>> { return kiln::unimplemented("fuzz stand-in"); };
    auto check = [](const kiln::Status& s) {
      if (!s.ok()) {
        std::fprintf(stderr, "fuzz_pipeline_toml: %s\n", s.message().c_str());
        std::abort();
      }
    };
    kiln::FrontendInfo kir;
    static_cast<kiln::PluginEntry&>(kir) = entry("kir", {});
    kir.extensions = {".kir"};
    kir.import = no_import;
    check(r.add_frontend(kir));
    kiln::FrontendInfo onnx;
    static_cast<kiln::PluginEntry&>(onnx) =
        entry("onnx", {{"max-rank", OptionType::kInt, int64_t{32}, "largest rank"},
                       {"input-values", OptionType::kStringList, std::vector<std::string>{}, "pairs"}});
    onnx.extensions = {".onnx"};
    onnx.import = no_import;
    check(r.add_frontend(onnx));
    kiln::PassInfo canon;
    static_cast<kiln::PluginEntry&>(canon) =
        entry("canonicalize", {{"max-iterations", OptionType::kInt, int64_t{8}, "sweeps"},
                               {"fold-limit-bytes", OptionType::kInt, int64_t{1} << 20, "fold limit"}});
    canon.create = no_pass;
    check(r.add_pass(canon));
    for (const char* name : {"cse", "dce"}) {
      kiln::PassInfo p;
      static_cast<kiln::PluginEntry&>(p) = entry(name, {});
      p.create = no_pass;
      check(r.add_pass(p));
    }
    kiln::PassInfo tile;
    static_cast<kiln::PluginEntry&>(tile) =
        entry("tile-loops", {{"enable", OptionType::kBool, true, "on"},
                             {"ratio", OptionType::kFloat, 0.5, "a float"},
                             {"schedule", OptionType::kString, std::string("auto"), "a string"},
                             {"ops", OptionType::kStringList, std::vector<std::string>{"matmul"}, "names"},
                             {"sizes", OptionType::kIntList, std::vector<int64_t>{32, 32}, "tile sizes"}});
    tile.create = no_pass;
    check(r.add_pass(tile));
    kiln::BackendInfo ref;
    static_cast<kiln::PluginEntry&>(ref) =
        entry("reference", {{"check-nan", OptionType::kBool, false, "trap NaN"}});
    ref.targets = {"cpu"};
    ref.create = no_backend;
    check(r.add_backend(ref));
    kiln::BackendInfo cuda;
    static_cast<kiln::PluginEntry&>(cuda) =
        entry("cuda", {{"fast-math", OptionType::kBool, false, "fast math"},
                       {"block-size", OptionType::kInt, int64_t{256}, "threads per block"}});
    cuda.targets = {"sm_80", "sm_90a"};
    cuda.create = no_backend;
    check(r.add_backend(cuda));
    return r;
  }();
  return reg;
}

[[noreturn]] void fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_pipeline_toml: %s\n%s\n", what, detail.c_str());
  std::abort();
}

/// The canonical line of `p` must parse back to a pipeline with the same canonical line.
void check_round_trip(const kiln::Pipeline& p) {
  const std::string line = p.canonical(registry());
  auto again = kiln::parse_pipeline_string(line, registry());
  if (!again.ok()) fail("canonical line does not parse", line + "\n" + again.status().message());
  const std::string line2 = again->canonical(registry());
  if (line2 != line) fail("canonical line is not stable", line + "\n" + line2);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // The same bytes go to both readers: TOML seeds mutate into one-line forms and back.
  auto p = kiln::parse_pipeline_toml(text, "/fuzz/pipeline.toml", registry());
  if (p.ok()) check_round_trip(*p);
  else if (p.status().message().empty()) fail("toml error without a message", std::string(text));
  auto q = kiln::parse_pipeline_string(text, registry());
  if (q.ok()) check_round_trip(*q);
  else if (q.status().message().empty()) fail("line error without a message", std::string(text));
  return 0;
}
