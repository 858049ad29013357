// The .kiln artifact's binary layout, shared by the writer (core) and the reader (runtime).
// docs/artifact.md describes the file; this header holds its constants and records only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kiln::artifact {

inline constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'A', 'R', 'T', '\0'};
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint64_t kSectionAlign = 64;
inline constexpr uint64_t kWeightsAlign = 4096;    ///< weights section start: mmap-able
inline constexpr uint64_t kTensorAlign = 256;      ///< each weight within the section

enum SectionKind : uint32_t {
  kSectionMeta = 1,
  kSectionPlan = 2,
  kSectionImage = 3,
  kSectionWeights = 4,
  kSectionSource = 5,
  /// One program of an artifact holding per-rank programs (a pipeline's stages): a whole
  /// artifact of its own, named `program.K`; meta `rank_programs` maps each rank to its K.
  kSectionProgram = 6,
};

struct Header {
  char magic[8];
  uint32_t format_version;
  uint32_t section_count;
  uint64_t table_offset;
  uint64_t file_size;
  uint64_t table_checksum;  ///< fnv1a64 of the section table bytes
  uint8_t reserved[24];
};
static_assert(sizeof(Header) == 64, "artifact header is 64 bytes");

struct SectionEntry {
  uint32_t kind;
  uint32_t flags;
  uint64_t offset;
  uint64_t size;
  uint64_t checksum;  ///< fnv1a64 of the section bytes
  char name[64];      ///< NUL-padded
};
static_assert(sizeof(SectionEntry) == 96, "artifact section entry is 96 bytes");

/// FNV-1a 64: detects corruption and truncation (not an integrity guarantee against tampering).
inline uint64_t fnv1a64(const void* data, size_t size, uint64_t hash = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= p[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

}  // namespace kiln::artifact
