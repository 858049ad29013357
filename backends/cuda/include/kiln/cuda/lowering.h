// Lowering of Kiln IR to CUDA C++ and an execution plan (docs/artifact.md), shared by the
// cuda-sm80, cuda-sm90 and cuda-sm100 backends.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"

namespace kiln::cuda {

/// What differs between GPU generations: one row per backend plugin.
struct Capabilities {
  std::string plugin;                ///< "cuda-sm90"
  std::string version;               ///< the plugin's version
  std::string summary;               ///< one line for `kiln plugins`
  int sm = 80;                       ///< compute capability, major * 10 + minor
  std::vector<std::string> targets;  ///< NVRTC targets: "sm_90a" (cubin), "compute_90" (PTX)
  bool fp8 = false;                  ///< FP8 tensor cores (e4m3/e5m2)
  std::string tensor_cores;          ///< "mma.sync", "wgmma", "tcgen05"
  int64_t max_smem_per_block = 0;    ///< opt-in dynamic shared memory limit, bytes
};

struct LoweringOptions {
  bool allow_tf32 = false;       ///< f32 GEMMs (matmul, linear) may use tf32 tensor cores
  bool allow_tf32_conv = false;  ///< f32 convolutions (cuDNN, 1x1 and im2col GEMMs, the stem) too
  /// Every target has FP8 tensor cores. When false, scaled_matmul is refused unless its
  /// `fallback` attribute is bf16 (then it runs as a GEMM in the result dtype on dequantized operands).
  bool fp8 = true;
  /// How convs lower: "cudnn" (a plan conv step run by cuDNN, absorbing bias, residual add
  /// and relu) or "gemm" (im2col + cuBLASLt GEMMs, or a direct kernel).
  std::string conv = "cudnn";
  /// How depthwise convs (groups == input channels) lower: "kernel" (a generated kernel applying
  /// the bias and the pointwise ops after it) or "cudnn" (as `conv` says).
  std::string depthwise = "kernel";
  /// How 1x1 convs with unit strides, no padding and one group lower: "gemm" (one strided-batched
  /// cuBLASLt GEMM with the bias, a residual add and a relu fused) or "cudnn" (as `conv` says).
  std::string conv1x1 = "gemm";
  /// Who is lowering, for messages: "cuda-sm80: target sm_80".
  std::string target = "cuda";
  /// Opt-in dynamic shared memory of the smallest device the plan targets (kernels needing
  /// more take a leaner variant); 0 assumes the sm_80 limit.
  int64_t max_smem_per_block = 0;
  /// Asymmetric INT4 weights dequantize as (q - zero)·scale in every kernel, the reference's
  /// form, never as q·scale + (-zero·scale) with -zero·scale rounded once to x's half type
  /// (the backend option int4-exact-zeros).
  bool int4_exact_zeros = false;
};

/// The result of lowering one graph: what an artifact needs besides the kernel images.
struct LoweredGraph {
  std::string plan;                  ///< "kiln-plan 1\n..."
  std::string weights;               ///< the weights section
  std::string source;                ///< CUDA C++ defining every kernel the plan launches
  std::vector<std::string> kernels;  ///< kernel names, in plan order
};

/// Lowers a graph whose shapes are all static. Unsupported ops or dtypes give an
/// unimplemented status naming them; symbolic dims an invalid-argument naming the value.
StatusOr<LoweredGraph> lower_graph(const Graph& g, const LoweringOptions& opts = {});

/// Replaces symbolic dims of the graph inputs by `sizes` and re-infers every type.
/// Fails naming a symbol that has no size.
Status bind_symbols(Graph& g, const std::map<std::string, int64_t>& sizes);

}  // namespace kiln::cuda
