// The bulk-copy INT4 kernel (int4_bulk.cpp): symmetric group-128 weights, M <= 16, sm_90 plans.
#pragma once

#include <cstdint>

namespace kiln::cuda::detail {

/// CUDA source of the kernel, with the $KEYs of the streaming kernel ($NAME $XT $ST $M $N $K
/// $FLIP $EXP $BASE, $BIAS(n)) and its own: $CLUSTER (the pair attribute when $C is 2), $S
/// stages, $W warps, $TPB 16-row tiles per block at most, $C blocks along K (1 or 2),
/// $NKB k-blocks per warp, $SQ warps per slice, $NT8 n8 tiles of x. Launched as grid
/// {blocks, C}, $W * 32 threads, the streaming kernel's arguments (x, w, scales, zeros,
/// bias, y, part; zeros and part unused).
extern const char* kInt4Bulk;

struct Int4BulkPlan {
  bool fits = false;
  // Row-tile blocks (grid.x), blocks along K (grid.y, a cluster), 16-row tiles per block at most,
  // ring stages, warps, k-blocks per warp, warps per stage, n8 tiles of x, shared memory.
  int64_t blocks = 0, split = 1, per_block = 0, stages = 0, warps = 8, nkb = 0, sq = 0, nt8 = 1, smem = 0;
};

/// Whether the kernel applies (symmetric group 128, 2-byte scales on a 16-byte boundary,
/// M <= 16, N % 16 == 0, K a whole number of 1024-wide slices per block, x's fragments within
/// 128 registers, at least two stages in `smem_limit`) and its launch shape. `split` 0 chooses
/// the blocks along K (1 unless x's fragments need 2), 1 or 2 asks for that many; `slice_kb` 0
/// streams slices of 16 k-blocks (where the warps allow), else of at least that many.
Int4BulkPlan plan_int4_bulk(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, int64_t scale_bytes,
                            bool scales_aligned, int64_t smem_limit, int64_t split = 0, int64_t slice_kb = 0);

}  // namespace kiln::cuda::detail
