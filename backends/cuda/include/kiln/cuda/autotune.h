// Autotuning at compile time (backend option autotune): time the cuBLASLt / cuDNN candidates
// of every gemm and conv step on this machine's GPU through the runtime, record the fastest in
// the plan, and keep each choice in the kernel cache.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kiln/core/artifact.h"
#include "kiln/core/kernel_cache.h"
#include "kiln/ir/status.h"

namespace kiln::cuda {

/// One tuned choice as the kernel cache keeps it.
struct TunedChoice {
  std::string choice;  ///< plan fields ("algo=..." for gemm, "algo=... algo_math=..." for conv)
  double best_ms = 0, heuristic_ms = 0;
  bool operator==(const TunedChoice&) const = default;
};

/// The cache key of a problem descriptor (kiln_model_step_problem: shapes, dtypes, device,
/// library version), with the Kiln version as producer.
KernelCacheKey autotune_cache_key(const std::string& problem);
/// The cache payload of a choice, and back; nullopt for a payload that is not one.
std::string encode_tuned_choice(const TunedChoice& c);
std::optional<TunedChoice> decode_tuned_choice(const std::string& payload);

/// Appends choice text to the line of each plan step (by index among the plan's "step " lines).
/// Fails naming an index the plan does not have or a step that already carries an algo=.
StatusOr<std::string> apply_tuned_choices(const std::string& plan, const std::map<size_t, std::string>& choices);

/// The target among `targets` ("sm_90a", "compute_90") built for the architecture of a device
/// named `device` ("sm_90"), or "" when none is.
std::string autotune_target_for(const std::string& device, const std::vector<std::string>& targets);

/// How much to time: candidates per step and timed launches per candidate.
struct AutotuneOptions {
  int max_candidates = 16;
  int iterations = 15;
};

/// Tunes `art` (its plan, weights and images, including one for the device here) in place on
/// device 0 when its architecture matches one of `targets`: the plan's gemm and conv steps get
/// their fastest algorithms, from the kernel cache when an entry exists. Returns the one-line
/// summary ("autotune: 4 gemm problems (3 from cache), 0 conv on ...") or, without a usable
/// device, a note that the steps keep the libraries' own choices; neither case is an error.
/// `warnings` receives corrupt cache entries (re-tuned).
StatusOr<std::string> autotune_artifact(ArtifactContents& art, const std::vector<std::string>& targets,
                                        const AutotuneOptions& opts = {},
                                        std::vector<std::string>* warnings = nullptr);

}  // namespace kiln::cuda
