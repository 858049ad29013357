// The bulk-copy INT4 kernel (int4_bulk.cpp): symmetric group-128 weights, M <= 8, sm_90 plans.
#pragma once

#include <cstdint>

namespace kiln::cuda::detail {

/// CUDA source of the kernel, with the $KEYs of the streaming kernel ($NAME $XT $ST $M $N $K
/// $FLIP $EXP $BASE, $BIAS(n)) and its own: $S stages, $W consumer warps, $TPB 16-row tiles per
/// block at most. Launched as grid {blocks}, ($W + 1) * 32 threads, the streaming kernel's
/// arguments (x, w, scales, zeros, bias, y, part; zeros and part unused).
extern const char* kInt4Bulk;

struct Int4BulkPlan {
  bool fits = false;
  int64_t blocks = 0, per_block = 0, stages = 0, warps = 0, smem = 0;
};

/// Whether the kernel applies (symmetric group 128, 2-byte scales on a 16-byte boundary, M <= 8,
/// N % 16 == 0, K % 256 == 0, at least two stages in `smem_limit`) and its launch shape.
Int4BulkPlan plan_int4_bulk(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, int64_t scale_bytes,
                            bool scales_aligned, int64_t smem_limit);

}  // namespace kiln::cuda::detail
