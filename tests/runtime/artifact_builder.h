// Test helper: serializes a .kiln artifact from sections, independently of core's writer.
#pragma once

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kiln/artifact_format.h"

namespace kiln::test {

struct TestSection {
  uint32_t kind;
  std::string name;
  std::string bytes;
};

/// Header, aligned sections, checksummed table: the layout of docs/artifact.md.
inline std::string build_artifact(const std::vector<TestSection>& sections) {
  using namespace kiln::artifact;
  std::string out(sizeof(Header), '\0');
  std::vector<SectionEntry> entries;
  for (const TestSection& s : sections) {
    uint64_t align = s.kind == kSectionWeights ? kWeightsAlign : kSectionAlign;
    out.resize((out.size() + align - 1) / align * align, '\0');
    SectionEntry e{};
    e.kind = s.kind;
    e.offset = out.size();
    e.size = s.bytes.size();
    e.checksum = fnv1a64(s.bytes.data(), s.bytes.size());
    std::strncpy(e.name, s.name.c_str(), sizeof e.name - 1);
    entries.push_back(e);
    out += s.bytes;
  }
  out.resize((out.size() + kSectionAlign - 1) / kSectionAlign * kSectionAlign, '\0');
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof h.magic);
  h.format_version = kFormatVersion;
  h.section_count = static_cast<uint32_t>(entries.size());
  h.table_offset = out.size();
  std::string table(reinterpret_cast<const char*>(entries.data()), entries.size() * sizeof(SectionEntry));
  h.table_checksum = fnv1a64(table.data(), table.size());
  out += table;
  h.file_size = out.size();
  std::memcpy(out.data(), &h, sizeof h);
  return out;
}

/// An artifact with meta, plan, the given images ("sm_90.cubin" → bytes) and weights.
inline std::string make_artifact(const std::string& plan,
                                 const std::map<std::string, std::string>& images,
                                 const std::string& weights) {
  std::string targets;
  for (const auto& [name, bytes] : images) targets += (targets.empty() ? "" : ",") + name.substr(0, name.find('.'));
  std::vector<TestSection> sections = {
      {kiln::artifact::kSectionMeta, "meta",
       "kiln_version=0.1.0\nformat_version=1\ntargets=" + targets + "\ncreated_by=runtime tests\n"},
      {kiln::artifact::kSectionPlan, "plan", plan}};
  for (const auto& [name, bytes] : images) sections.push_back({kiln::artifact::kSectionImage, name, bytes});
  if (!weights.empty()) sections.push_back({kiln::artifact::kSectionWeights, "weights", weights});
  return build_artifact(sections);
}

}  // namespace kiln::test
