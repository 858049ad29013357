// Fuzz target for the ONNX front end: no model file may crash the importer or make it hang.
//
// The front end is a plugin, so the target loads the one built next to it (KILN_ONNX_PLUGIN)
// and imports each input through the registry, exactly as `kiln` does, from a temp file.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "kiln/core/loader.h"
#include "kiln/core/registry.h"

namespace {

struct Target {
  std::string model_path;
  const kiln::FrontendInfo* onnx = nullptr;
  kiln::Options options;
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_onnx_import: %s\n", what.c_str());
  std::abort();
}

const Target& target() {
  static const Target t = [] {
    static kiln::Registry reg;
    if (auto s = kiln::load_plugin(KILN_ONNX_PLUGIN, reg); !s.ok()) fail(s.message());
    auto fe = reg.frontend("onnx");
    if (!fe.ok()) fail(fe.status().message());
    Target t;
    t.onnx = *fe;
    // Tighter limits than the defaults so one input cannot legitimately take gigabytes or
    // minutes; anything still slow or large past these is a finding.
    auto opts = kiln::resolve_options(t.onnx->options,
                                      {{"max-tensor-bytes", int64_t{1} << 26},
                                       {"max-nodes", int64_t{10000}},
                                       {"max-unroll", int64_t{64}},
                                       {"fold-limit-bytes", int64_t{1} << 24}},
                                      "frontend 'onnx'");
    if (!opts.ok()) fail(opts.status().message());
    t.options = *opts;
    // A private folder with one external-data file, so inputs naming external data read
    // only from here.
    char tmpl[] = "/tmp/kiln-fuzz-onnx-XXXXXX";
    const char* dir = mkdtemp(tmpl);
    if (dir == nullptr) fail("cannot make a temp folder");
    std::ofstream data(std::string(dir) + "/data.bin", std::ios::binary);
    for (int i = 0; i < 1024; ++i) data.put(static_cast<char>(i * 7));
    t.model_path = std::string(dir) + "/model.onnx";
    return t;
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Target& t = target();
  {
    std::ofstream f(t.model_path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!f) fail("cannot write " + t.model_path);
  }
  auto g = t.onnx->import(t.model_path, t.options);
  if (!g.ok() && g.status().message().empty()) fail("error without a message");
  return 0;
}
