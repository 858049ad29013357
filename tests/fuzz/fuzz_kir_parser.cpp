// Fuzz target for the .kir parser: no input may crash it, and what parses must round-trip.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "kiln/ir/text.h"

namespace {

/// A private folder holding `w.bin` (256 bytes), so inputs that name a side file exercise
/// the mmap path without reaching files outside it.
const std::string& input_path() {
  static const std::string path = [] {
    char tmpl[] = "/tmp/kiln-fuzz-kir-XXXXXX";
    const char* dir = mkdtemp(tmpl);
    if (dir == nullptr) {
      std::perror("fuzz_kir_parser: mkdtemp");
      std::abort();
    }
    std::ofstream blob(std::string(dir) + "/w.bin", std::ios::binary);
    for (int i = 0; i < 256; ++i) blob.put(static_cast<char>(i));
    return std::string(dir) + "/input.kir";
  }();
  return path;
}

[[noreturn]] void fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_kir_parser: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto g = kiln::parse_graph(text, input_path());
  if (!g.ok()) {
    if (g.status().message().empty()) fail("error without a message", std::string(text));
    return 0;
  }
  // text.h promises: printing the parse of a printer's output gives the same bytes.
  const std::string printed = kiln::print_graph(**g);
  auto again = kiln::parse_graph(printed, input_path());
  if (!again.ok()) fail("printed graph does not parse again", again.status().message() + "\n" + printed);
  const std::string reprinted = kiln::print_graph(**again);
  if (reprinted != printed) fail("print/parse/print is not stable", printed + "\n----\n" + reprinted);
  return 0;
}
