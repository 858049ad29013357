// A graph both state tests use: the lowering test checks which assigns are written in place,
// the GPU test checks the updates against the reference over several runs.
#pragma once

#include <string>

namespace kiln {

/// An optimizer-like update over f32[n]: m's new value by a kernel that does not read m (m's
/// last reader is the kernel before it), w's by a kernel reading w at the elements it writes,
/// and u read again after its update. Returns %g (the old w times x) and %y (the old u times x).
/// Every update moves the state even when x is zero (m by a constant step): a run that is not
/// supposed to count, such as the runtime's warm-up before graph capture, shows in the next
/// run's outputs unless its updates are undone.
inline std::string in_place_update_graph(int n) {
  const std::string t = "f32[" + std::to_string(n) + "]";
  auto splat = [&](const std::string& v) {
    std::string s = "dense<" + t + ">[";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + v;
    return s + "]";
  };
  return "graph @step(%x: " + t + ") -> (" + t + ", " + t + ") {\n"
         "  %w = variable() {init = " + splat("0.5") + ", name = \"w\"} : " + t + "\n"
         "  %m = variable() {init = " + splat("0.0") + ", name = \"m\"} : " + t + "\n"
         "  %u = variable() {init = " + splat("1.0") + ", name = \"u\"} : " + t + "\n"
         "  %g = mul(%w, %x) : " + t + "\n"
         "  %c = constant() {value = dense<f32[]>[0.9]} : f32[]\n"
         "  %m1 = mul(%m, %c) : " + t + "\n"
         "  %k = constant() {value = dense<f32[]>[0.25]} : f32[]\n"
         "  %g1 = add(%g, %k) : " + t + "\n"
         "  %m2 = add(%m1, %g1) : " + t + "\n"
         "  assign(%m2) {name = \"m\"}\n"
         "  %lr = constant() {value = dense<f32[]>[0.1]} : f32[]\n"
         "  %s = mul(%m2, %lr) : " + t + "\n"
         "  %w2 = sub(%w, %s) : " + t + "\n"
         "  assign(%w2) {name = \"w\"}\n"
         "  %x1 = add(%x, %k) : " + t + "\n"
         "  %u2 = add(%u, %x1) : " + t + "\n"
         "  assign(%u2) {name = \"u\"}\n"
         "  %y = mul(%u, %x) : " + t + "\n"
         "  return %g, %y\n}\n";
}

}  // namespace kiln
