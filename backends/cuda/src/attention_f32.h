// The register-tiled f32 flash-attention device function (CUDA cores) for fp32 models.
#pragma once

#include <cstdint>

namespace kiln::cuda::detail {

/// Query rows per block of kiln_attn_f32_tiled: the grid is (ceil(Sq / 64), Hq, B).
inline constexpr int64_t kF32AttentionRows = 64;
/// Threads per block of kiln_attn_f32_tiled (16 x 16, each owning a 4-row micro-tile).
inline constexpr int64_t kF32AttentionThreads = 256;

/// Device source defining `kiln_attn_f32_tiled<D, DV, CAUSAL, HAS_MASK, MT>` (guarded by
/// KILN_ATTN_F32_TILED, so it may be appended to a source more than once). It includes
/// cuda_fp16.h and cuda_bf16.h for the mask types.
const char* f32_attention_source();

/// Dynamic shared memory in bytes of one block of kiln_attn_f32_tiled for head dims `d`, `dv`.
int64_t f32_attention_smem_bytes(int64_t d, int64_t dv);

}  // namespace kiln::cuda::detail
