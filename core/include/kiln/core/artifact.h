// Building and writing .kiln artifacts (docs/artifact.md). Backends fill ArtifactContents;
// the compile driver writes the file. The runtime has its own reader.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kiln/ir/status.h"

namespace kiln {

/// One loadable module for one target.
struct ArtifactImage {
  std::string target;  ///< "sm_90a", "compute_90a", ...
  std::string form;    ///< "cubin" or "ptx"
  std::string bytes;
};

/// Everything a .kiln file holds, in memory.
struct ArtifactContents {
  std::map<std::string, std::string> meta;  ///< docs/artifact.md "meta keys"
  std::string plan;                          ///< plan text, "kiln-plan 1\n..."
  std::string weights;                       ///< the weights section's bytes
  std::vector<ArtifactImage> images;
  std::map<std::string, std::string> sources;  ///< target → generated source (optional)
  /// Per-rank programs (each a serialized artifact) of an artifact whose ranks run different
  /// programs; such an artifact has no plan of its own (see rank_program_contents).
  std::vector<std::string> programs;
};

/// One artifact for every rank of a mesh whose ranks run different programs (a pipeline's
/// stages): `per_rank[r]` is rank r's serialized artifact; equal ones are stored once, and meta
/// `rank_programs` lists each rank's program. `meta` is the outer artifact's.
ArtifactContents rank_program_contents(const std::vector<std::string>& per_rank, std::map<std::string, std::string> meta);

/// Serializes to the file format (header, aligned sections, checksummed section table).
std::string serialize_artifact(const ArtifactContents& contents);
/// Writes through a temporary file and a rename, so a crash never leaves a partial artifact.
Status write_artifact(const std::string& path, const ArtifactContents& contents);

}  // namespace kiln
