// A one-node matmul_int4 graph whose weights, scales and zeros are constants (as the INT4
// quantizer leaves them), for the lowering's compile-time packing and reordering paths.
#pragma once

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>

namespace kiln {

/// x dt[m, k] (and bias dt[n] when `bias`) are inputs; w u8[n, k/2] holds random bytes, the
/// scales dt[n, k/g] random values exact in f16 and bf16 ((1 + r/64)·2^-7, r in 0..63) and the
/// zeros (asymmetric) integers 0..15, all drawn from `seed`. `shared_weights` adds a second
/// matmul_int4 of another input %x2 on the same constants (the graph then returns both products).
inline std::string int4_const_graph(int64_t m, int64_t n, int64_t k, int64_t g, bool asym, const std::string& dt,
                                    bool bias, uint64_t seed, bool shared_weights = false) {
  std::mt19937_64 rng(seed);
  auto list = [&](int64_t count, auto value) {
    std::string s;
    s.reserve(static_cast<size_t>(count) * 6);
    char buf[32];
    for (int64_t i = 0; i < count; ++i) {
      std::snprintf(buf, sizeof buf, i == 0 ? "%s" : ", %s", value().c_str());
      s += buf;
    }
    return s;
  };
  auto byte = [&] { return std::to_string(rng() % 256); };
  auto scale = [&] {
    char b[32];
    std::snprintf(b, sizeof b, "%.9g", (1.0 + static_cast<double>(rng() % 64) / 64.0) / 128.0);
    return std::string(b);
  };
  auto zero = [&] { return std::to_string(rng() % 16) + ".0"; };
  const std::string M = std::to_string(m), N = std::to_string(n), K = std::to_string(k), KG = std::to_string(k / g);
  const std::string wt = "u8[" + N + ", " + std::to_string(k / 2) + "]", st = dt + "[" + N + ", " + KG + "]";
  const std::string yt = dt + "[" + M + ", " + N + "]";
  std::string args = "%x: " + dt + "[" + M + ", " + K + "]";
  if (shared_weights) args += ", %x2: " + dt + "[" + M + ", " + K + "]";
  if (bias) args += ", %b: " + dt + "[" + N + "]";
  std::string body = "  %w = constant() {value = dense<" + wt + ">[" + list(n * k / 2, byte) + "]} : " + wt + "\n";
  body += "  %s = constant() {value = dense<" + st + ">[" + list(n * (k / g), scale) + "]} : " + st + "\n";
  std::string ops = "%x, %w, %s";
  if (asym) {
    body += "  %z = constant() {value = dense<" + st + ">[" + list(n * (k / g), zero) + "]} : " + st + "\n";
    ops += ", %z";
  }
  if (bias) ops += ", %b";
  const std::string attrs = "{group_size = " + std::to_string(g) + (asym ? ", asymmetric = 1" : "") + "}";
  body += "  %y = matmul_int4(" + ops + ") " + attrs + " : " + yt + "\n";
  if (!shared_weights)
    return "graph @g(" + args + ") -> (" + yt + ") {\n" + body + "  return %y\n}\n";
  body += "  %y2 = matmul_int4(%x2" + ops.substr(2) + ") " + attrs + " : " + yt + "\n";
  return "graph @g(" + args + ") -> (" + yt + ", " + yt + ") {\n" + body + "  return %y, %y2\n}\n";
}

}  // namespace kiln
