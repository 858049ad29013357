// The .kiln artifact writer: lays out the header, aligned sections and the section table.
#include "kiln/core/artifact.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "kiln/artifact_format.h"

namespace kiln {

namespace {

namespace fs = std::filesystem;
using namespace kiln::artifact;

struct PendingSection {
  uint32_t kind;
  std::string name;
  const std::string* bytes;
  uint64_t align;
};

void put_le(std::string& out, size_t at, uint64_t v, int size) {
  for (int i = 0; i < size; ++i) out[at + static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/// Refuses contents the file format cannot represent, naming the field.
Status check_contents(const ArtifactContents& c) {
  for (const auto& [k, v] : c.meta) {
    if (k.empty() || k.find_first_of("=\n") != std::string::npos)
      return invalid_argument("artifact meta key '" + k + "' is empty or holds '=' or a newline");
    if (v.find('\n') != std::string::npos)
      return invalid_argument("artifact meta value of '" + k + "' holds a newline");
  }
  std::vector<std::string> names;
  for (const auto& im : c.images) {
    if (im.target.empty() || im.form.empty())
      return invalid_argument("artifact image '" + im.target + "." + im.form + "' lacks a target or form");
    names.push_back(im.target + "." + im.form);
  }
  for (const auto& [target, src] : c.sources) names.push_back(target + ".cu");
  std::sort(names.begin(), names.end());
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].size() >= sizeof(SectionEntry::name))
      return invalid_argument("artifact section name '" + names[i] + "' is longer than 63 bytes");
    if (i && names[i] == names[i - 1]) return invalid_argument("artifact has two sections named '" + names[i] + "'");
  }
  return ok_status();
}

}  // namespace

std::string serialize_artifact(const ArtifactContents& contents) {
  std::map<std::string, std::string> meta = contents.meta;
  meta["format_version"] = std::to_string(kFormatVersion);
  std::string meta_text;
  for (const auto& [k, v] : meta) meta_text += k + "=" + v + "\n";

  std::vector<PendingSection> pending = {{kSectionMeta, "meta", &meta_text, kSectionAlign}};
  if (contents.programs.empty()) pending.push_back({kSectionPlan, "plan", &contents.plan, kSectionAlign});
  // Each program where an artifact of its own would start, so its weights stay page-aligned.
  std::vector<std::string> program_names;
  for (size_t k = 0; k < contents.programs.size(); ++k) program_names.push_back("program." + std::to_string(k));
  for (size_t k = 0; k < contents.programs.size(); ++k)
    pending.push_back({kSectionProgram, program_names[k], &contents.programs[k], kWeightsAlign});
  for (const auto& im : contents.images)
    pending.push_back({kSectionImage, im.target + "." + im.form, &im.bytes, kSectionAlign});
  for (const auto& [target, src] : contents.sources)
    pending.push_back({kSectionSource, target + ".cu", &src, kSectionAlign});
  if (!contents.weights.empty()) pending.push_back({kSectionWeights, "weights", &contents.weights, kWeightsAlign});

  // Sections first, then the table: the table's size is known only once offsets are.
  std::string out(sizeof(Header), '\0');
  std::vector<SectionEntry> table;
  for (const auto& p : pending) {
    out.resize(align_up(out.size(), p.align), '\0');
    SectionEntry e{};
    e.kind = p.kind;
    e.offset = out.size();
    e.size = p.bytes->size();
    e.checksum = fnv1a64(p.bytes->data(), p.bytes->size());
    std::memcpy(e.name, p.name.data(), std::min(p.name.size(), sizeof(e.name) - 1));
    table.push_back(e);
    out += *p.bytes;
  }
  out.resize(align_up(out.size(), kSectionAlign), '\0');
  const uint64_t table_offset = out.size();
  // Fields are written one by one in little-endian order, never as raw structs, so the file
  // is the same whatever the host's byte order and padding.
  for (const SectionEntry& e : table) {
    const size_t at = out.size();
    out.resize(at + sizeof(SectionEntry), '\0');
    put_le(out, at, e.kind, 4);
    put_le(out, at + 4, e.flags, 4);
    put_le(out, at + 8, e.offset, 8);
    put_le(out, at + 16, e.size, 8);
    put_le(out, at + 24, e.checksum, 8);
    std::memcpy(out.data() + at + 32, e.name, sizeof(e.name));
  }
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  put_le(out, 8, kFormatVersion, 4);
  put_le(out, 12, table.size(), 4);
  put_le(out, 16, table_offset, 8);
  put_le(out, 24, out.size(), 8);
  put_le(out, 32, fnv1a64(out.data() + table_offset, out.size() - table_offset), 8);
  return out;
}

ArtifactContents rank_program_contents(const std::vector<std::string>& per_rank, std::map<std::string, std::string> meta) {
  ArtifactContents c;
  std::string ranks;
  for (const std::string& program : per_rank) {
    const auto same = std::find(c.programs.begin(), c.programs.end(), program);
    const size_t k = static_cast<size_t>(same - c.programs.begin());
    if (same == c.programs.end()) c.programs.push_back(program);
    ranks += (ranks.empty() ? "" : ",") + std::to_string(k);
  }
  c.meta = std::move(meta);
  c.meta["rank_programs"] = ranks;
  return c;
}

Status write_artifact(const std::string& path, const ArtifactContents& contents) {
  KILN_RETURN_IF_ERROR(check_contents(contents));
  const std::string bytes = serialize_artifact(contents);
  // The temporary file sits next to the target so the rename stays within one file system.
  std::random_device rd;
  const std::string tmp = path + ".tmp-" + std::to_string(getpid()) + "-" + std::to_string(rd());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return io_error("cannot write '" + path + "': " + std::strerror(errno));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return io_error("cannot write '" + path + "': write failed");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return io_error("cannot write '" + path + "': " + ec.message());
  }
  return ok_status();
}

}  // namespace kiln
