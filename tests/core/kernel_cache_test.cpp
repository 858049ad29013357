// Tests for the kernel cache: keys, entry format, corruption handling and concurrent writers.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include "kiln/core/kernel_cache.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

KernelCacheKey key(std::string source = "__global__ void k() {}") {
  return {std::move(source), "sm_90a", "nvrtc 13.0", {"-O3", "--std=c++17"}, "cuda-sm90@0.1.0"};
}

std::string temp_dir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("kiln-cache-test-" + tag + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  return d.string();
}

std::string entry_file(const KernelCache& c, const KernelCacheKey& k) {
  const std::string d = k.digest();
  return c.dir() + "/" + d.substr(0, 2) + "/" + d + ".bin";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

/// Sets an environment variable for one scope ("" unsets it).
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (*value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~EnvVar() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("cache keys: hex SHA-256 covering every field, unambiguously") {
  const std::string d = key().digest();
  CHECK(d.size() == 64);
  CHECK(d.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(key().digest() == d);
  KernelCacheKey k = key();
  k.target = "sm_80";
  CHECK(k.digest() != d);
  k = key();
  k.compiler = "nvrtc 12.8";
  CHECK(k.digest() != d);
  k = key();
  k.options.push_back("-lineinfo");
  CHECK(k.digest() != d);
  k = key();
  k.producer = "cuda-sm90@0.1.1";
  CHECK(k.digest() != d);
  CHECK(key("x").digest() != d);
  // Field boundaries matter: moving a character from one field to the next changes the key.
  KernelCacheKey a{"ab", "c", "", {}, ""}, b{"a", "bc", "", {}, ""};
  CHECK(a.digest() != b.digest());
  KernelCacheKey o1{"", "", "", {"a", "b"}, ""}, o2{"", "", "", {"ab"}, ""};
  CHECK(o1.digest() != o2.digest());
}

TEST_CASE("default_dir: KILN_CACHE_DIR, else XDG_CACHE_HOME/kiln, else ~/.cache/kiln") {
  EnvVar home("HOME", "/home/someone");
  {
    EnvVar kiln("KILN_CACHE_DIR", "/tmp/kc");
    EnvVar xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(KernelCache::default_dir() == "/tmp/kc");
  }
  {
    EnvVar kiln("KILN_CACHE_DIR", "");
    EnvVar xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(KernelCache::default_dir() == "/tmp/xdg/kiln");
  }
  EnvVar kiln("KILN_CACHE_DIR", "");
  EnvVar xdg("XDG_CACHE_HOME", "");
  CHECK(KernelCache::default_dir() == "/home/someone/.cache/kiln");
}

TEST_CASE("store and lookup: the entry format holds magic, version, size and SHA-256") {
  const KernelCache cache(temp_dir("roundtrip"));
  std::string warning;
  CHECK(!cache.lookup(key(), &warning));
  CHECK(warning.empty());
  REQUIRE(cache.store(key(), "abc").ok());
  const auto hit = cache.lookup(key(), &warning);
  REQUIRE(hit);
  CHECK(*hit == "abc");
  CHECK(warning.empty());
  CHECK(!cache.lookup(key("other")));

  const std::string e = read_file(entry_file(cache, key()));
  REQUIRE(e.size() == 56 + 3);
  CHECK(e.compare(0, 8, std::string("KILNKCE\0", 8)) == 0);
  CHECK(e.compare(8, 8, std::string("\1\0\0\0\0\0\0\0", 8)) == 0);   // version 1, reserved
  CHECK(e.compare(16, 8, std::string("\3\0\0\0\0\0\0\0", 8)) == 0);  // payload size
  // SHA-256("abc"), the FIPS 180-2 test vector.
  const unsigned char sha_abc[32] = {0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40,
                                     0xde, 0x5d, 0xae, 0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17,
                                     0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
  CHECK(e.compare(24, 32, std::string(reinterpret_cast<const char*>(sha_abc), 32)) == 0);
  CHECK(e.substr(56) == "abc");
  // An empty payload is a valid entry, not a miss.
  REQUIRE(cache.store(key("empty"), "").ok());
  CHECK(cache.lookup(key("empty")) == std::string());
  fs::remove_all(cache.dir());
}

TEST_CASE("a corrupt entry is reported, removed, and rebuilt by the next store") {
  const KernelCache cache(temp_dir("corrupt"));
  const std::string path = entry_file(cache, key());
  struct Case {
    const char* what;
    std::function<void(std::string&)> damage;
  };
  const Case cases[] = {
      {"payload checksum mismatch", [](std::string& e) { e[60] ^= 1; }},
      {"payload of 9 bytes, header says 10", [](std::string& e) { e.pop_back(); }},
      {"truncated: 20 bytes", [](std::string& e) { e.resize(20); }},
      {"bad magic", [](std::string& e) { e[0] = 'X'; }},
      {"entry version 2, expected 1", [](std::string& e) { e[8] = 2; }},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    REQUIRE(cache.store(key(), "0123456789").ok());
    std::string e = read_file(path);
    c.damage(e);
    write_file(path, e);
    std::string warning;
    CHECK(!cache.lookup(key(), &warning));
    CHECK(warning == "kernel cache: corrupt entry '" + path + "' (" + c.what + "); removed, rebuilding");
    CHECK(!fs::exists(path));
    REQUIRE(cache.store(key(), "0123456789").ok());
    CHECK(cache.lookup(key(), &warning) == std::string("0123456789"));
  }
  fs::remove_all(cache.dir());
}

TEST_CASE("stats and clear count and remove only cache entries") {
  const KernelCache cache(temp_dir("stats"));
  auto empty = cache.stats();
  REQUIRE(empty.ok());
  CHECK(empty->entries == 0);  // the folder does not exist yet
  REQUIRE(cache.store(key("a"), std::string(100, 'a')).ok());
  REQUIRE(cache.store(key("b"), std::string(10, 'b')).ok());
  REQUIRE(cache.store(key("b"), std::string(10, 'b')).ok());  // same key: one entry
  write_file(cache.dir() + "/README", "not an entry");
  fs::create_directories(cache.dir() + "/zz");
  write_file(cache.dir() + "/zz/" + std::string(64, 'a') + ".bin", "wrong folder");
  auto s = cache.stats();
  REQUIRE(s.ok());
  CHECK(s->dir == cache.dir());
  CHECK(s->entries == 2);
  CHECK(s->bytes == 56 + 100 + 56 + 10);
  REQUIRE(cache.clear().ok());
  CHECK(cache.stats()->entries == 0);
  CHECK(!cache.lookup(key("a")));
  CHECK(fs::exists(cache.dir() + "/README"));
  CHECK(fs::exists(cache.dir() + "/zz/" + std::string(64, 'a') + ".bin"));
  fs::remove_all(cache.dir());
}

TEST_CASE("store reports a cache folder it cannot create") {
  const std::string file = temp_dir("blocked");
  write_file(file, "a file where the cache folder should be");
  const KernelCache cache(file);
  const Status s = cache.store(key(), "x");
  CHECK(s.code() == StatusCode::kIoError);
  CHECK(s.message().starts_with("kernel cache: cannot write '" + entry_file(cache, key()) + "': "));
  fs::remove(file);
}

TEST_CASE("concurrent writers and readers in several processes never see a partial entry") {
  const KernelCache cache(temp_dir("concurrent"));
  constexpr int kProcs = 6, kRounds = 40, kKeys = 3;
  // Large payloads, so a torn write would show; the same key always has the same payload.
  auto payload = [](int k) {
    std::string p(300 * 1024, '\0');
    for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<char>((i * 131 + static_cast<size_t>(k) * 7) & 0xff);
    return p;
  };
  std::vector<pid_t> children;
  for (int proc = 0; proc < kProcs; ++proc) {
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      // Child: no doctest assertions (they belong to the parent); the exit code reports.
      int bad = 0;
      for (int r = 0; r < kRounds; ++r) {
        const int k = (r + proc) % kKeys;
        const std::string want = payload(k);
        if (!cache.store(key("k" + std::to_string(k)), want).ok()) bad |= 1;
        std::string warning;
        const auto got = cache.lookup(key("k" + std::to_string((k + 1) % kKeys)), &warning);
        if (!warning.empty()) bad |= 2;
        if (got && *got != payload((k + 1) % kKeys)) bad |= 4;
      }
      _exit(bad);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);  // 1: a store failed, 2: a corrupt entry seen, 4: wrong bytes
  }
  for (int k = 0; k < kKeys; ++k) CHECK(cache.lookup(key("k" + std::to_string(k))) == payload(k));
  // Every temporary file was renamed into place: only the entries remain.
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(cache.dir())) files += e.is_regular_file();
  CHECK(files == kKeys);
  fs::remove_all(cache.dir());
}
