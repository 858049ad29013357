// The on-disk kernel cache: SHA-256 keys, checksummed entries, atomic temp-file-and-rename writes.
#include "kiln/core/kernel_cache.h"

#include <openssl/evp.h>
#include <pwd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace kiln {

namespace {

namespace fs = std::filesystem;

constexpr char kEntryMagic[8] = {'K', 'I', 'L', 'N', 'K', 'C', 'E', '\0'};
constexpr uint32_t kEntryVersion = 1;
/// magic, version (u32), reserved (u32), payload size (u64), payload SHA-256.
constexpr size_t kEntryHeader = 8 + 4 + 4 + 8 + 32;

/// Incremental SHA-256 through OpenSSL's EVP interface.
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(std::string_view s) { EVP_DigestUpdate(ctx_, s.data(), s.size()); }
  /// Length-prefixed, so no two different field lists hash the same bytes.
  void field(std::string_view s) {
    update(le64(s.size()));
    update(s);
  }
  std::string raw() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    return std::string(reinterpret_cast<const char*>(md), len);
  }

  static std::string le64(uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
    return s;
  }

 private:
  EVP_MD_CTX* ctx_;
};

std::string sha256(std::string_view data) {
  Sha256 h;
  h.update(data);
  return h.raw();
}

std::string hex(std::string_view raw) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (const char c : raw) {
    out += digits[static_cast<unsigned char>(c) >> 4];
    out += digits[static_cast<unsigned char>(c) & 15];
  }
  return out;
}

uint64_t read_le(std::string_view s, size_t at, int size) {
  uint64_t v = 0;
  for (int i = size - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + static_cast<size_t>(i)]);
  return v;
}

/// "" when `entry` is sound (then `payload` holds its payload), else what is wrong with it.
std::string check_entry(const std::string& entry, std::string* payload) {
  if (entry.size() < kEntryHeader) return "truncated: " + std::to_string(entry.size()) + " bytes";
  if (std::memcmp(entry.data(), kEntryMagic, sizeof(kEntryMagic)) != 0) return "bad magic";
  if (const uint64_t v = read_le(entry, 8, 4); v != kEntryVersion)
    return "entry version " + std::to_string(v) + ", expected " + std::to_string(kEntryVersion);
  const uint64_t size = read_le(entry, 16, 8);
  if (size != entry.size() - kEntryHeader)
    return "payload of " + std::to_string(entry.size() - kEntryHeader) + " bytes, header says " + std::to_string(size);
  *payload = entry.substr(kEntryHeader);
  if (sha256(*payload) != std::string_view(entry).substr(24, 32)) return "payload checksum mismatch";
  return "";
}

bool is_hex(std::string_view s) { return s.find_first_not_of("0123456789abcdef") == std::string_view::npos; }

/// `<dir>/<2 hex>/<64 hex>.bin`, with the folder matching the name's first two digits.
bool is_entry(const fs::path& p) {
  const std::string name = p.filename().string(), folder = p.parent_path().filename().string();
  return name.size() == 68 && name.ends_with(".bin") && is_hex(name.substr(0, 64)) && folder == name.substr(0, 2);
}

/// Calls `fn(path, size)` for each entry file under `dir`; a missing dir holds none.
template <typename Fn>
Status for_each_entry(const std::string& dir, Fn fn) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return ok_status();
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it.depth() >= 1) it.disable_recursion_pending();  // entries sit one folder down
    std::error_code ec2;
    if (it->is_regular_file(ec2) && is_entry(it->path())) KILN_RETURN_IF_ERROR(fn(it->path(), it->file_size(ec2)));
  }
  if (ec) return io_error("kernel cache: cannot list '" + dir + "': " + ec.message());
  return ok_status();
}

}  // namespace

std::string KernelCacheKey::digest() const {
  Sha256 h;
  h.field("kiln-kernel-cache-key 1");
  for (const std::string* f : {&source, &target, &compiler, &producer}) h.field(*f);
  h.update(Sha256::le64(options.size()));
  for (const auto& o : options) h.field(o);
  return hex(h.raw());
}

std::string KernelCache::default_dir() {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  if (std::string d = env("KILN_CACHE_DIR"); !d.empty()) return d;
  if (std::string d = env("XDG_CACHE_HOME"); !d.empty()) return d + "/kiln";
  std::string home = env("HOME");
  if (home.empty())
    if (const passwd* pw = getpwuid(getuid()); pw && pw->pw_dir) home = pw->pw_dir;
  if (home.empty()) return "/tmp/kiln-cache-" + std::to_string(getuid());
  return home + "/.cache/kiln";
}

KernelCache::KernelCache(std::string dir) : dir_(std::move(dir)) {}

namespace {

std::string entry_path(const std::string& dir, const std::string& digest) {
  return dir + "/" + digest.substr(0, 2) + "/" + digest + ".bin";
}

}  // namespace

std::optional<std::string> KernelCache::lookup(const KernelCacheKey& key, std::string* warning) const {
  const std::string path = entry_path(dir_, key.digest());
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string payload;
  const std::string why = in.bad() ? "read failed" : check_entry(std::move(ss).str(), &payload);
  if (why.empty()) return payload;
  // A corrupt entry is a miss: remove it so the rebuilt kernel can take its place.
  std::error_code ec;
  fs::remove(path, ec);
  if (warning) *warning = "kernel cache: corrupt entry '" + path + "' (" + why + "); removed, rebuilding";
  return std::nullopt;
}

Status KernelCache::store(const KernelCacheKey& key, const std::string& payload) const {
  const std::string digest = key.digest();
  const std::string path = entry_path(dir_, digest);
  const std::string fail = "kernel cache: cannot write '" + path + "': ";
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  if (ec) return io_error(fail + ec.message());

  std::string header(kEntryMagic, sizeof(kEntryMagic));
  header += Sha256::le64(kEntryVersion).substr(0, 4) + std::string(4, '\0') + Sha256::le64(payload.size()) + sha256(payload);
  // A name no other writer can pick (pid and random bits), in the entry's own folder, so the
  // rename is atomic: readers see either no entry or a complete one.
  std::random_device rd;
  const std::string tmp = fs::path(path).parent_path().string() + "/.tmp-" + digest.substr(0, 16) + "-" +
                          std::to_string(getpid()) + "-" + std::to_string(rd()) + std::to_string(rd());
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) return io_error(fail + std::strerror(errno));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(payload.data(), static_cast<std::streamsize>(payload.size()));
  out.close();
  if (out) fs::rename(tmp, path, ec);
  if (!out || ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return io_error(fail + (ec ? ec.message() : "write failed"));
  }
  return ok_status();
}

StatusOr<KernelCacheStats> KernelCache::stats() const {
  KernelCacheStats s;
  s.dir = dir_;
  KILN_RETURN_IF_ERROR(for_each_entry(dir_, [&](const fs::path&, uintmax_t size) {
    ++s.entries;
    s.bytes += size;
    return ok_status();
  }));
  return s;
}

Status KernelCache::clear() const {
  std::vector<fs::path> entries;
  KILN_RETURN_IF_ERROR(for_each_entry(dir_, [&](const fs::path& p, uintmax_t) {
    entries.push_back(p);
    return ok_status();
  }));
  for (const fs::path& p : entries) {
    std::error_code ec;
    fs::remove(p, ec);
    if (ec) return io_error("kernel cache: cannot remove '" + p.string() + "': " + ec.message());
    fs::remove(p.parent_path(), ec);  // only succeeds once the folder is empty
  }
  return ok_status();
}

}  // namespace kiln
