// Tests of the matmul_int4 lowering: which kernel each M and dtype gets, the split-K steps for
// small N, the dequantize + gemm path, the backend option int4-exact-zeros, and NVRTC
// compilation of every variant for every target.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "int4_const_graph.h"
#include "kiln/core/artifact.h"
#include "kiln/core/registry.h"
#include "kiln/cuda/backend.h"
#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/dtype.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"

namespace kiln::cuda {
namespace {

/// A one-node matmul_int4 graph: x dt[m, k], weights [n, k/2], scales st[n, k/g] (zeros when
/// asymmetric), optional bias.
std::string int4_graph(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, const std::string& dt,
                       const std::string& st, bool bias) {
  const std::string M = std::to_string(m), N = std::to_string(n), K = std::to_string(k);
  const std::string sg = st + "[" + N + ", " + std::to_string(k / g) + "]";
  std::string args = "%x: " + dt + "[" + M + ", " + K + "], %w: u8[" + N + ", " + std::to_string(k / 2) + "], %s: " + sg;
  std::string ops = "%x, %w, %s";
  if (asym) args += ", %z: " + sg, ops += ", %z";
  if (bias) args += ", %b: " + dt + "[" + N + "]", ops += ", %b";
  const std::string yt = dt + "[" + M + ", " + N + "]";
  return "graph @g(" + args + ") -> (" + yt + ") {\n  %y = matmul_int4(" + ops + ") {group_size = " + std::to_string(g) +
         (asym ? ", asymmetric = 1" : "") + "} : " + yt + "\n  return %y\n}\n";
}

TEST_CASE("matmul_int4: the streaming kernel for f16/bf16 x up to M = 64 (one launch at N = 8192)") {
  for (int64_t m : {1, 3, 4, 8, 16, 17, 33, 64}) {
    CAPTURE(m);
    const LoweredGraph l = lower_text(int4_graph(m, 8192, 8192, 128, false, "bf16", "f16", false));
    const std::vector<std::string> s = steps(l.plan);
    REQUIRE(s.size() == 1);
    CHECK(s[0].find("kernel=k0_matmul_int4_stream") != std::string::npos);
    // 64 rows a block -> 128 blocks, no K split. Up to M = 16 four K-warps (512 threads) with
    // KC 256. Up to M = 8 the block stages all of x at once (8 super-chunks of 1024), else two
    // buffers; a buffer holds KW x M rows of KC + 16, then one f32 correction per k-block
    // (KW KC / 128 of them) and padded column; above M = 8 off a multiple of 8, slack for the
    // last n8 tile's rows past M.
    const int64_t kc = m > 32 || m <= 16 ? 256 : 512, kw = m <= 16 ? 4 : 2, nb = m <= 8 ? 8 : 2;
    const int64_t mp = (m + 7) / 8 * 8, corr = nb * (kw * kc / 128) * mp * 4, slack = m > 8 ? (mp - m) * (kc + 16) * 2 : 0;
    const int64_t smem = std::max<int64_t>(nb * kw * m * (kc + 16) * 2 + corr, (kw - 1) * 2048 * ((m + 7) / 8)) + slack;
    CHECK(s[0].find("grid=128,1,1 block=" + std::to_string(128 * kw) + ",1,1 smem=" + std::to_string(smem) + " ") !=
          std::string::npos);
    CHECK(l.kernels == std::vector<std::string>{"k0_matmul_int4_stream"});
  }
}

TEST_CASE("matmul_int4: small N splits K across blocks (memset, stream, sum)") {
  // N = 4096: 64 blocks of rows, so K splits in two; K = 8192 holds 8 super-chunks of 1024.
  const std::vector<std::string> s = steps(lower_text(int4_graph(16, 4096, 8192, 64, true, "f16", "f16", true)).plan);
  REQUIRE(s.size() == 3);
  CHECK(s[0].find("step memset") != std::string::npos);
  CHECK(s[0].find("bytes=" + std::to_string(16 * 4096 * 4)) != std::string::npos);
  CHECK(s[1].find("kernel=k0_matmul_int4_stream grid=64,2,1") != std::string::npos);
  CHECK(s[2].find("kernel=k1_matmul_int4_splitk_sum") != std::string::npos);
  // N = 257 and K = 8192: 5 row blocks, K split into 8 (one super-chunk each).
  CHECK(steps(lower_text(int4_graph(1, 257, 8192, 32, false, "bf16", "bf16", false)).plan)[1].find("grid=5,8,1") !=
        std::string::npos);
  // K within one super-chunk never splits.
  CHECK(steps(lower_text(int4_graph(1, 257, 1024, 32, false, "bf16", "bf16", false)).plan).size() == 1);
}

TEST_CASE("matmul_int4: M = 5..16 on sm_90: 128-row blocks, K split in two, x staged once, halves meet as a cluster pair") {
  const LoweringOptions hopper = hopper_lowering();
  // The sm_90 default at M = 16: 8 N-warps x 2 K-warps, 128 rows a block, 64 blocks of rows, so
  // K splits in two; each half of x (8 super-chunks of 512) is staged once: 8 x 2 x 16 x
  // (256 + 16) x 2 bytes, then the corrections (8 x 4 k-blocks x 16 columns x 4 bytes).
  const std::string g16 = int4_graph(16, 8192, 8192, 128, false, "bf16", "f16", true);
  const LoweredGraph pair = lower_text(g16, hopper);
  const int64_t x_and_corr = 8 * 2 * 16 * 272 * 2 + 8 * 4 * 16 * 4;
  // The pair: one launch, the second block's sums (8 N-warps x 2 tiles x 4 x 32 floats) after x.
  const std::vector<std::string> s = steps(pair.plan);
  REQUIRE(s.size() == 1);
  CHECK(s[0].find("grid=64,2,1 block=512,1,1 smem=" + std::to_string(x_and_corr + 8 * 2 * 512) + " ") != std::string::npos);
  CHECK(pair.source.find("KILN_I4_PAIR_DIMS __launch_bounds__") != std::string::npos);
  CHECK(pair.source.find("constexpr bool PAIR = true;") != std::string::npos);
  CHECK(pair.source.find("constexpr bool XALL = true;") != std::string::npos);
  CHECK(pair.source.find("constexpr int MT = 1, NW = 8, KW = 2,") != std::string::npos);
  compiles_everywhere(pair);
  // The same shape from M = 5 (two super-chunks in flight up to M = 8); M <= 4 keeps 64-row
  // blocks without the split.
  for (int64_t m : {4, 5, 8}) {
    CAPTURE(m);
    const std::vector<std::string> t = steps(lower_text(int4_graph(m, 8192, 8192, 128, false, "bf16", "f16", false), hopper).plan);
    REQUIRE(t.size() == 1);
    CHECK(t[0].find(m > 4 ? "grid=64,2,1 block=512,1,1" : "grid=128,1,1 block=512,1,1") != std::string::npos);
  }
  // Without clusters (sm_80 plans: 64-row blocks of 4 x 4 warps, so K splits in two at N = 4096,
  // each half of x staged once): memset, the stream kernel, the sum.
  const LoweredGraph ampere =
      lower_text(int4_graph(16, 4096, 8192, 128, false, "bf16", "f16", true));
  const std::vector<std::string> t = steps(ampere.plan);
  REQUIRE(t.size() == 3);
  CHECK(t[1].find("grid=64,2,1 block=512,1,1 smem=" +
                  std::to_string(4 * 4 * 16 * 272 * 2 + 4 * 8 * 16 * 4) + " ") !=
        std::string::npos);
  CHECK(ampere.source.find("constexpr bool PAIR = false;") != std::string::npos);
  CHECK(ampere.source.find("KILN_I4_PAIR_DIMS __launch_bounds__") == std::string::npos);
  compiles_everywhere(ampere);
}

namespace {
/// matmul_int4 over 8192² weights with bias (scales in x's type, f16 x with f16 scales), lowered
/// with `o` (default: the cuda-sm90 plugin's options).
LoweredGraph lower_int4(int64_t m, int64_t g, bool asym, const std::string& dt,
                        const LoweringOptions& o = hopper_lowering()) {
  return lower_text(int4_graph(m, 8192, 8192, g, asym, dt, dt == "f16" ? "f16" : "bf16", true), o);
}
}  // namespace

TEST_CASE("matmul_int4: above M = 16 on sm_90: two row tiles per warp, K split in two as a cluster pair, pairs scaled before the mma") {
  const LoweringOptions hopper = hopper_lowering();
  // M = 64, group 128 symmetric bf16: 4 N-warps x 2 tiles x 16 rows = 128 rows a block, 64 blocks
  // of rows, so K splits in two (8 super-chunks of 512 each). Two x buffers of 2 K-warps x 64 x
  // (256 + 16) x 2 bytes, the corrections (2 x 4 k-blocks x 64 columns x 4 bytes), then the
  // second block's sums (4 N-warps x 2 tiles x 8 n8 tiles x 512 bytes).
  const LoweredGraph post64 = lower_text(int4_graph(64, 8192, 8192, 128, false, "bf16", "f16", false), hopper);
  const int64_t x_and_corr = 2 * 2 * 64 * 272 * 2 + 2 * 4 * 64 * 4;
  std::vector<std::string> s = steps(post64.plan);
  REQUIRE(s.size() == 1);
  CHECK(s[0].find("grid=64,2,1 block=256,1,1 smem=" + std::to_string(x_and_corr + 4 * 2 * 8 * 512) + " ") != std::string::npos);
  CHECK(post64.source.find("constexpr int MT = 2, NW = 4, KW = 2,") != std::string::npos);
  CHECK(post64.source.find("constexpr bool POST = false, ASYM = false, AZFMA = false;") != std::string::npos);
  CHECK(post64.source.find("constexpr bool PAIR = true;") != std::string::npos);
  // M = 17, asymmetric f16 group 32: the same shape, three n8 tiles (rows padded to 24, 7 rows of
  // slack for the last tile).
  const LoweredGraph asym17 = lower_text(int4_graph(17, 8192, 8192, 32, true, "f16", "f16", true), hopper);
  s = steps(asym17.plan);
  REQUIRE(s.size() == 1);
  CHECK(s[0].find("grid=64,2,1 block=256,1,1 smem=" + std::to_string(2 * 2 * 17 * 272 * 2 + 2 * 4 * 24 * 4 + 7 * 272 * 2 + 4 * 2 * 3 * 512) + " ") !=
        std::string::npos);
  // sm_80 plans keep one tile, and post-scale it.
  const LoweredGraph one = lower_text(int4_graph(64, 8192, 8192, 128, false, "bf16", "f16", false));
  CHECK(one.source.find("constexpr int MT = 1, NW = 4, KW = 2,") != std::string::npos);
  CHECK(one.source.find("constexpr bool POST = true, ASYM = false, AZFMA = false;") !=
        std::string::npos);
  for (const LoweredGraph* l : {&post64, &asym17, &one}) compiles_everywhere(*l);
}

TEST_CASE("matmul_int4: up to M = 16 x is reordered and staged before the weights; above, read as stored") {
  // M = 1: folded, post-scaled bf16; M = 13: asymmetric f16 in the cluster pair; M = 16: the last
  // reordered; M = 17 and 64: post-scaled, x per super-chunk; M = 33: asymmetric f16.
  struct Case {
    int64_t m, g;
    bool asym;
    const char* dt;
  };
  for (const Case c : {Case{1, 128, false, "bf16"}, Case{13, 64, true, "f16"}, Case{16, 128, false, "bf16"},
                       Case{17, 128, false, "bf16"}, Case{33, 32, true, "f16"}, Case{64, 128, false, "bf16"}}) {
    CAPTURE(c.m);
    const LoweredGraph l = lower_int4(c.m, c.g, c.asym, c.dt);
    const bool small = c.m <= 16;
    CHECK(l.source.find(std::string("constexpr bool PERM = ") + (small ? "true" : "false") + ", NAT = !PERM;") !=
          std::string::npos);
    CHECK(l.source.find(std::string("constexpr bool XALL = ") + (small ? "true" : "false") + ";") !=
          std::string::npos);
    compiles_everywhere(l);
  }
}

TEST_CASE("matmul_int4: above M = 8 off a multiple of 8, the last n8 tile of x is read without a row test, with slack past the buffers") {
  const LoweringOptions hopper = hopper_lowering();
  const LoweredGraph m12 = lower_text(int4_graph(12, 8192, 8192, 128, false, "bf16", "f16", false), hopper),
                     asym33 = lower_int4(33, 32, true, "f16"), m16 = lower_int4(16, 128, false, "bf16"),
                     m5 = lower_text(int4_graph(5, 8192, 8192, 128, false, "bf16", "f16", false), hopper);
  CHECK(m12.source.find("constexpr bool XROWS = true;") != std::string::npos);
  CHECK(asym33.source.find("constexpr bool XROWS = true;") != std::string::npos);
  CHECK(m16.source.find("constexpr bool XROWS = false;") != std::string::npos);  // whole tiles: nothing to do
  CHECK(m5.source.find("constexpr bool XROWS = false;") != std::string::npos);   // one tile: the row test stays
  // M = 12 on sm_90: x and corrections (8 x 2 x 12 x 272 x 2 + 8 x 4 x 16 x 4 bytes), 4 rows of
  // slack (4 x 272 x 2), then the second block's sums (8 N-warps x 2 tiles x 512).
  const int64_t x_and_corr = 8 * 2 * 12 * 272 * 2 + 8 * 4 * 16 * 4;
  CHECK(steps(m12.plan)[0].find("smem=" + std::to_string(x_and_corr + 4 * 272 * 2 + 8 * 2 * 512) + " ") != std::string::npos);
  for (const LoweredGraph* l : {&m12, &asym33}) compiles_everywhere(*l);
}

TEST_CASE("matmul_int4: group 128 symmetric is post-scaled up to M = 8 on sm_90 (up to 16 on sm_80), else scaled per pair") {
  auto post = [&](int64_t m, int64_t g, const LoweringOptions& o) {
    const LoweredGraph l = lower_int4(m, g, false, "bf16", o);
    const bool on = l.source.find("constexpr bool POST = true,") != std::string::npos;
    CHECK((on || l.source.find("constexpr bool POST = false,") != std::string::npos));
    return on;
  };
  const LoweringOptions hopper = hopper_lowering(), ampere{};
  for (int64_t m : {1, 4, 8}) CHECK(post(m, 128, hopper));
  for (int64_t m : {9, 12, 16, 17, 64}) CHECK_FALSE(post(m, 128, hopper));
  CHECK(post(16, 128, ampere));
  CHECK_FALSE(post(1, 64, hopper));  // a k-block spans two groups
  CHECK(post(64, 128, ampere));  // one row tile per warp there
  compiles_everywhere(lower_int4(12, 128, false, "f16", ampere));  // post-scaled with two n8 tiles
}

TEST_CASE("matmul_int4: symmetric group 128 reads a lane's two scales of a super-chunk as one 4-byte load on sm_90 at M = 17..48") {
  const LoweringOptions hopper = hopper_lowering();
  auto spair = [&](int64_t m, int64_t n, int64_t k, int64_t g, bool asym, const char* st, const LoweringOptions& o) {
    const LoweredGraph l = lower_text(int4_graph(m, n, k, g, asym, "bf16", st, false), o);
    const bool on = l.source.find("constexpr bool SPAIR = true;") != std::string::npos;
    CHECK((on || l.source.find("constexpr bool SPAIR = false;") != std::string::npos));
    if (on) compiles_everywhere(l);
    return on;
  };
  CHECK(spair(24, 8192, 8192, 128, false, "bf16", hopper));
  CHECK(spair(48, 8192, 8192, 128, false, "f16", hopper));
  CHECK(spair(24, 1000, 2048, 128, false, "f16", hopper));
  CHECK_FALSE(spair(1, 8192, 8192, 128, false, "f16", hopper));    // measured slower at M <= 16
  CHECK_FALSE(spair(16, 8192, 8192, 128, false, "bf16", hopper));
  CHECK_FALSE(spair(64, 8192, 8192, 128, false, "bf16", hopper));  // and at M = 64
  CHECK_FALSE(spair(32, 8192, 7936, 128, false, "f16", hopper));   // K ends inside a super-chunk
  CHECK_FALSE(spair(32, 8192, 8192, 64, false, "f16", hopper));    // two groups per super-chunk part
  CHECK_FALSE(spair(32, 8192, 8192, 128, true, "f16", hopper));    // zero points
  CHECK_FALSE(
      spair(32, 8192, 8192, 128, false, "f16", LoweringOptions{}));  // sm_80 plans: unmeasured
}

TEST_CASE("matmul_int4: asymmetric pairs are one fma except in the sm_90 plans at M = 9..16 and group 64 above M = 32") {
  auto azfma = [&](int64_t m, int64_t g, bool asym, const LoweringOptions& o) {
    const LoweredGraph l = lower_int4(m, g, asym, "bf16", o);
    const bool on = l.source.find("ASYM = true, AZFMA = true;") != std::string::npos;
    CHECK((on || l.source.find(asym ? "ASYM = true, AZFMA = false;" : "ASYM = false, AZFMA = false;") != std::string::npos));
    return on;
  };
  const LoweringOptions hopper = hopper_lowering(), ampere{};
  for (int64_t m : {1, 8, 17, 64}) CHECK(azfma(m, 32, true, hopper));
  for (int64_t m : {9, 16}) CHECK_FALSE(azfma(m, 64, true, hopper));
  CHECK(azfma(32, 64, true, hopper));
  CHECK_FALSE(azfma(48, 64, true, hopper));  // group 64 above M = 32
  CHECK(azfma(48, 32, true, hopper));
  CHECK(azfma(16, 64, true, ampere));  // the sm_80 plan at M = 16 differs
  CHECK_FALSE(azfma(1, 32, false, hopper));  // no zero points
  // int4-exact-zeros: the subtraction everywhere.
  LoweringOptions exact = hopper, exact_ampere = ampere;
  exact.int4_exact_zeros = exact_ampere.int4_exact_zeros = true;
  for (int64_t m : {1, 8, 17, 64}) CHECK_FALSE(azfma(m, 32, true, exact));
  CHECK_FALSE(azfma(16, 64, true, exact_ampere));
  compiles_everywhere(lower_int4(1, 32, true, "f16", hopper));
  compiles_everywhere(lower_int4(64, 32, true, "f16", exact));
}

/// The weights-section (offset, bytes) of the plan's weight buffers, in buffer order.
std::vector<std::pair<int64_t, int64_t>> weight_places(const LoweredGraph& l) {
  std::vector<std::pair<int64_t, int64_t>> out;
  std::istringstream in(l.plan);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("buffer ", 0) != 0 || line.find(" kind=weight ") == std::string::npos) continue;
    out.emplace_back(std::stoll(line.substr(line.find(" offset=") + 8)), std::stoll(line.substr(line.find(" bytes=") + 7)));
  }
  return out;
}

TEST_CASE("matmul_int4: constant asymmetric scales and zeros are packed; a constant weight one node reads is reordered above M = 16") {
  const LoweringOptions hopper = hopper_lowering();
  const int64_t n = 257, k = 1280, g = 32;
  auto lower = [&](int64_t m, bool asym, bool shared = false) {
    return lower_text(int4_const_graph(m, n, k, g, asym, "bf16", false, 5, shared), hopper);
  };
  auto has = [](const LoweredGraph& l, const char* what) { return l.source.find(what) != std::string::npos; };
  const LoweredGraph l64 = lower(64, true);
  CHECK(has(l64, "SZP = true;"));
  CHECK(has(l64, "WPRE = true;"));
  CHECK(has(lower(16, true), "SZP = true;"));
  CHECK(has(lower(16, true), "WPRE = false;"));  // x reordered instead up to M = 16
  CHECK(has(lower(33, true, true), "WPRE = false;"));  // a second node reads the weights
  CHECK(has(lower(33, true, true), "SZP = true;"));
  CHECK(has(lower(64, false), "SZP = false;"));
  CHECK(has(lower_int4(64, 32, true, "bf16"), "SZP = false;"));  // scales and zeros as inputs
  CHECK(has(lower_int4(64, 32, true, "bf16"), "WPRE = false;"));
  // int4-exact-zeros packs nothing (the pairs are the fma form's); the weights are still
  // reordered above M = 16, and at M = 16 they stay as stored.
  LoweringOptions exact = hopper;
  exact.int4_exact_zeros = true;
  const LoweredGraph exact64 =
      lower_text(int4_const_graph(64, n, k, g, true, "bf16", false, 5), exact);
  const LoweredGraph plain =
      lower_text(int4_const_graph(16, n, k, g, true, "bf16", false, 5), exact);
  CHECK(has(exact64, "SZP = false;"));
  CHECK(has(exact64, "WPRE = true;"));
  CHECK(has(exact64, "ASYM = true, AZFMA = false;"));
  CHECK(has(plain, "SZP = false;"));
  CHECK(has(plain, "WPRE = false;"));
  CHECK(weight_places(exact64).size() == 3);
  CHECK(weight_places(exact64)[1].second == n * (k / g) * 2);  // the scales as stored
  compiles_everywhere(exact64);

  // Weight buffers: w (reordered), s and z (left out: no step reads them) and, packed, (s, -z·s)
  // per group; with exact zeros at M = 16, w, s, z as stored.
  const auto at = weight_places(l64), at_plain = weight_places(plain);
  REQUIRE(at.size() == 4);
  REQUIRE(at_plain.size() == 3);
  CHECK(at[1].second == 0);
  CHECK(at[2].second == 0);
  CHECK(at[3].second == n * (k / g) * 4);
  CHECK(static_cast<int64_t>(l64.weights.size()) == at[3].first + at[3].second);
  auto bytes = [](const LoweredGraph& l, int64_t off) { return reinterpret_cast<const unsigned char*>(l.weights.data()) + off; };
  const unsigned char* w = bytes(l64, at[0].first);
  const unsigned char* w0 = bytes(plain, at_plain[0].first);
  int wrong = 0;
  for (int64_t i = 0; i < n * k / 2; i += 4) {
    uint32_t a = 0, b = 0;
    std::memcpy(&a, w0 + i, 4);
    std::memcpy(&b, w + i, 4);
    for (int v = 0; v < 8; ++v) {  // value v: nibble v as stored; nibble v / 2 (+ 4 when odd) reordered
      const int to = v / 2 + (v % 2 ? 4 : 0);
      wrong += ((a >> (4 * v)) & 15u) != ((b >> (4 * to)) & 15u);
    }
  }
  CHECK(wrong == 0);
  int bad_pairs = 0;
  for (int64_t i = 0; i < n * (k / g); ++i) {
    uint16_t sb = 0, zb = 0, ps = 0, pz = 0;
    std::memcpy(&sb, bytes(plain, at_plain[1].first + 2 * i), 2);
    std::memcpy(&zb, bytes(plain, at_plain[2].first + 2 * i), 2);
    std::memcpy(&ps, bytes(l64, at[3].first + 4 * i), 2);
    std::memcpy(&pz, bytes(l64, at[3].first + 4 * i + 2), 2);
    const float sv = bf16_bits_to_f32(sb), zv = bf16_bits_to_f32(zb);
    bad_pairs += ps != sb || pz != f64_to_bf16_bits(-zv * sv);
  }
  CHECK(bad_pairs == 0);
  compiles_everywhere(l64);
  compiles_everywhere(lower(12, true));
}

TEST_CASE(
    "matmul_int4: the backend option int4-exact-zeros is declared, validated, and changes the "
    "kernels and their cache key") {
  Registry r;
  Capabilities caps;
  caps.plugin = "cuda-sm90";  // the Hopper plan
  caps.targets = {"sm_90a"};
  caps.max_smem_per_block = 232448;
  REQUIRE(register_backend(r, caps).ok());
  auto info = r.backend("cuda-sm90");
  REQUIRE(info.ok());
  const auto spec = std::find_if((*info)->options.begin(), (*info)->options.end(),
                                 [](const OptionSpec& o) { return o.name == "int4-exact-zeros"; });
  REQUIRE(spec != (*info)->options.end());
  CHECK(spec->type == OptionType::kBool);
  CHECK(spec->default_value == OptionValue(false));
  CHECK(spec->help.find("bench/results/") != std::string::npos);  // says why it exists
  auto bad = resolve_options((*info)->options, {{"int4-exact-zeros", std::string("yes")}},
                             "backend 'cuda-sm90'");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message() ==
        "option 'int4-exact-zeros' for backend 'cuda-sm90' expects bool, got string \"yes\"");

  // The backend's artifact source with and without it: asymmetric weights change, symmetric ones
  // do not.
  auto source = [&](bool exact, bool asym) {
    auto o =
        resolve_options((*info)->options, {{"int4-exact-zeros", exact}}, "backend 'cuda-sm90'");
    REQUIRE(o.ok());
    auto backend = (*info)->create(*o);
    REQUIRE(backend.ok());
    auto g = parse_graph(int4_graph(1, 37, 256, 64, asym, "bf16", "bf16", true));
    REQUIRE(g.ok());
    ArtifactContents art;
    REQUIRE((*backend)->build_artifact(**g, {"sm_90a"}, art).ok());
    return art.sources.at("sm_90a");
  };
  const std::string fma = source(false, true), exact = source(true, true);
  CHECK(fma.find("constexpr bool POST = false, ASYM = true, AZFMA = true;") != std::string::npos);
  CHECK(exact.find("constexpr bool POST = false, ASYM = true, AZFMA = false;") !=
        std::string::npos);
  CHECK(nvrtc_cache_key(fma, "sm_90a", "cuda-sm90@0.1.0").digest() !=
        nvrtc_cache_key(exact, "sm_90a", "cuda-sm90@0.1.0").digest());
  CHECK(source(true, false) == source(false, false));
}

TEST_CASE("an artifact for several generations compiles every image from the plan's own lowering") {
  // At M = 16 the cuda-sm80 and cuda-sm90 plans launch the stream kernel with different shapes
  // (64 rows of 4 x 4 warps; 128 rows of 8 x 2 warps as cluster pairs): the sm_90a image of an
  // sm_80-first artifact must hold the sm_80 plan's kernel, and the other way round.
  Registry r;
  for (const auto& [plugin, target, smem] :
       {std::tuple{"cuda-sm80", "sm_80", 166912}, {"cuda-sm90", "sm_90a", 232448}}) {
    Capabilities caps;
    caps.plugin = plugin;
    caps.targets = {target};
    caps.max_smem_per_block = smem;
    REQUIRE(register_backend(r, caps).ok());
  }
  auto g = parse_graph(int4_graph(16, 8192, 8192, 128, false, "bf16", "bf16", false));
  REQUIRE(g.ok());
  auto build = [&](std::vector<std::pair<std::string, std::string>> order) {
    ArtifactContents art;
    for (const auto& [plugin, target] : order) {
      auto info = r.backend(plugin);
      REQUIRE(info.ok());
      auto o = resolve_options((*info)->options, {}, plugin);
      REQUIRE(o.ok());
      auto backend = (*info)->create(*o);
      REQUIRE(backend.ok());
      Status s = (*backend)->build_artifact(**g, {target}, art);
      REQUIRE_MESSAGE(s.ok(), s.message());
    }
    return art;
  };
  const ArtifactContents ampere_first = build({{"cuda-sm80", "sm_80"}, {"cuda-sm90", "sm_90a"}});
  CHECK(ampere_first.meta.at("cuda_plan") == "cuda-sm80 smem=166912");
  CHECK(ampere_first.sources.at("sm_90a") == ampere_first.sources.at("sm_80"));
  CHECK(ampere_first.sources.at("sm_90a").find("constexpr int MT = 1, NW = 4, KW = 4,") !=
        std::string::npos);
  CHECK(steps(ampere_first.plan)[0].find("grid=128,1,1 block=512,1,1") != std::string::npos);
  const ArtifactContents hopper_first = build({{"cuda-sm90", "sm_90a"}, {"cuda-sm80", "sm_80"}});
  CHECK(hopper_first.meta.at("cuda_plan") == "cuda-sm90 smem=232448");
  CHECK(hopper_first.sources.at("sm_80").find("constexpr int MT = 1, NW = 8, KW = 2,") !=
        std::string::npos);
  CHECK(steps(hopper_first.plan)[0].find("grid=64,2,1 block=512,1,1") != std::string::npos);
}

TEST_CASE("matmul_int4: f32 x takes the GEMV up to M = 8, dequantize + gemm above M = 64") {
  for (int64_t m : {1, 8}) {
    CAPTURE(m);
    const LoweredGraph l = lower_text(int4_graph(m, 8192, 8192, 128, false, "f32", "f16", false));
    const std::vector<std::string> s = steps(l.plan);
    REQUIRE(s.size() == 1);
    CHECK(s[0].find("kernel=k0_matmul_int4_gemv") != std::string::npos);
  }
  // GEMV: 4 rows per warp, 8 warps per block at N = 8192 -> 256 blocks; x staged per 1024 k.
  CHECK(steps(lower_text(int4_graph(1, 8192, 8192, 128, false, "f32", "f16", false)).plan)[0].find(
            "grid=256,1,1 block=256,1,1 smem=4608") != std::string::npos);
  CHECK(steps(lower_text(int4_graph(9, 64, 256, 64, false, "f32", "f16", false)).plan)[0].find("kernel=k0_int4_dequantize") !=
        std::string::npos);
  const LoweredGraph big = lower_text(int4_graph(65, 64, 256, 64, true, "f16", "f16", true));
  const std::vector<std::string> s = steps(big.plan);
  REQUIRE(s.size() == 2);
  CHECK(s[0].find("kernel=k0_int4_dequantize") != std::string::npos);
  CHECK(s[1].find("step gemm") != std::string::npos);
  CHECK(s[1].find("m=65 n=64 k=256") != std::string::npos);
  CHECK(s[1].find("trans_b=1") != std::string::npos);
  CHECK(s[1].find("epilogue=bias") != std::string::npos);
}

TEST_CASE("matmul_int4: every kernel variant compiles for sm_80, sm_90a and sm_100a") {
  std::string text;
  // One graph holding all variants: stream (both KC, split or not, post-scaled or not) / GEMV /
  // dequantize, bf16 / f16 / f32 x, sym / asym, bf16 / f16 scales, with and without bias, odd N.
  auto g = parse_graph(R"(graph @g(%x1: bf16[1, 256], %x2: f16[16, 256], %x3: f32[5, 256], %x4: bf16[100, 256], %w: u8[37, 128], %s: f16[37, 2], %z: f16[37, 4], %t: bf16[37, 8], %bb: bf16[37], %hb: f16[37], %xl: bf16[3, 4096], %wl: u8[37, 2048], %sl: f16[37, 32], %xm: f16[40, 256]) -> (bf16[1, 37], f16[16, 37], f32[5, 37], bf16[100, 37], bf16[33, 37], bf16[3, 37], f16[40, 37]) {
  %a = matmul_int4(%x1, %w, %s, %bb) {group_size = 128} : bf16[1, 37]
  %b = matmul_int4(%x2, %w, %z, %z, %hb) {group_size = 64, asymmetric = 1} : f16[16, 37]
  %c = matmul_int4(%x3, %w, %t) {group_size = 32} : f32[5, 37]
  %d = matmul_int4(%x4, %w, %t, %t) {group_size = 32, asymmetric = 1} : bf16[100, 37]
  %e = slice(%x4) {starts = [0], ends = [33], axes = [0]} : bf16[33, 256]
  %f = matmul_int4(%e, %w, %t, %bb) {group_size = 32} : bf16[33, 37]
  %h = matmul_int4(%xl, %wl, %sl, %bb) {group_size = 128} : bf16[3, 37]
  %i = matmul_int4(%xm, %w, %z, %z) {group_size = 64, asymmetric = 1} : f16[40, 37]
  return %a, %b, %c, %d, %f, %h, %i
})");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  // stream (post-scaled), stream (asym), gemv, dequantize, slice, stream (KC 256),
  // stream split four ways + its sum, stream (asym, KC 256).
  CHECK(l->kernels.size() == 9);
  compiles_everywhere(*l);
}

TEST_CASE("matmul_int4: a graph with f16 only compiles (the helpers need both half headers)") {
  // A regression test: the shared helpers also spell bf16, so an f16-only source must still
  // include cuda_bf16.h.
  auto g = parse_graph(R"(graph @g(%x: f16[16, 256], %w: u8[37, 128], %s: f16[37, 2], %hb: f16[37]) -> (f16[16, 37]) {
  %y = matmul_int4(%x, %w, %s, %hb) {group_size = 128} : f16[16, 37]
  return %y
})");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  auto l = lower_graph(**g);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  auto cubin = compile_cuda(l->source, "sm_90a", "test@0");
  REQUIRE_MESSAGE(cubin.ok(), std::string(cubin.status().message()));
}

}  // namespace
}  // namespace kiln::cuda
