// Autotuning helpers shared by the gemm and conv steps: timing candidates with CUDA events.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

#include "status.h"

struct kiln_model;

namespace kiln::rt {

/// What tuning one step found (see kiln_tune_result).
struct TuneOutcome {
  int candidates = 0;
  double best_ms = 0, heuristic_ms = 0;
  std::string choice;  ///< plan fields, "" when nothing was tuned
};

/// The median device time of `launch` (one enqueue on `stream`) over `iterations` runs, each
/// bracketed by its own events, after two warm-up runs. A failing launch returns its status.
kiln_status* median_launch_ms(cudaStream_t stream, int iterations, const std::function<kiln_status*()>& launch,
                              double* out_ms);

/// The descriptor of a step's tuning problem (see kiln_model_step_problem); "" when none.
kiln_status* step_problem(const kiln_model* model, size_t step, std::string* out);
/// Times a step's candidate algorithms (see kiln_model_tune_step).
kiln_status* tune_step(kiln_model* model, size_t step, int max_candidates, int iterations, TuneOutcome* out);

}  // namespace kiln::rt
