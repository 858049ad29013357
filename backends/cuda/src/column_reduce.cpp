// Column sums: a sum or mean over every dim but the last of a float tensor read as [R, C] (a
// layer norm's weight and bias gradients over the B*T rows, a position embedding's gradient
// over the batch). A warp reads 32 neighbouring 16-byte vectors of a row, the block's 8 warps
// take every 8th row of a chunk of rows, and every thread keeps its vector's sums in registers,
// so each block streams its tile with wide, independent loads. Chunks of rows go to different
// blocks when the tiles alone would leave the GPU idle; a second kernel adds a column's chunk
// sums in a fixed order, so the result is the same on every run.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// Blocks the first kernel aims for (four per SM of a 132-SM H100/H200).
constexpr int64_t kColumnBlocks = 528;
/// At most this many row chunks, of at least kMinChunkRows rows each.
constexpr int64_t kMaxChunks = 64;
constexpr int64_t kMinChunkRows = 16;
constexpr int kWarps = kBlock / 32;

}  // namespace

StatusOr<bool> Lowerer::column_sum(const Node& n, int x, int64_t rows, int64_t cols, const std::string& fin, int out) {
  const DType t = n.operand(0)->dtype();
  if (t != DType::kF32 && t != DType::kBF16 && t != DType::kF16) return false;
  const int64_t es = dtype_storage_bytes(t, 1), v = 16 / es;
  // 16-byte vectors: whole vectors per row, rows starting on 16-byte boundaries.
  const bool aligned = bufs_[x].kind != "alias" || bufs_[x].offset % 16 == 0;
  if (!aligned || cols % v != 0 || rows < 2) return false;
  KILN_ASSIGN_OR_RETURN(const std::string st, storage(n, t));
  const int64_t vectors = cols / v, tiles = (vectors + 31) / 32;
  const int64_t chunks = std::max<int64_t>(1, std::min({kColumnBlocks / tiles, kMaxChunks, rows / kMinChunkRows}));
  const int64_t chunk = (rows + chunks - 1) / chunks;
  const std::string V = std::to_string(v), C = int_literal(cols), R = int_literal(rows), W = std::to_string(kWarps);
  // part[w][j * 32 + lane]: warp w's sums of element j of each lane's vector (no bank conflicts).
  std::string body = "  __shared__ float part[" + W + "][32 * " + V + "];\n";
  body += "  const int lane = threadIdx.x & 31, wrp = threadIdx.x >> 5;\n";
  body += "  for (long long blk = blockIdx.x; blk < " + int_literal(tiles * chunks) + "; blk += gridDim.x) {\n";
  body += "    const long long s = blk / " + int_literal(tiles) + ", tile = blk % " + int_literal(tiles) + ";\n";
  body += "    const long long cv = tile * 32 + lane;\n";
  body += "    float a[" + V + "];\n#pragma unroll\n    for (int j = 0; j < " + V + "; ++j) a[j] = 0.f;\n";
  body += "    if (cv < " + int_literal(vectors) + ") {\n";
  body += "      const long long r1 = min((s + 1) * " + int_literal(chunk) + ", " + R + ");\n";
  body += "#pragma unroll 4\n      for (long long r = s * " + int_literal(chunk) + " + wrp; r < r1; r += " + W + ") {\n";
  body += "        const uint4 q = *reinterpret_cast<const uint4*>(x + r * " + C + " + cv * " + V + ");\n";
  body += "        const " + st + "* e = reinterpret_cast<const " + st + "*>(&q);\n";
  body += "#pragma unroll\n        for (int j = 0; j < " + V + "; ++j) a[j] += " + load_expr(t, "e[j]") + ";\n";
  body += "      }\n    }\n";
  body += "#pragma unroll\n    for (int j = 0; j < " + V + "; ++j) part[wrp][j * 32 + lane] = a[j];\n";
  body += "    __syncthreads();\n";
  // Thread i adds the warps' sums of one element: lane i % 32's vector, element i / 32.
  body += "    if (threadIdx.x < 32 * " + V + ") {\n";
  body += "      float acc = part[0][threadIdx.x];\n";
  body += "      for (int w = 1; w < " + W + "; ++w) acc += part[w][threadIdx.x];\n";
  body += "      const long long col = (tile * 32 + (threadIdx.x & 31)) * " + V + " + (threadIdx.x >> 5);\n";
  body += "      if (col < " + C + ") ";
  body += chunks == 1 ? "y[col] = " + store_expr(t, fin) + ";\n" : "partial[s * " + C + " + col] = acc;\n";
  body += "    }\n    __syncthreads();\n  }\n";
  // Named apart from the general reductions, so profiles tell the two kinds apart.
  const std::string kind = n.op_name() == "reduce_mean" ? "column_mean" : "column_sum";
  const std::string name = kernel_name(kind);
  if (chunks == 1) {
    add_kernel(name, "const " + st + "* __restrict__ x, " + st + "* __restrict__ y", body);
    launch(name, tiles, {x, out});
    return true;
  }
  const int partial = add_buffer("activation", DType::kF32, {chunks, cols});
  add_kernel(name, "const " + st + "* __restrict__ x, float* __restrict__ partial", body);
  launch(name, tiles * chunks, {x, partial});
  // A column per lane, the warps taking every 8th chunk, then warp 0 adding the warps' sums.
  std::string fold = "  __shared__ float part[" + W + "][33];\n";
  fold += "  const int lane = threadIdx.x & 31, wrp = threadIdx.x >> 5;\n";
  fold += "  for (long long blk = blockIdx.x; blk < " + int_literal((cols + 31) / 32) + "; blk += gridDim.x) {\n";
  fold += "    const long long col = blk * 32 + lane;\n";
  fold += "    float acc = 0.f;\n";
  fold += "    if (col < " + C + ")\n";
  fold += "      for (int s = wrp; s < " + std::to_string(chunks) + "; s += " + W + ") acc += partial[s * " + C + " + col];\n";
  fold += "    part[wrp][lane] = acc;\n    __syncthreads();\n";
  fold += "    if (wrp == 0 && col < " + C + ") {\n";
  fold += "      for (int w = 1; w < " + W + "; ++w) acc += part[w][lane];\n";
  fold += "      y[col] = " + store_expr(t, fin) + ";\n    }\n    __syncthreads();\n  }\n";
  const std::string fold_name = kernel_name(kind + "_splits");
  add_kernel(fold_name, "const float* __restrict__ partial, " + st + "* __restrict__ y", fold);
  launch(fold_name, (cols + 31) / 32, {partial, out});
  return true;
}

}  // namespace kiln::cuda::detail
