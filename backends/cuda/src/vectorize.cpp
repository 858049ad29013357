// Memory-bound kernels at full bandwidth: the vector launch loop, 16-byte row copies and the
// shared-memory tiled transpose behind strided_copy.
#include "lowerer.h"

namespace kiln::cuda::detail {

void Lowerer::launch_vectors(const std::string& kernel, const std::string& params, int64_t n, int64_t width,
                             const std::string& body, const std::vector<int>& args, const std::string& prologue,
                             const std::string& epilogue, int64_t max_blocks) {
  const int64_t vectors = n / width;
  // 32-bit when the first element of the last vector plus one grid stride cannot wrap.
  const bool narrow = n <= int64_t{0x7fffffff};
  const std::string T = narrow ? "unsigned" : "long long";
  auto num = [&](int64_t v) { return narrow ? std::to_string(v) + "u" : int_literal(v); };
  add_kernel(kernel, params,
             prologue + "  for (" + T + " q = (" + T + ")blockIdx.x * blockDim.x + threadIdx.x; q < " + num(vectors) +
                 "; q += (" + T + ")gridDim.x * blockDim.x) {\n    const " + T + " i = q * " + num(width) +
                 "; (void)i;\n" + body + "  }\n" + epilogue);
  const int64_t blocks = (vectors + kBlock - 1) / kBlock;
  launch(kernel, max_blocks > 0 ? std::min(blocks, max_blocks) : blocks, args);
}

int64_t Lowerer::vector_width(const std::vector<DType>& types) {
  int64_t widest = 1;
  for (DType t : types) widest = std::max(widest, dtype_storage_bytes(t, 1));
  return 16 / widest >= 2 ? 16 / widest : 0;
}

StatusOr<bool> Lowerer::vector_copy(const Node& n, int in, int out, Sizes iter, Sizes in_strides, int64_t in_base,
                                    Sizes out_strides, int64_t out_base) {
  const DType t = bufs_[in].dtype;
  if (t == DType::kI4 || !storage_type(t)) return false;
  const int64_t es = dtype_storage_bytes(t, 1);
  // Merge each dim into the one before it where both sides are contiguous across them; drop size-1 dims.
  Sizes it, is, os;
  for (size_t d = 0; d < iter.size(); ++d) {
    if (iter[d] == 1) continue;
    if (!it.empty() && is.back() == in_strides[d] * iter[d] && os.back() == out_strides[d] * iter[d]) {
      it.back() *= iter[d], is.back() = in_strides[d], os.back() = out_strides[d];
      continue;
    }
    it.push_back(iter[d]), is.push_back(in_strides[d]), os.push_back(out_strides[d]);
  }
  if (it.empty() || os.back() != 1) return false;
  const size_t r = it.size() - 1;
  const std::string params = "const " + vector_type(es) + "* __restrict__ x, " + vector_type(es) + "* __restrict__ y";
  if (is[r] == 1) {
    // Rows of the innermost dim: the widest vector that divides every offset.
    for (int64_t w = 16 / es; w >= 2; w /= 2) {
      bool fits = it[r] % w == 0 && in_base % w == 0 && out_base % w == 0 && aligned16(in) && aligned16(out);
      for (size_t d = 0; d < r; ++d) fits &= is[d] % w == 0 && os[d] % w == 0;
      if (!fits) continue;
      Sizes vi = it, vis = is, vos = os;
      vi[r] /= w;
      for (size_t d = 0; d < r; ++d) vis[d] /= w, vos[d] /= w;
      const std::string vt = vector_type(w * es);
      launch_vectors(kernel_name(n.op_name()), params, product(it), w,
                     index_code("q", vi, {vis, vos}, {"src", "dst"}, {in_base / w, out_base / w}) +
                         "    reinterpret_cast<" + vt + "*>(y)[dst] = reinterpret_cast<const " + vt + "*>(x)[src];\n",
                     {in, out});
      return true;
    }
    return false;
  }
  // The innermost output dim is strided in the input: a 32x32 tile is read along the input's
  // contiguous dim p and written along the output's, through shared memory.
  size_t p = r;
  for (size_t d = 0; d < r; ++d)
    if (is[d] == 1) p = d;
  if (p == r || it[p] < 8 || it[r] < 8) return false;
  Sizes rest, rest_in, rest_out;
  for (size_t d = 0; d < r; ++d)
    if (d != p) rest.push_back(it[d]), rest_in.push_back(is[d]), rest_out.push_back(os[d]);
  // Bytes (the f8 operands FP8 GEMMs take transposed) move 4 to a thread through a 64x64 tile:
  // one byte a thread leaves the copy bound by instructions, not by memory.
  bool bytes = es == 1 && it[p] % 64 == 0 && it[r] % 64 == 0 && is[r] % 4 == 0 && os[p] % 4 == 0 && in_base % 4 == 0 &&
               out_base % 4 == 0 && aligned16(in) && aligned16(out);
  for (size_t d = 0; d < rest.size(); ++d) bytes &= rest_in[d] % 4 == 0 && rest_out[d] % 4 == 0;
  const int64_t edge = bytes ? 64 : 32;
  const int64_t tp = (it[p] + edge - 1) / edge, tl = (it[r] + edge - 1) / edge, tiles = tp * tl * product(rest);
  const bool narrow = tiles <= int64_t{0x7fffffff};
  const std::string T = narrow ? "unsigned" : "long long";
  auto num = [&](int64_t v) { return narrow ? std::to_string(v) + "u" : int_literal(v); };
  const std::string name = kernel_name(n.op_name());
  if (bytes) {
    // Tile rows are the input's strided dim l, 64 bytes of its contiguous dim p each, as 16
    // words (+1: fewer bank conflicts); a thread then packs 4 bytes of one output row.
    add_kernel_text(name, "extern \"C\" __global__ void __launch_bounds__(256) " + name + "(" + params + ") {\n" +
                              "  __shared__ unsigned tile[64][17];\n"
                              "  const unsigned c = threadIdx.x & 15u, r0 = threadIdx.x >> 4;\n"
                              "  for (" + T + " t = blockIdx.x; t < " + num(tiles) + "; t += gridDim.x) {\n"
                              "    const long long l0 = (long long)(t % " + num(tl) + ") * 64, p0 = (long long)(t / " +
                              num(tl) + " % " + num(tp) + ") * 64;\n    " +
                              index_code("t / " + num(tl * tp), rest, {rest_in, rest_out}, {"src", "dst"},
                                         {in_base, out_base}) +
                              "    #pragma unroll\n"
                              "    for (unsigned k = 0; k < 64u; k += 16u)\n"
                              "      tile[r0 + k][c] = *reinterpret_cast<const unsigned*>(x + src + p0 + 4 * c + (l0 + r0 + k) * " +
                              int_literal(is[r]) + ");\n"
                              "    __syncthreads();\n"
                              "    #pragma unroll\n"
                              "    for (unsigned k = 0; k < 64u; k += 16u) {\n"
                              "      const unsigned pr = r0 + k;\n"
                              "      unsigned o = 0u;\n"
                              "      #pragma unroll\n"
                              "      for (unsigned j = 0; j < 4u; ++j)\n"
                              "        o |= ((tile[4u * c + j][pr >> 2] >> (8u * (pr & 3u))) & 0xffu) << (8u * j);\n"
                              "      *reinterpret_cast<unsigned*>(y + dst + (p0 + pr) * " + int_literal(os[p]) +
                              " + l0 + 4 * c) = o;\n"
                              "    }\n"
                              "    __syncthreads();\n"
                              "  }\n}");
    launch_grid(name, {std::min(tiles, kMaxGrid)}, 256, 0, {in, out});
    return true;
  }
  add_kernel_text(name, "extern \"C\" __global__ void __launch_bounds__(256) " + name + "(" + params + ") {\n" +
                            "  __shared__ " + vector_type(es) + " tile[32][33];  // +1 column: no bank conflicts\n"
                            "  const unsigned tx = threadIdx.x & 31u, ty = threadIdx.x >> 5;\n"
                            "  for (" + T + " t = blockIdx.x; t < " + num(tiles) + "; t += gridDim.x) {\n"
                            "    const " + T + " l0 = t % " + num(tl) + " * 32u, p0 = t / " + num(tl) + " % " + num(tp) +
                            " * 32u;\n    " +
                            index_code("t / " + num(tl * tp), rest, {rest_in, rest_out}, {"src", "dst"}, {in_base, out_base}) +
                            "    #pragma unroll\n"
                            "    for (unsigned k = 0; k < 32u; k += 8u) {\n"
                            "      const " + T + " p = p0 + tx, l = l0 + ty + k;\n"
                            "      if (p < " + num(it[p]) + " && l < " + num(it[r]) + ") tile[ty + k][tx] = x[src + p + l * " +
                            int_literal(is[r]) + "];\n"
                            "    }\n"
                            "    __syncthreads();\n"
                            "    #pragma unroll\n"
                            "    for (unsigned k = 0; k < 32u; k += 8u) {\n"
                            "      const " + T + " p = p0 + ty + k, l = l0 + tx;\n"
                            "      if (p < " + num(it[p]) + " && l < " + num(it[r]) + ") y[dst + p * " + int_literal(os[p]) +
                            " + l] = tile[tx][ty + k];\n"
                            "    }\n"
                            "    __syncthreads();\n"
                            "  }\n}");
  launch_grid(name, {std::min(tiles, kMaxGrid)}, 256, 0, {in, out});
  return true;
}

}  // namespace kiln::cuda::detail
