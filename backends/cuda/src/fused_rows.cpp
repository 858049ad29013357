// Lowering of a fused row group (a row reduction with its elementwise prologue and epilogue,
// from fuse-rows) to one kernel: rows held in registers, 16-byte loads and stores.
#include <cmath>
#include <limits>
#include <set>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// Most elements one thread holds of one row value; longer rows are lowered node by node.
constexpr int64_t kMaxRowItems = 32;

int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

/// The first dim a row op reduces from, or -1 when `n` is no row op this kernel handles.
int64_t row_axis(const Node& n) {
  const std::string& op = n.op_name();
  const int64_t rank = static_cast<int64_t>(n.operand(0)->shape().size());
  if (op == "rms_norm" || op == "layer_norm") return norm_axis(n.get_int("axis", -1), rank);
  if (op == "softmax" || op == "log_softmax")
    return norm_axis(n.get_int("axis", -1), rank) == rank - 1 ? rank - 1 : -1;
  if (op.rfind("reduce_", 0) != 0) return -1;
  std::set<int64_t> axes;
  for (int64_t a : n.get_ints("axes")) axes.insert(norm_axis(a, rank));
  if (axes.empty())
    for (int64_t d = 0; d < rank; ++d) axes.insert(d);
  const int64_t first = rank - static_cast<int64_t>(axes.size());
  return *axes.begin() == first && *axes.rbegin() == rank - 1 ? first : -1;
}

bool is_row_op(const Node& n) {
  static const std::set<std::string> kOps = {"rms_norm", "layer_norm", "softmax", "log_softmax", "reduce_sum",
                                             "reduce_mean", "reduce_max", "reduce_min", "reduce_prod"};
  return kOps.count(n.op_name()) && n.num_operands() >= 1;
}

/// How a value is held: a row (one element per (item, lane)), one value per row, or a scalar.
enum class Held { kRow, kPerRow, kScalar };

}  // namespace

StatusOr<bool> Lowerer::fused_rows(const Node& fused) {
  const Graph& body = fused.region(0);
  const Node* anchor = nullptr;
  for (const auto& n : body.nodes())
    if (is_row_op(*n)) {
      anchor = n.get();
      break;
    }
  if (!anchor || row_axis(*anchor) < 0) return false;
  const Sizes full = sizes_of(anchor->operand(0));
  const size_t axis = static_cast<size_t>(row_axis(*anchor));
  const Sizes lead(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(axis)),
      trail(full.begin() + static_cast<std::ptrdiff_t>(axis), full.end());
  const int64_t rows = product(lead), len = product(trail);
  Sizes per_row = lead;
  per_row.resize(full.size(), 1);
  if (rows == 0 || len == 0) return false;

  // Classify every value; anything this kernel cannot hold sends the group node by node.
  std::unordered_map<const Value*, Held> held;
  auto broadcasts = [&](const Sizes& s) {
    if (s.size() > full.size()) return false;
    for (size_t d = 0; d < s.size(); ++d)
      if (s[d] != 1 && s[d] != full[full.size() - s.size() + d]) return false;
    return true;
  };
  for (const Value* v : body.inputs()) {
    if (!broadcasts(sizes_of(v)) || !reg_type(v->dtype())) return false;
    const Sizes st = broadcast_strides(sizes_of(v), full);
    held[v] = std::all_of(st.begin() + static_cast<std::ptrdiff_t>(axis), st.end(), [](int64_t s) { return s == 0; })
                  ? (product(sizes_of(v)) == 1 ? Held::kScalar : Held::kPerRow)
                  : Held::kRow;
  }
  bool dbl = false;
  for (const auto& np : body.nodes()) {
    const Node& n = *np;
    if (n.num_results() != 1) return false;
    const Value* r = n.result();
    const DType t = r->dtype();
    const bool f8 = t == DType::kF8E4M3FN || t == DType::kF8E5M2;
    if (f8 ? !quantize_epilogue(n) : (!is_float(t) || !reg_type(t))) return false;
    dbl |= t == DType::kF64;
    const Sizes rs = sizes_of(r);
    if (n.op_name() == "constant") {
      if (product(rs) != 1) return false;
      held[r] = Held::kScalar;
      continue;
    }
    for (const Value* v : n.operands())
      if (!held.count(v)) return false;
    if (is_row_op(n)) {
      if (row_axis(n) != static_cast<int64_t>(axis) || sizes_of(n.operand(0)) != full) return false;
      if (held.at(n.operand(0)) != Held::kRow) return false;
      const bool reduces = n.op_name().rfind("reduce_", 0) == 0;
      if (!reduces && rs != full) return false;
      if (reduces && rs != per_row) {
        // Without keepdims the per-row result may only leave the group.
        for (const Use& u : r->uses())
          if (u.user) return false;
      }
      held[r] = reduces ? Held::kPerRow : Held::kRow;
      continue;
    }
    if (n.op_name() == "amax") {
      // max |x| of a row value over the whole tensor: accumulated per thread, combined by an
      // atomic after the row loop.
      if (!amax_epilogue(n) || held.at(n.operand(0)) != Held::kRow) return false;
      held[r] = Held::kScalar;
      continue;
    }
    if (n.op_name() == "quantize") {
      if (!quantize_epilogue(n) || rs != full) return false;
    } else if (!n.op() || (!n.op()->has(kTraitElementwise) && n.op_name() != "identity")) {
      return false;
    }
    if (rs == full) {
      held[r] = Held::kRow;
    } else if (rs == per_row) {
      for (const Value* v : n.operands())
        if (held.at(v) == Held::kRow) return false;
      held[r] = Held::kPerRow;
    } else {
      return false;
    }
  }
  for (const Value* o : body.outputs())
    if (!o->producer() || o->producer()->graph() != &body ||
        (held.at(o) == Held::kScalar && o->producer()->op_name() != "amax"))
      return false;

  // Vector width: 16 bytes of the widest row-shaped input or output, if every row allows it.
  int64_t widest = 1;
  for (const Value* v : body.inputs())
    if (held.at(v) == Held::kRow) widest = std::max(widest, dtype_storage_bytes(v->dtype(), 1));
  for (const Value* v : body.outputs())
    if (held.at(v) == Held::kRow) widest = std::max(widest, dtype_storage_bytes(v->dtype(), 1));
  int64_t vec = 16 / widest;
  auto aligned = [&](int id) { return id == root(id) || bufs_[id].offset % 16 == 0; };
  for (int i = 0; i < body.num_inputs(); ++i) vec = aligned(buf(fused.operand(i))) ? vec : 1;
  while (len % vec != 0) vec /= 2;
  const int64_t nv = len / vec;
  // Threads per row: enough for about 16 elements each; a warp or less for short rows, which
  // then share a 256-thread block.
  int64_t per_row_threads = std::clamp<int64_t>(pow2_ceil((nv + std::max<int64_t>(1, 16 / vec) - 1) /
                                                          std::max<int64_t>(1, 16 / vec)),
                                                1, 1024);
  if (per_row_threads < 32 && nv > per_row_threads) per_row_threads = std::min<int64_t>(32, pow2_ceil(nv));
  const int64_t items = (nv + per_row_threads - 1) / per_row_threads;
  if (items * vec > kMaxRowItems) return false;
  const bool warp = per_row_threads <= 32;
  const int64_t block = warp ? kBlock : per_row_threads, rows_per_block = warp ? kBlock / per_row_threads : 1;

  // From here on the group is one kernel.
  const std::string acc = dbl ? "double" : "float", f = dbl ? "" : "f";
  const DType at = dbl ? DType::kF64 : DType::kF32;
  const std::string T = int_literal(per_row_threads), NV = int_literal(nv), I = std::to_string(items),
                    V = std::to_string(vec), L = int_literal(len);
  std::string params, body_code, pre_loop, post_loop;  // pre/post: around the row loop (amax)
  std::vector<int> args;
  std::unordered_map<const Value*, std::string> var;
  auto at_ce = [&](const Value* v) { return held.at(v) == Held::kRow ? var.at(v) + "[c][e]" : var.at(v); };
  const std::string each = "#pragma unroll\n    for (int c = 0; c < " + I + "; ++c)\n#pragma unroll\n      for (int e = 0; e < " +
                           V + "; ++e) ";
  const std::string q = "((long long)c * " + T + " + t_)";
  int k = 0;
  for (const Value* v : body.inputs()) {
    const int id = buf(fused.operand(k));
    const DType t = v->dtype();
    KILN_ASSIGN_OR_RETURN(std::string st, storage(fused, t));
    KILN_ASSIGN_OR_RETURN(std::string rt, reg(fused, t));
    const std::string p = "in" + std::to_string(k), name = "x" + std::to_string(k);
    params += "const " + st + "* __restrict__ " + p + ", ";
    args.push_back(id);
    const Sizes s = sizes_of(v), bst = broadcast_strides(s, full);
    const Sizes lst(bst.begin(), bst.begin() + static_cast<std::ptrdiff_t>(axis)),
        tst(bst.begin() + static_cast<std::ptrdiff_t>(axis), bst.end());
    const std::string rowoff = index_code("row", lead, {lst}, {"ro" + std::to_string(k)});
    var[v] = name;
    if (held.at(v) == Held::kScalar) {
      body_code += "    const " + rt + " " + name + " = " + load_expr(t, p + "[0]") + ";\n";
    } else if (held.at(v) == Held::kPerRow) {
      body_code += "    " + rowoff + "    const " + rt + " " + name + " = live ? " +
                   load_expr(t, p + "[ro" + std::to_string(k) + "]") + " : (" + rt + ")0;\n";
    } else if (tst == contiguous_strides(trail)) {
      // Contiguous along the row: one vector per (item, lane).
      const std::string vt = "V" + std::to_string(k);
      body_code += "    struct alignas(" + std::to_string(vec * dtype_storage_bytes(t, 1)) + ") " + vt + " { " + st +
                   " v[" + V + "]; };\n    " + rowoff + "    " + rt + " " + name + "[" + I + "][" + V + "];\n";
      body_code += "#pragma unroll\n    for (int c = 0; c < " + I + "; ++c) {\n      if (live && " + q + " < " + NV +
                   ") {\n        const " + vt + " t = *reinterpret_cast<const " + vt + "*>(" + p + " + ro" +
                   std::to_string(k) + " + " + q + " * " + V + ");\n#pragma unroll\n        for (int e = 0; e < " + V +
                   "; ++e) " + name + "[c][e] = " + load_expr(t, "t.v[e]") + ";\n      } else {\n#pragma unroll\n" +
                   "        for (int e = 0; e < " + V + "; ++e) " + name + "[c][e] = (" + rt + ")0;\n      }\n    }\n";
    } else {
      // Any other broadcast: element by element through the index math.
      body_code += "    " + rowoff + "    " + rt + " " + name + "[" + I + "][" + V + "];\n    " + each + "{\n" +
                   "        const long long j = " + q + " * " + V + " + e;\n        " +
                   index_code("j", trail, {tst}, {"co"}) + "        " + name + "[c][e] = (live && j < " + L + ") ? " +
                   load_expr(t, p + "[ro" + std::to_string(k) + " + co]") + " : (" + rt + ")0;\n      }\n";
    }
    ++k;
  }
  std::set<std::string> combs;
  // A block-wide (or row-group-wide) reduction of `v` with `comb` into `out`.
  auto reduce_into = [&](const std::string& out, const std::string& init, const std::string& comb,
                         const std::string& elem) {
    combs.insert(comb);
    body_code += "    " + acc + " " + out + " = " + init + ";\n    " + each + "if (" + q + " < " + NV + ") " + out +
                 " = k_" + comb + "(" + out + ", " + elem + ");\n";
    body_code += "    " + out + " = k_reduce_" + comb + "(" + out + ");\n";
  };
  int next = 0;
  for (const auto& np : body.nodes()) {
    const Node& n = *np;
    const Value* r = n.result();
    const DType t = r->dtype();
    const std::string& op = n.op_name();
    // A quantize epilogue's value is x / scale in f32 until its store rounds it to f8.
    const bool to_f8 = op == "quantize";
    std::string rt = "float";
    if (!to_f8) {
      KILN_ASSIGN_OR_RETURN(rt, reg(n, t));
    }
    const std::string name = "v" + std::to_string(next++);
    var[r] = name;
    if (op == "amax") {
      // |x| as f32 bits (see amax() in state.cpp): an integer max gives max |x|, or nan.
      pre_loop += "  unsigned " + name + " = 0u;\n";
      body_code += "    " + each + "if (live && " + q + " < " + NV + ") " + amax_fold(name, at_ce(n.operand(0))) + "\n";
      continue;
    }
    if (op == "constant") {
      const Tensor& c = n.attr("value")->as_tensor();
      body_code += "    const " + rt + " " + name + " = " + literal(t, c.get_f64(0)) + ";\n";
      continue;
    }
    const bool row = held.at(r) == Held::kRow;
    auto define = [&](const std::string& expr) {
      const std::string value = to_f8 ? expr : round_expr(t, expr);
      if (row)
        body_code += "    " + rt + " " + name + "[" + I + "][" + V + "];\n    " + each + name + "[c][e] = " + value + ";\n";
      else
        body_code += "    const " + rt + " " + name + " = " + value + ";\n";
    };
    if (!is_row_op(n)) {
      std::vector<std::string> a;
      for (const Value* v : n.operands()) a.push_back(at_ce(v));
      if (to_f8) {
        need_fp8();
        define("(" + quantize_quotient(n.operand(0)->dtype(), a[0], a[1]) + ")");
      } else if (op == "identity") {
        define(a[0]);
      } else {
        KILN_ASSIGN_OR_RETURN(std::string e, op_expr(n, a));
        define(e);
      }
      continue;
    }
    const std::string x = "(" + acc + ")" + at_ce(n.operand(0));
    const std::string s = "s" + name;
    const double inf = std::numeric_limits<double>::infinity();
    if (op == "rms_norm" || op == "layer_norm") {
      std::string mean = "(" + acc + ")0";
      if (op == "layer_norm") {
        reduce_into("m" + name, mean, "sum", x);
        body_code += "    m" + name + " /= (" + acc + ")" + L + ";\n";
        mean = "m" + name;
      }
      reduce_into(s, "(" + acc + ")0", "sum", "(" + x + " - " + mean + ") * (" + x + " - " + mean + ")");
      body_code += "    const " + acc + " i" + name + " = " + literal(at, 1) + " / sqrt" + f + "(" + s + " / (" + acc +
                   ")" + L + " + " + literal(at, n.get_float("epsilon")) + ");\n";
      std::string e = "(" + x + " - " + mean + ") * i" + name;
      if (n.num_operands() > 1) e = "(" + e + ") * (" + acc + ")" + at_ce(n.operand(1));
      if (n.num_operands() > 2) e = "(" + e + ") + (" + acc + ")" + at_ce(n.operand(2));
      define(e);
    } else if (op == "softmax" || op == "log_softmax") {
      reduce_into("m" + name, literal(at, -inf), "max", x);
      reduce_into(s, "(" + acc + ")0", "sum", "exp" + f + "(" + x + " - m" + name + ")");
      define(op == "softmax" ? "exp" + f + "(" + x + " - m" + name + ") / " + s
                             : x + " - m" + name + " - log" + f + "(" + s + ")");
    } else {
      const bool mx = op == "reduce_max", mn = op == "reduce_min", prod = op == "reduce_prod";
      reduce_into(s, mx ? literal(at, -inf) : mn ? literal(at, inf) : literal(at, prod ? 1 : 0),
                  mx ? "nanmax" : mn ? "nanmin" : prod ? "prod" : "sum", x);
      define(op == "reduce_mean" ? s + " / (" + acc + ")" + L : s);
    }
  }
  k = 0;
  for (const Value* o : body.outputs()) {
    const int id = activation_for(fused.result(k));
    const DType t = o->dtype();
    KILN_ASSIGN_OR_RETURN(std::string st, storage(fused, t));
    const std::string p = "out" + std::to_string(k);
    params += (o->producer()->op_name() == "amax" ? std::string("unsigned") : st) + "* __restrict__ " + p + ", ";
    args.push_back(id);
    if (o->producer()->op_name() == "amax") {
      post_loop += amax_combine(var.at(o), p);
      steps_.push_back({"step memset dst=b" + std::to_string(id) + " bytes=4", {id}});
    } else if (held.at(o) == Held::kPerRow) {
      body_code += "    if (live && t_ == 0) " + p + "[row] = " + store_expr(t, var.at(o)) + ";\n";
    } else {
      const std::string vt = "W" + std::to_string(k);
      body_code += "    struct alignas(" + std::to_string(vec * dtype_storage_bytes(t, 1)) + ") " + vt + " { " + st +
                   " v[" + V + "]; };\n#pragma unroll\n    for (int c = 0; c < " + I + "; ++c) {\n      if (!live || " +
                   q + " >= " + NV + ") continue;\n      " + vt + " t;\n#pragma unroll\n      for (int e = 0; e < " + V +
                   "; ++e) t.v[e] = " + store_expr(t, var.at(o) + "[c][e]") + ";\n      *reinterpret_cast<" + vt +
                   "*>(" + p + " + row * " + L + " + " + q + " * " + V + ") = t;\n    }\n";
    }
    ++k;
  }
  params.resize(params.size() - 2);

  std::string text = "extern \"C\" __global__ void __launch_bounds__(" + std::to_string(block) + ") ";
  const std::string name = kernel_name("fused_" + anchor->op_name());
  text += name + "(" + params + ") {\n";
  if (!warp) text += "  __shared__ " + acc + " k_part[32];\n";
  text += "  const long long t_ = threadIdx.x % " + T + ";\n";
  static const std::map<std::string, std::string> kComb = {
      {"sum", "a + b"}, {"prod", "a * b"}, {"max", "b > a ? b : a"},
      {"nanmax", "isnan(a) ? a : ((isnan(b) || b > a) ? b : a)"},
      {"nanmin", "isnan(a) ? a : ((isnan(b) || b < a) ? b : a)"}};
  for (const std::string& c : combs)
    text += "  auto k_" + c + " = [](" + acc + " a, " + acc + " b) -> " + acc + " { return " + kComb.at(c) + "; };\n";
  // Lanes of a row are aligned groups of a power of two, so xor shuffles stay inside the row.
  // (One lambda per combiner: NVRTC takes no generic lambdas in device code.)
  for (const std::string& c : combs) {
    text += "  auto k_reduce_" + c + " = [&](" + acc + " v) -> " + acc + " {\n";
    text += "#pragma unroll\n    for (int o = " + std::to_string(std::min<int64_t>(per_row_threads, 32) / 2) +
            "; o > 0; o >>= 1) v = k_" + c + "(v, __shfl_xor_sync(0xffffffffu, v, o));\n";
    if (!warp)
      text += "    __syncthreads();\n    if ((threadIdx.x & 31) == 0) k_part[threadIdx.x >> 5] = v;\n"
              "    __syncthreads();\n    v = k_part[0];\n#pragma unroll\n    for (int w = 1; w < " +
              std::to_string(per_row_threads / 32) + "; ++w) v = k_" + c + "(v, k_part[w]);\n";
    text += "    return v;\n  };\n";
  }
  text += "  for (long long r0_ = (long long)blockIdx.x * " + int_literal(rows_per_block) + "; r0_ < " +
          int_literal(rows) + "; r0_ += (long long)gridDim.x * " + int_literal(rows_per_block) + ") {\n";
  text += "    const long long row = r0_ + threadIdx.x / " + T + ";\n    const bool live = row < " + int_literal(rows) +
          ";\n    (void)live;\n";
  text = text.substr(0, text.rfind("  for (long long r0_")) + pre_loop + text.substr(text.rfind("  for (long long r0_"));
  text += body_code + "  }\n" + post_loop + "}\n";
  add_kernel_text(name, text);
  // With an amax the grid stays small: one atomic per block.
  const int64_t grid_cap = post_loop.empty() ? kMaxGrid : 1024;
  launch_grid(name, {std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, grid_cap)}, block, 0, args);
  return true;
}

}  // namespace kiln::cuda::detail
