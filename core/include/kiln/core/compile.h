// From an optimized graph to a .kiln artifact's contents: what `kiln compile` and the Python
// package share.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kiln/core/artifact.h"
#include "kiln/core/pipeline.h"
#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"

namespace kiln {

/// One backend of a compile and the targets it builds.
struct TargetGroup {
  const BackendInfo* backend = nullptr;
  std::vector<std::string> targets;
};

/// Gives each of the pipeline's targets to the backend that lists it (the pipeline's backend
/// when several do; only those in `only_backends` when it is not empty), grouped in the order
/// the targets come. An unknown target is an error naming the known ones.
StatusOr<std::vector<TargetGroup>> group_targets(const Pipeline& p, const Registry& reg,
                                                 const std::vector<std::string>& only_backends);

/// Binds symbolic dims to `symbols` in every type and re-verifies; every shape must end up
/// static (artifacts have static shapes). Symbols in `taken` were bound by the front end, so
/// the graph need not mention them.
Status bind_symbols(Graph& g, const std::map<std::string, int64_t>& symbols, const std::set<std::string>& taken);

/// Has every group's backend add its part of the artifact for static graph `g`, and fills the
/// meta keys kiln_version, targets, plugins and pipeline (the caller adds model and
/// created_by). The recorded pipeline names the first backend used, so `p.backend` becomes it.
StatusOr<ArtifactContents> build_artifact_contents(const Graph& g, Pipeline& p, const Registry& reg,
                                                   const std::vector<TargetGroup>& groups);

/// Whether `im` serves `target`: built for it, or the PTX of its compute_ twin.
bool image_serves(const ArtifactImage& im, const std::string& target);

}  // namespace kiln
