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


/// FP8 delayed scaling with a just-in-time first step, as fp8-training builds it (after
/// fuse-pointwise): y = 3 x in a fused group that also reduces amax(y) and stores y quantized
/// with its delayed scale; a weight variable w (growing 1.5x a run) read by a standalone amax and
/// quantize; each then requantized with the scale the run uses (its own amax's while its history
/// is empty, else the delayed one). Returns both f8 tensors and both amaxes. With `ops` the state
/// is the ops fp8-training builds (delayed_scaling_step_scale, delayed_scaling_update), whose
/// step scale also checks that the amax is finite and positive, else the core ops they stand for.
inline std::string jit_delayed_quantize_graph(bool ops = false) {
  std::string w = "dense<f32[32, 256]>[";
  for (int i = 0; i < 32 * 256; ++i) w += (i ? ", " : "") + std::to_string(((i * 37) % 101 - 50) * 0.004);
  w += "]";
  auto state = [ops](const std::string& t, const std::string& a, const std::string& x) {
    // t's history roll, next scale and the scale this run uses (`t`.now); x its tensor, a its amax.
    if (ops)
      return "  %" + t + ".now = delayed_scaling_step_scale(%" + a + ", %" + t + ".hist, %" + t +
             ".scale) {dtype = f8e4m3fn, margin = 0} : f32[]\n"
             "  %" + t + ".q = requantize(%" + x + ", %" + t + ".qd, %" + t + ".scale, %" + t + ".now) : f8e4m3fn\n"
             "  %" + t + ".h2, %" + t + ".s2 = delayed_scaling_update(%" + a + ", %" + t + ".hist, %" + t +
             ".scale) {algorithm = \"max\", dtype = f8e4m3fn, margin = 0} : f32[4], f32[]\n"
             "  assign(%" + t + ".h2) {name = \"" + t + ".hist\"}\n"
             "  assign(%" + t + ".s2) {name = \"" + t + ".scale\"}\n";
    return "  %" + t + ".seen = reduce_max(%" + t + ".hist) {keepdims = 0} : f32[]\n"
           "  %" + t + ".warm = greater(%" + t + ".seen, %zero) : bool[]\n"
           "  %" + t + ".own = mul(%" + a + ", %factor) : f32[]\n"
           "  %" + t + ".now = where(%" + t + ".warm, %" + t + ".scale, %" + t + ".own) : f32[]\n"
           "  %" + t + ".q = requantize(%" + x + ", %" + t + ".qd, %" + t + ".scale, %" + t + ".now) : f8e4m3fn\n"
           "  %" + t + ".r = reshape(%" + a + ") {shape = [1]} : f32[1]\n"
           "  %" + t + ".k = slice(%" + t + ".hist) {starts = [0], ends = [3]} : f32[3]\n"
           "  %" + t + ".h2 = concat(%" + t + ".r, %" + t + ".k) {axis = 0} : f32[4]\n"
           "  assign(%" + t + ".h2) {name = \"" + t + ".hist\"}\n"
           "  %" + t + ".m = reduce_max(%" + t + ".h2) {keepdims = 0} : f32[]\n"
           "  %" + t + ".s2 = mul(%" + t + ".m, %factor) : f32[]\n"
           "  assign(%" + t + ".s2) {name = \"" + t + ".scale\"}\n";
  };
  auto vars = [](const std::string& t) {
    return "  %" + t + ".scale = variable() {init = dense<f32[]>[1.0], name = \"" + t + ".scale\"} : f32[]\n"
           "  %" + t + ".hist = variable() {init = dense<f32[4]>[0.0, 0.0, 0.0, 0.0], name = \"" + t + ".hist\"} : f32[4]\n";
  };
  std::string y = state("y", "y.amax", "y"), ws = state("w", "w.amax", "w");
  y.replace(y.find(": f8e4m3fn\n"), 11, ": f8e4m3fn[64, 256]\n");
  ws.replace(ws.find(": f8e4m3fn\n"), 11, ": f8e4m3fn[32, 256]\n");
  return "graph @jit(%x: f32[64, 256]) -> (f8e4m3fn[64, 256], f8e4m3fn[32, 256], f32[], f32[]) {\n"
         "  %w = variable() {init = " + w + ", name = \"w\"} : f32[32, 256]\n" + vars("y") + vars("w") +
         "  %factor = constant() {value = dense<f32[]>[0.002232142857142857]} : f32[]\n"
         "  %zero = constant() {value = dense<f32[]>[0.0]} : f32[]\n"
         "  %grow = constant() {value = dense<f32[]>[1.5]} : f32[]\n"
         "  %y, %y.amax, %y.qd = fused(%x, %y.scale) : f32[64, 256], f32[], f8e4m3fn[64, 256] {\n"
         "    graph @fused(%x: f32[64, 256], %s: f32[]) -> (f32[64, 256], f32[], f8e4m3fn[64, 256]) {\n"
         "      %c = constant() {value = dense<f32[]>[3.0]} : f32[]\n"
         "      %y = mul(%x, %c) : f32[64, 256]\n"
         "      %a = amax(%y) : f32[]\n"
         "      %q = quantize(%y, %s) {dtype = f8e4m3fn} : f8e4m3fn[64, 256]\n"
         "      return %y, %a, %q\n"
         "    }\n"
         "  }\n" + y +
         "  %w.amax = amax(%w) : f32[]\n"
         "  %w.qd = quantize(%w, %w.scale) {dtype = f8e4m3fn} : f8e4m3fn[32, 256]\n" + ws +
         "  %w2 = mul(%w, %grow) : f32[32, 256]\n"
         "  assign(%w2) {name = \"w\"}\n"
         "  return %y.q, %w.q, %y.amax, %w.amax\n}\n";
}

/// FP8 delayed scaling's state updates of three tensors (delayed_scaling_update on each's amax):
/// t0 history 16 most_recent margin -1 e4m3, t1 history 1 e5m2 margin 2, t2 history 600 (more
/// than a block's threads) max e4m3. Returns each history and scale as they were before the run,
/// then t2's new scale, which makes t2's update one that is also read, not only assigned.
inline std::string scale_update_graph() {
  struct T {
    const char* name;
    int history;
    const char* attrs;
    const char* x;
  };
  const T ts[] = {{"t0", 16, "algorithm = \"most_recent\", dtype = f8e4m3fn, margin = -1", "%x0"},
                  {"t1", 1, "algorithm = \"max\", dtype = f8e5m2, margin = 2", "%x1"},
                  {"t2", 600, "algorithm = \"max\", dtype = f8e4m3fn, margin = 0", "%x2"}};
  std::string body, results, types;
  for (const T& t : ts) {
    const std::string n = t.name, h = "f32[" + std::to_string(t.history) + "]";
    std::string zeros;
    for (int i = 0; i < t.history; ++i) zeros += i ? ", 0.0" : "0.0";
    body += "  %" + n + ".h = variable() {init = dense<" + h + ">[" + zeros + "], name = \"" + n + ".h\"} : " + h + "\n"
            "  %" + n + ".s = variable() {init = dense<f32[]>[1.0], name = \"" + n + ".s\"} : f32[]\n"
            "  %" + n + ".a = amax(" + t.x + ") : f32[]\n"
            "  %" + n + ".h2, %" + n + ".s2 = delayed_scaling_update(%" + n + ".a, %" + n + ".h, %" + n + ".s) {" + t.attrs +
            "} : " + h + ", f32[]\n"
            "  assign(%" + n + ".h2) {name = \"" + n + ".h\"}\n"
            "  assign(%" + n + ".s2) {name = \"" + n + ".s\"}\n";
    results += (results.empty() ? "%" : ", %") + n + ".h, %" + n + ".s";
    types += (types.empty() ? "" : ", ") + h + ", f32[]";
  }
  return "graph @scales(%x0: f32[4, 300], %x1: f32[64], %x2: f32[64]) -> (" + types + ", f32[]) {\n" + body +
         "  return " + results + ", %t2.s2\n}\n";
}

}  // namespace kiln
