// Training checkpoints: named tensors as .npy images in one checksummed file.
#include "kiln/core/checkpoint.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/artifact_format.h"
#include "kiln/core/npy.h"

namespace kiln {
namespace {

constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'C', 'K', 'P', 'T'};
constexpr uint32_t kVersion = 1;

void put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

/// Reads little-endian fields from the file's bytes, failing on a read past the end.
struct Reader {
  std::string_view bytes;
  size_t at = 0;
  bool take(size_t n, std::string_view& out) {
    if (bytes.size() - at < n) return false;
    out = bytes.substr(at, n);
    at += n;
    return true;
  }
  bool u(int n, uint64_t& v) {
    std::string_view s;
    if (!take(static_cast<size_t>(n), s)) return false;
    v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[static_cast<size_t>(i)])) << (8 * i);
    return true;
  }
};

}  // namespace

Status write_checkpoint(const std::string& path, const std::map<std::string, Tensor>& tensors) {
  std::string out(kMagic, sizeof kMagic);
  put(out, kVersion, 4);
  put(out, tensors.size(), 4);
  for (const auto& [name, t] : tensors) {
    put(out, name.size(), 4);
    out += name;
    put(out, static_cast<uint64_t>(t.dtype()), 1);
    const std::string npy = serialize_npy(t);
    put(out, npy.size(), 8);
    out += npy;
  }
  put(out, artifact::fnv1a64(out.data(), out.size()), 8);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    if (!f) return io_error("cannot write checkpoint '" + tmp + "'");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return io_error("cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
  return ok_status();
}

StatusOr<std::map<std::string, Tensor>> read_checkpoint(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found("checkpoint '" + path + "' cannot be opened");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string bytes = ss.str();
  auto corrupt = [&](const std::string& why) { return invalid_argument("checkpoint '" + path + "' is corrupt: " + why); };
  if (bytes.size() < sizeof kMagic || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0)
    return invalid_argument("'" + path + "' is not a kiln checkpoint (no KILNCKPT header)");
  if (bytes.size() < sizeof kMagic + 16) return corrupt("truncated");
  Reader tail{bytes, bytes.size() - 8};
  uint64_t sum = 0;
  tail.u(8, sum);
  if (artifact::fnv1a64(bytes.data(), bytes.size() - 8) != sum) return corrupt("checksum mismatch");
  Reader r{std::string_view(bytes).substr(0, bytes.size() - 8), sizeof kMagic};
  uint64_t version = 0, count = 0;
  r.u(4, version);
  if (version != kVersion) return invalid_argument("checkpoint '" + path + "' has version " + std::to_string(version) + ", expected 1");
  r.u(4, count);
  std::map<std::string, Tensor> out;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t name_len = 0, dtype = 0, npy_len = 0;
    std::string_view name, npy;
    if (!r.u(4, name_len) || !r.take(name_len, name) || !r.u(1, dtype) || !r.u(8, npy_len) || !r.take(npy_len, npy))
      return corrupt("entry " + std::to_string(i) + " runs past the end");
    if (dtype >= std::size(kAllDTypes)) return corrupt("entry '" + std::string(name) + "' has an unknown dtype");
    auto t = parse_npy(npy, std::string(name), kAllDTypes[dtype]);
    if (!t.ok()) return t.status().with_context("checkpoint '" + path + "'");
    out[std::string(name)] = std::move(*t);
  }
  if (r.at != r.bytes.size()) return corrupt("bytes after the last entry");
  return out;
}

}  // namespace kiln
