// Memory-bound kernels at full bandwidth: the vector launch loop, 16-byte row copies and the
// shared-memory tiled transpose behind strided_copy.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// The transpose of a byte matrix (f8: the operands FP8 GEMMs take transposed) at memory
/// bandwidth: each block moves 128x128-byte tiles, every thread 16 bytes per global load and
/// store (a warp 4 whole 128-byte rows each), transposing 4x4 bytes in registers so that the
/// shared-memory exchange is in words. The tile is kept transposed as 128 rows p of 8 16-byte
/// chunks of l, chunk c of row p at c ^ (p / 16 % 8): the 32 word stores of a warp (8 rows p
/// 16 apart, 4 words of one chunk) and each quarter-warp's 16-byte loads (one row, its 8
/// chunks) all fall in different banks. `tile_loop` opens the loop over tiles `t`,
/// `l_tile`/`p_tile` number the tile along l (the input's rows, the output's contiguous dim;
/// `l_size` long, rows `in_row` bytes apart) and p (the input's contiguous dim; output rows
/// `out_row` bytes apart), `offsets` sets `src`/`dst` of the tile's batch. Both sizes are
/// multiples of 16; a partial tile skips the 16-byte chunks past an edge.
std::string byte_transpose_kernel(const std::string& name, const std::string& params, const std::string& tile_loop,
                                  const std::string& l_tile, const std::string& p_tile, const std::string& offsets,
                                  int64_t l_size, int64_t p_size, int64_t in_row, int64_t out_row) {
  auto inside = [](const std::vector<std::string>& conds) {
    std::string c;
    for (const std::string& s : conds)
      if (!s.empty()) c += (c.empty() ? "" : " && ") + s;
    return c.empty() ? "" : "if (" + c + ") ";
  };
  const bool l_edge = l_size % 128 != 0, p_edge = p_size % 128 != 0;
  const std::string L = int_literal(l_size), P = int_literal(p_size);
  const std::string load_if = inside({l_edge ? "l0 + 4 * q < " + L : "", p_edge ? "p0 + 16 * c < " + P : ""});
  const std::string store_if = inside({p_edge ? "p0 + pr < " + P : "", l_edge ? "l0 + 16 * c < " + L : ""});
  return "extern \"C\" __global__ void __launch_bounds__(256) " + name + "(" + params + ") {\n" +
         "  __shared__ uint4 tile[128][8];  // [p][chunk of 16 l, swizzled]\n"
         "  unsigned* const words = reinterpret_cast<unsigned*>(tile);\n"
         "  // c: a 16-byte chunk of a row; q: reading, input rows 4q..4q+3, writing, output rows q + 32k\n"
         "  const unsigned c = threadIdx.x & 7u, q = threadIdx.x >> 3;\n" +
         tile_loop + "    const long long l0 = " + l_tile + " * 128, p0 = " + p_tile + " * 128;\n    " + offsets +
         "    unsigned w[4][4];  // w[i][m]: bytes p0 + 16c + 4m .. +3 of input row l0 + 4q + i\n"
         "    #pragma unroll\n"
         "    for (unsigned i = 0; i < 4u; ++i) {\n"
         "      uint4 v = make_uint4(0u, 0u, 0u, 0u);\n"
         "      " + load_if + "v = *reinterpret_cast<const uint4*>(x + src + p0 + 16 * c + (l0 + 4 * q + i) * " +
         int_literal(in_row) + ");\n"
         "      w[i][0] = v.x, w[i][1] = v.y, w[i][2] = v.z, w[i][3] = v.w;\n"
         "    }\n"
         "    #pragma unroll\n"
         "    for (unsigned m = 0; m < 4u; ++m) {\n"
         "      // byte j of the 4 rows' word m -> the word of output row 16c + 4m + j at l 4q..4q+3\n"
         "      const unsigned lo01 = __byte_perm(w[0][m], w[1][m], 0x5140u), lo23 = __byte_perm(w[2][m], w[3][m], 0x5140u);\n"
         "      const unsigned hi01 = __byte_perm(w[0][m], w[1][m], 0x7362u), hi23 = __byte_perm(w[2][m], w[3][m], 0x7362u);\n"
         "      const unsigned col[4] = {__byte_perm(lo01, lo23, 0x5410u), __byte_perm(lo01, lo23, 0x7632u),\n"
         "                               __byte_perm(hi01, hi23, 0x5410u), __byte_perm(hi01, hi23, 0x7632u)};\n"
         "      #pragma unroll\n"
         "      for (unsigned j = 0; j < 4u; ++j)\n"
         "        words[(16u * c + 4u * m + j) * 32u + 4u * ((q >> 2) ^ c) + (q & 3u)] = col[j];\n"
         "    }\n"
         "    __syncthreads();\n"
         "    #pragma unroll\n"
         "    for (unsigned k = 0; k < 4u; ++k) {\n"
         "      const unsigned pr = q + 32u * k;\n"
         "      " + store_if + "*reinterpret_cast<uint4*>(y + dst + (p0 + pr) * " + int_literal(out_row) +
         " + l0 + 16 * c) = tile[pr][c ^ (pr >> 4)];\n"
         "    }\n"
         "    __syncthreads();\n"
         "  }\n}";
}

}  // namespace

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
  // Bytes (the f8 operands FP8 GEMMs take transposed) move 16 to a thread through a 128x128
  // tile (byte_transpose_kernel) where both dims are multiples of 16 and every row starts
  // 16-byte aligned; anything else takes the 32x32 tile of single elements below.
  bool bytes = es == 1 && it[p] % 16 == 0 && it[r] % 16 == 0 && is[r] % 16 == 0 && os[p] % 16 == 0 &&
               in_base % 16 == 0 && out_base % 16 == 0 && aligned16(in) && aligned16(out);
  for (size_t d = 0; d < rest.size(); ++d) bytes &= rest_in[d] % 16 == 0 && rest_out[d] % 16 == 0;
  const int64_t edge = bytes ? 128 : 32;
  const int64_t tp = (it[p] + edge - 1) / edge, tl = (it[r] + edge - 1) / edge, tiles = tp * tl * product(rest);
  const bool narrow = tiles <= int64_t{0x7fffffff};
  const std::string T = narrow ? "unsigned" : "long long";
  auto num = [&](int64_t v) { return narrow ? std::to_string(v) + "u" : int_literal(v); };
  const std::string name = kernel_name(n.op_name());
  const std::string tile_loop = "  for (" + T + " t = blockIdx.x; t < " + num(tiles) + "; t += gridDim.x) {\n";
  const std::string tile_offsets =
      index_code("t / " + num(tl * tp), rest, {rest_in, rest_out}, {"src", "dst"}, {in_base, out_base});
  if (bytes) {
    add_kernel_text(name, byte_transpose_kernel(name, params, tile_loop, "(long long)(t % " + num(tl) + ")",
                                                "(long long)(t / " + num(tl) + " % " + num(tp) + ")", tile_offsets,
                                                it[r], it[p], is[r], os[p]));
    launch_grid(name, {std::min(tiles, kMaxGrid)}, 256, 0, {in, out});
    return true;
  }
  add_kernel_text(name, "extern \"C\" __global__ void __launch_bounds__(256) " + name + "(" + params + ") {\n" +
                            "  __shared__ " + vector_type(es) + " tile[32][33];  // +1 column: no bank conflicts\n"
                            "  const unsigned tx = threadIdx.x & 31u, ty = threadIdx.x >> 5;\n" +
                            tile_loop + "    const " + T + " l0 = t % " + num(tl) + " * 32u, p0 = t / " + num(tl) +
                            " % " + num(tp) + " * 32u;\n    " + tile_offsets +
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
