// Tests for the .kiln writer: the byte layout of docs/artifact.md, checksums, atomic writes.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/artifact_format.h"
#include "kiln/core/artifact.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

uint64_t le(const std::string& s, size_t at, int size) {
  uint64_t v = 0;
  for (int i = size - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + static_cast<size_t>(i)]);
  return v;
}

struct Entry {
  uint32_t kind;
  uint64_t offset, size, checksum;
  std::string name;
};

std::vector<Entry> table(const std::string& f) {
  std::vector<Entry> out;
  for (uint64_t i = 0, t = le(f, 16, 8); i < le(f, 12, 4); ++i, t += 96)
    out.push_back({static_cast<uint32_t>(le(f, t, 4)), le(f, t + 8, 8), le(f, t + 16, 8), le(f, t + 24, 8),
                   std::string(f.c_str() + t + 32)});
  return out;
}

ArtifactContents sample() {
  ArtifactContents c;
  c.meta = {{"kiln_version", "0.1.0"}, {"targets", "sm_80,sm_90a"}};
  c.plan = "kiln-plan 1\narena bytes=0\nworkspace bytes=0\n";
  c.weights = std::string(300, '\x07');
  c.images = {{"sm_80", "cubin", "CUBIN80"}, {"compute_80", "ptx", "PTX80"}, {"sm_90a", "cubin", "CUBIN90A"}};
  c.sources = {{"sm_80", "// src"}};
  return c;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string temp_dir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("kiln-artifact-test-" + tag + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

}  // namespace

TEST_CASE("fnv1a64 matches the published test vectors") {
  CHECK(artifact::fnv1a64("", 0) == 0xcbf29ce484222325ull);
  CHECK(artifact::fnv1a64("a", 1) == 0xaf63dc4c8601ec8cull);
  CHECK(artifact::fnv1a64("foobar", 6) == 0x85944171f73967e8ull);
}

TEST_CASE("serialize_artifact lays out header, aligned sections and the table") {
  const std::string f = serialize_artifact(sample());
  CHECK(f.compare(0, 8, std::string("KILNART\0", 8)) == 0);
  CHECK(le(f, 8, 4) == 1);            // format version
  CHECK(le(f, 12, 4) == 7);           // meta, plan, 3 images, 1 source, weights
  CHECK(le(f, 24, 8) == f.size());    // file size
  const uint64_t table_offset = le(f, 16, 8);
  CHECK(table_offset % 64 == 0);
  CHECK(table_offset + 7 * 96 == f.size());
  CHECK(le(f, 32, 8) == artifact::fnv1a64(f.data() + table_offset, 7 * 96));
  for (size_t i = 40; i < 64; ++i) CHECK(f[i] == 0);  // reserved

  const std::vector<Entry> t = table(f);
  REQUIRE(t.size() == 7);
  const std::vector<std::pair<uint32_t, std::string>> expected = {
      {1, "meta"}, {2, "plan"}, {3, "sm_80.cubin"}, {3, "compute_80.ptx"}, {3, "sm_90a.cubin"}, {5, "sm_80.cu"}, {4, "weights"}};
  uint64_t end = 64;
  for (size_t i = 0; i < t.size(); ++i) {
    CAPTURE(i);
    CHECK(t[i].kind == expected[i].first);
    CHECK(t[i].name == expected[i].second);
    CHECK(t[i].offset % (t[i].kind == 4 ? 4096 : 64) == 0);
    CHECK(t[i].offset >= end);  // in order, no overlap
    end = t[i].offset + t[i].size;
    CHECK(t[i].checksum == artifact::fnv1a64(f.data() + t[i].offset, t[i].size));
  }
  CHECK(t[0].offset == 64);
  // Meta is sorted key=value lines, and the writer records the format version.
  CHECK(f.substr(t[0].offset, t[0].size) == "format_version=1\nkiln_version=0.1.0\ntargets=sm_80,sm_90a\n");
  CHECK(f.substr(t[1].offset, t[1].size) == sample().plan);
  CHECK(f.substr(t[4].offset, t[4].size) == "CUBIN90A");
  CHECK(t[6].offset == 4096);
  CHECK(t[6].size == 300);
}

TEST_CASE("serialize_artifact leaves out an empty weights section") {
  ArtifactContents c = sample();
  c.weights.clear();
  for (const Entry& e : table(serialize_artifact(c))) CHECK(e.name != "weights");
}

TEST_CASE("write_artifact writes the serialized bytes and leaves no temporary file") {
  const std::string dir = temp_dir("write");
  const std::string path = dir + "/m.kiln";
  REQUIRE(write_artifact(path, sample()).ok());
  CHECK(read_file(path) == serialize_artifact(sample()));
  // Overwriting replaces the file as a whole.
  ArtifactContents c = sample();
  c.weights.clear();
  REQUIRE(write_artifact(path, c).ok());
  CHECK(read_file(path) == serialize_artifact(c));
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);
  fs::remove_all(dir);
}

TEST_CASE("write_artifact reports an unwritable path") {
  const std::string dir = temp_dir("unwritable");
  const Status s = write_artifact(dir + "/no-such-dir/m.kiln", sample());
  CHECK(s.code() == StatusCode::kIoError);
  CHECK(s.message() == "cannot write '" + dir + "/no-such-dir/m.kiln': No such file or directory");
  CHECK(fs::is_empty(dir));
  fs::remove_all(dir);
}

TEST_CASE("write_artifact refuses contents the format cannot hold") {
  const std::string path = temp_dir("refuse") + "/m.kiln";
  ArtifactContents c = sample();
  c.meta["bad=key"] = "1";
  CHECK(write_artifact(path, c).message() == "artifact meta key 'bad=key' is empty or holds '=' or a newline");
  c = sample();
  c.meta["pipeline"] = "a\nb";
  CHECK(write_artifact(path, c).message() == "artifact meta value of 'pipeline' holds a newline");
  c = sample();
  c.images.push_back({"sm_80", "cubin", "again"});
  CHECK(write_artifact(path, c).message() == "artifact has two sections named 'sm_80.cubin'");
  c = sample();
  c.images.push_back({std::string(60, 's'), "cubin", ""});
  CHECK(write_artifact(path, c).message() == "artifact section name '" + std::string(60, 's') + ".cubin' is longer than 63 bytes");
  c = sample();
  c.images.push_back({"sm_86", "", ""});
  CHECK(write_artifact(path, c).message() == "artifact image 'sm_86.' lacks a target or form");
  CHECK(!fs::exists(path));
  fs::remove_all(fs::path(path).parent_path());
}
