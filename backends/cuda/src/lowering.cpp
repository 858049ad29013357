// Lowering of a static-shape Kiln graph to CUDA C++ kernels, cuBLASLt GEMM steps and a
// liveness-based static memory plan (the plan text of docs/artifact.md).
#include "kiln/cuda/lowering.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numbers>
#include <set>
#include <unordered_map>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/zeros.h"
#include "lowerer.h"

namespace kiln::cuda {
namespace detail {

Status Lowerer::weight(const Value* v, const Tensor& t) {
  weights_.resize(static_cast<size_t>(align_up(static_cast<int64_t>(weights_.size()))), '\0');
  const int id = add_buffer("weight", t.dtype(), t.shape(), v->name());
  bufs_[id].offset = static_cast<int64_t>(weights_.size());
  weights_.append(reinterpret_cast<const char*>(t.data()), t.nbytes());
  val_[v] = id;
  return ok_status();
}

Status Lowerer::fold(const Node& n) {
  std::vector<Tensor> in, out;
  for (const Value* v : n.operands()) {
    const int id = buf(v);
    const int64_t off = bufs_[root(id)].offset + (id == root(id) ? 0 : bufs_[id].offset);
    auto bytes = std::make_shared<std::string>(weights_.substr(static_cast<size_t>(off), static_cast<size_t>(bufs_[id].bytes)));
    in.push_back(Tensor::wrap(v->dtype(), sizes_of(v), reinterpret_cast<const std::byte*>(bytes->data()), bytes));
  }
  for (const Value* r : n.results()) out.emplace_back(r->dtype(), sizes_of(r));
  Interpreter interp;
  KernelContext ctx{n, in, out, interp};
  KILN_RETURN_IF_ERROR(n.op()->reference(ctx).with_context("cuda: folding constant " + n.op_name()));
  for (int i = 0; i < n.num_results(); ++i) KILN_RETURN_IF_ERROR(weight(n.result(i), out[static_cast<size_t>(i)]));
  return ok_status();
}

bool Lowerer::pure_pointwise(const Node& fused) const {
  const Graph& body = fused.region(0);
  if (body.num_outputs() == 0) return false;
  // Every output but amax epilogues' (one value each) has the kernel's shape.
  std::optional<Sizes> shape;
  for (int i = 0; i < fused.num_results(); ++i) {
    const Node* p = body.output(i)->producer();
    if (p && p->op_name() == "amax") continue;
    if (!shape) shape = sizes_of(fused.result(i));
    if (sizes_of(fused.result(i)) != *shape) return false;
  }
  if (!shape) return false;
  for (const Value* o : fused.operands()) {
    const Sizes s = sizes_of(o);
    if (s.size() > shape->size()) return false;
    for (size_t d = 0; d < s.size(); ++d)
      if (s[d] != 1 && s[d] != (*shape)[shape->size() - s.size() + d]) return false;
  }
  for (const auto& n : body.nodes()) {
    if (n->op_name() == "constant") {
      if (n->attr("value") == nullptr || n->attr("value")->as_tensor().numel() != 1) return false;
    } else if (n->op_name() == "quantize") {
      if (!quantize_epilogue(*n)) return false;
    } else if (n->op_name() == "amax") {
      if (!amax_epilogue(*n)) return false;
    } else if (!n->op()->has(kTraitElementwise) && n->op_name() != "identity") {
      return false;
    }
  }
  return true;
}

bool Lowerer::amax_epilogue(const Node& n) const {
  if (n.op_name() != "amax" || n.num_operands() != 1) return false;
  const DType x = n.operand(0)->dtype();
  if (!is_float(x) || x == DType::kF8E4M3FN || x == DType::kF8E5M2 || n.result()->dtype() != DType::kF32) return false;
  for (const Use& u : n.result()->uses())
    if (u.user) return false;
  return true;
}

bool Lowerer::quantize_epilogue(const Node& n) const {
  if (n.op_name() != "quantize" || n.num_operands() != 2) return false;
  const DType q = n.result()->dtype(), x = n.operand(0)->dtype();
  if ((q != DType::kF8E4M3FN && q != DType::kF8E5M2) || x == DType::kF8E4M3FN || x == DType::kF8E5M2 || !is_float(x))
    return false;
  if (product(sizes_of(n.operand(1))) != 1 || n.operand(1)->dtype() != DType::kF32) return false;
  // Its f8 value is only stored: no member of the group reads it.
  for (const Use& u : n.result()->uses())
    if (u.user) return false;
  return true;
}

Status Lowerer::lower_graph_nodes(const Graph& g) {
  for (const auto& n : g.nodes()) {
    for (const Value* r : n->results()) KILN_RETURN_IF_ERROR(check_static(r));
    if (absorbed_.count(n.get()) || defer_to_conv_prologue(*n)) continue;
    KILN_RETURN_IF_ERROR(lower_node(*n));
  }
  return ok_status();
}

Status Lowerer::lower_node(const Node& n) {
  const std::string& op = n.op_name();
  // Zeros only scatter_adds start from: each clears its own output instead.
  if ((op == "constant" || op == "expand") && zeros_for_scatter(n.result())) return ok_status();
  if (op == "constant") return weight(n.result(), n.attr("value")->as_tensor());
  // A linear's bias gradient, computed by the GEMM of its weight gradient (bias_grad.cpp).
  if (op == "reduce_sum") {
    KILN_ASSIGN_OR_RETURN(const bool by_gemm, bias_grad_by_gemm(n));
    if (by_gemm) return ok_status();
  }
  if (bias_grad_.count(&n)) return lower_with_bias_grad(n);
  if (op == "variable" || op == "assign" || op == "amax" || op == "delayed_scaling_update" ||
      op == "delayed_scaling_step_scale")
    return state_op(n);  // state.cpp
  if (op == "fused") {
    const Graph& body = n.region(0);
    if (pure_pointwise(n)) {
      if (defer_to_reduce(n)) return ok_status();  // computed on its one reduction's loads
      std::vector<const Node*> nodes;
      for (const auto& m : body.nodes()) nodes.push_back(m.get());
      std::vector<int> in_bufs, out_bufs;
      for (const Value* v : n.operands()) in_bufs.push_back(buf(v));
      for (const Value* r : n.results()) out_bufs.push_back(activation_for(r));
      const std::vector<Value*> ins = body.inputs();
      return pointwise("fused", nodes, {ins.begin(), ins.end()}, {body.outputs().begin(), body.outputs().end()},
                       in_bufs, out_bufs);
    }
    KILN_ASSIGN_OR_RETURN(const bool indexed, indexed_pointwise(n));
    if (indexed) return ok_status();
    KILN_ASSIGN_OR_RETURN(const bool rows, fused_rows(n));
    if (rows) return ok_status();
    // Not one kernel's worth: lower the group's nodes one by one.
    for (int i = 0; i < body.num_inputs(); ++i) val_[body.input(i)] = buf(n.operand(i));
    KILN_RETURN_IF_ERROR(lower_graph_nodes(body));
    for (int i = 0; i < n.num_results(); ++i) val_[n.result(i)] = buf(body.output(i));
    return ok_status();
  }
  if (n.num_regions() > 0) return unsupported(n, "ops with regions other than fused are not supported");
  if (is_collective(op)) return collective(n);  // collective.cpp: never folded, even on weights
  // Never folded: its zero data may have no buffer (zeros_for_scatter).
  if (op == "scatter_add") return scatter_add(n);
  // A conv with a deferred prologue reads an activation, and its input has no buffer yet.
  bool all_weights = !prologue_.count(&n);
  // A reduction whose input an elementwise prologue computes reads that node's operands instead.
  if (n.num_operands() > 0 && n.operand(0)->producer() && reduce_prologue_.count(n.operand(0)->producer()))
    all_weights = false;
  int64_t out_bytes = 0;
  for (const Value* v : n.operands())
    if (all_weights) all_weights = bufs_[root(buf(v))].kind == "weight";
  for (const Value* r : n.results()) out_bytes += dtype_storage_bytes(r->dtype(), product(sizes_of(r)));
  if (all_weights && out_bytes <= kFoldLimitBytes) return fold(n);

  static const std::set<std::string> kViews = {"reshape", "flatten", "squeeze", "unsqueeze", "identity"};
  if (kViews.count(op)) {
    const int src = buf(n.operand(0)), base = root(src);
    const int id = add_buffer("alias", n.result()->dtype(), sizes_of(n.result()), n.result()->name());
    bufs_[id].base = base;
    bufs_[id].offset = src == base ? 0 : bufs_[src].offset;  // a view of a view keeps its offset
    val_[n.result()] = id;
    return ok_status();
  }
  if (n.op()->has(kTraitElementwise)) {
    if (defer_to_reduce(n)) return ok_status();
    std::vector<int> in_bufs;
    for (const Value* v : n.operands()) in_bufs.push_back(buf(v));
    const int out = activation_for(n.result());
    return pointwise(op, {&n}, {n.operands().begin(), n.operands().end()}, {n.result()}, in_bufs, {out});
  }
  if (op.rfind("reduce_", 0) == 0) return reduce(n);
  if (op == "argmax" || op == "argmin") return arg_reduce(n);
  if (op == "softmax" || op == "log_softmax") return softmax(n);
  if (op == "cross_entropy" || op == "cross_entropy_with_grad") return cross_entropy(n);
  if (op == "cross_entropy_grad") return cross_entropy_grad(n);
  if (op == "attention") return attention(n);
  if (op == "layer_norm" || op == "rms_norm") return norm(n);
  if (op == "batch_norm") return batch_norm(n);
  if (op == "matmul") return matmul(n);
  if (op == "linear") return linear(n);
  if (op == "matmul_acc") return matmul_acc(n);
  if (op == "quantize") return quantize(n);
  if (op == "requantize") return requantize(n);
  if (op == "dequantize") return dequantize(n);
  if (op == "scaled_matmul") return scaled_matmul(n);
  if (op == "matmul_int4") return matmul_int4(n);
  if (op == "conv") return conv(n);
  if (op == "max_pool" || op == "avg_pool") return pool(n);
  if (op == "gather") return gather(n);
  if (op == "pad") return pad(n);

  const Value* x = n.num_operands() > 0 ? n.operand(0) : nullptr;
  if (op == "transpose") {
    if (fold_attention_transpose(n) || fold_transpose(n)) return ok_status();
    const Sizes xs = sizes_of(x);
    Sizes perm = n.get_ints("perm");
    if (perm.empty())
      for (size_t d = xs.size(); d-- > 0;) perm.push_back(static_cast<int64_t>(d));
    const Sizes cs = contiguous_strides(xs);
    Sizes st;
    for (int64_t p : perm) st.push_back(cs[static_cast<size_t>(norm_axis(p, static_cast<int64_t>(xs.size())))]);
    return gather_view(n, buf(x), activation_for(n.result()), sizes_of(n.result()), st, 0);
  }
  if (op == "slice") {
    const Sizes xs = sizes_of(x);
    const int64_t rank = static_cast<int64_t>(xs.size());
    Sizes axes = n.get_ints("axes"), starts = n.get_ints("starts"), ends = n.get_ints("ends"),
          steps = n.get_ints("steps");
    if (!n.has_attr("axes"))
      for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
    if (!n.has_attr("steps")) steps.assign(starts.size(), 1);
    Sizes st = contiguous_strides(xs);
    int64_t base = 0;
    for (size_t i = 0; i < axes.size(); ++i) {
      const size_t a = static_cast<size_t>(norm_axis(axes[i], rank));
      const SliceAxis s = clamp_slice(xs[a], starts[i], ends[i], steps[i]);
      base += s.start * st[a];
      if (s.count > 1) st[a] *= s.step;
    }
    return gather_view(n, buf(x), activation_for(n.result()), sizes_of(n.result()), st, base);
  }
  if (op == "expand") {
    const Sizes out = sizes_of(n.result());
    return gather_view(n, buf(x), activation_for(n.result()), out, broadcast_strides(sizes_of(x), out), 0);
  }
  if (op == "concat") {
    const int out = activation_for(n.result());
    const Sizes os = sizes_of(n.result());
    const int64_t axis = norm_axis(n.get_int("axis"), static_cast<int64_t>(os.size()));
    const Sizes ost = contiguous_strides(os);
    // A small concat (FP8 delayed scaling's amax history roll: 1 + 15 elements) is one kernel
    // picking each element's input: its cost is launches, one per input otherwise.
    if (product(os) <= kSmallConcat && n.num_operands() > 1) {
      KILN_ASSIGN_OR_RETURN(std::string st, storage(n, n.result()->dtype()));
      const int64_t inner = ost[static_cast<size_t>(axis)], len = os[static_cast<size_t>(axis)];
      std::string params, body = "    const long long a = i / " + int_literal(inner) + " % " + int_literal(len) +
                                 ", o = i / " + int_literal(inner * len) + ", e = i % " + int_literal(inner) + ";\n";
      std::vector<int> args;
      int64_t at = 0;
      for (int k = 0; k < n.num_operands(); ++k) {
        const int64_t lk = sizes_of(n.operand(k))[static_cast<size_t>(axis)];
        const std::string x = "x" + std::to_string(k);
        params += "const " + st + "* __restrict__ " + x + ", ";
        args.push_back(buf(n.operand(k)));
        if (lk > 0)
          body += "    if (a >= " + int_literal(at) + " && a < " + int_literal(at + lk) + ") y[i] = " + x + "[(o * " +
                  int_literal(lk) + " + a - " + int_literal(at) + ") * " + int_literal(inner) + " + e];\n";
        at += lk;
      }
      args.push_back(out);
      if (product(os) > 0) launch_elementwise(kernel_name("concat"), params + st + "* __restrict__ y", product(os), body, args);
      return ok_status();
    }
    int64_t at = 0;
    for (const Value* v : n.operands()) {
      const Sizes vs = sizes_of(v);
      KILN_RETURN_IF_ERROR(strided_copy(n, buf(v), out, vs, contiguous_strides(vs), 0, ost,
                                        at * ost[static_cast<size_t>(axis)], vs));
      at += vs[static_cast<size_t>(axis)];
    }
    return ok_status();
  }
  if (op == "split") {
    const Sizes xs = sizes_of(x);
    const int64_t axis = norm_axis(n.get_int("axis", 0), static_cast<int64_t>(xs.size()));
    const Sizes st = contiguous_strides(xs);
    int64_t at = 0;
    // Pieces of a split with nothing before its axis are contiguous: views, not copies.
    const bool leading = product(Sizes(xs.begin(), xs.begin() + axis)) == 1;
    for (const Value* r : n.results()) {
      const Sizes rs = sizes_of(r);
      if (leading) {
        const int v = view(buf(x), at * st[static_cast<size_t>(axis)], product(rs));
        bufs_[v].shape = rs;
        bufs_[v].name = r->name();
        val_[r] = v;
        at += rs[static_cast<size_t>(axis)];
        continue;
      }
      KILN_RETURN_IF_ERROR(gather_view(n, buf(x), activation_for(r), rs, st, at * st[static_cast<size_t>(axis)]));
      at += rs[static_cast<size_t>(axis)];
    }
    return ok_status();
  }
  return unsupported(n, "op is not supported by the cuda lowering");
}

StatusOr<std::string> Lowerer::op_expr(const Node& n, const std::vector<std::string>& a) {
  const std::string& op = n.op_name();
  const DType in = n.operand(op == "where" ? 1 : 0)->dtype();
  const DType out = n.result()->dtype();
  const bool flt = is_float(in), dbl = in == DType::kF64;
  auto fn = [&](const std::string& name, const std::string& args) { return name + (dbl ? "" : "f") + "(" + args + ")"; };
  auto lit = [&](double v) { return literal(in, v); };
  static const std::set<std::string> kMath = {"exp", "log", "sqrt", "tanh", "erf", "sin", "cos", "floor", "ceil"};
  if (flt && kMath.count(op)) return fn(op, a[0]);
  if (op == "neg") return "(-" + a[0] + ")";
  if (op == "abs") return flt ? fn("fabs", a[0]) : "(" + a[0] + " < 0 ? -" + a[0] + " : " + a[0] + ")";
  if (op == "relu") return "(" + a[0] + " < 0 ? " + lit(0) + " : " + a[0] + ")";
  if (op == "sign") return "(" + a[0] + " > 0 ? " + lit(1) + " : (" + a[0] + " < 0 ? " + lit(-1) + " : " + a[0] + "))";
  if (flt) {
    if (op == "rsqrt") return "(" + lit(1) + " / " + fn("sqrt", a[0]) + ")";
    if (op == "reciprocal") return "(" + lit(1) + " / " + a[0] + ")";
    if (op == "sigmoid") return "(" + lit(1) + " / (" + lit(1) + " + " + fn("exp", "-" + a[0]) + "))";
    if (op == "silu") return "(" + a[0] + " * (" + lit(1) + " / (" + lit(1) + " + " + fn("exp", "-" + a[0]) + ")))";
    if (op == "round") return fn("rint", a[0]);
    if (op == "softplus")
      return "(" + fn("fmax", a[0] + ", " + lit(0)) + " + " + fn("log1p", fn("exp", "-" + fn("fabs", a[0]))) + ")";
    if (op == "gelu") {
      if (n.get_string("approximate") == "tanh")
        return "(" + lit(0.5) + " * " + a[0] + " * (" + lit(1) + " + " +
               fn("tanh", lit(std::sqrt(2.0 / std::numbers::pi)) + " * (" + a[0] + " + " + lit(0.044715) + " * " + a[0] + " * " + a[0] + " * " + a[0] + ")") + "))";
      return "(" + lit(0.5) + " * " + a[0] + " * (" + lit(1) + " + " + fn("erf", a[0] + " * " + lit(1.0 / std::numbers::sqrt2)) + "))";
    }
    if (op == "leaky_relu") return "(" + a[0] + " < 0 ? " + lit(n.get_float("alpha")) + " * " + a[0] + " : " + a[0] + ")";
    if (op == "isnan") return "isnan(" + a[0] + ")";
    if (op == "isinf") return "isinf(" + a[0] + ")";
    if (op == "div") return "(" + a[0] + " / " + a[1] + ")";
    if (op == "pow") return fn("pow", a[0] + ", " + a[1]);
    if (op == "maximum" || op == "minimum")
      return "((isnan(" + a[0] + ") || isnan(" + a[1] + ")) ? " + a[0] + " + " + a[1] + " : " +
             fn(op == "maximum" ? "fmax" : "fmin", a[0] + ", " + a[1]) + ")";
    if (op == "mod")
      return n.get_int("fmod") != 0 ? fn("fmod", a[0] + ", " + a[1]) : "kiln_pymod(" + a[0] + ", " + a[1] + ")";
  } else if (is_integer(in)) {
    if (op == "div") return "kiln_idiv(" + a[0] + ", " + a[1] + ")";
    if (op == "pow") return "kiln_ipow(" + a[0] + ", " + a[1] + ")";
    if (op == "maximum") return "(" + a[0] + " > " + a[1] + " ? " + a[0] + " : " + a[1] + ")";
    if (op == "minimum") return "(" + a[0] + " < " + a[1] + " ? " + a[0] + " : " + a[1] + ")";
    if (op == "mod") return "kiln_imod(" + a[0] + ", " + a[1] + ", " + (n.get_int("fmod") != 0 ? "false" : "true") + ")";
  }
  if (op == "add") return "(" + a[0] + " + " + a[1] + ")";
  if (op == "sub") return "(" + a[0] + " - " + a[1] + ")";
  if (op == "mul") return "(" + a[0] + " * " + a[1] + ")";
  static const std::map<std::string, std::string> kCmp = {{"equal", "=="}, {"not_equal", "!="}, {"less", "<"},
                                                          {"less_equal", "<="}, {"greater", ">"}, {"greater_equal", ">="}};
  if (auto it = kCmp.find(op); it != kCmp.end()) return "(" + a[0] + " " + it->second + " " + a[1] + ")";
  if (op == "and") return "(" + a[0] + " && " + a[1] + ")";
  if (op == "or") return "(" + a[0] + " || " + a[1] + ")";
  if (op == "xor") return "(" + a[0] + " != " + a[1] + ")";
  if (op == "not") return "(!" + a[0] + ")";
  if (op == "where") return "(" + a[0] + " ? " + a[1] + " : " + a[2] + ")";
  if (op == "cast") {
    if (out == DType::kBool) return "(" + a[0] + " != 0)";
    if (is_integer(out)) return flt ? "kiln_f2i((double)" + a[0] + ")" : "(long long)" + a[0];
    KILN_ASSIGN_OR_RETURN(std::string r, reg(n, out));
    return "(" + r + ")" + a[0];
  }
  if (op == "clip") {
    const double inf = std::numeric_limits<double>::infinity();
    const double lo = n.has_attr("min") ? n.attr("min")->as_float() : -inf;
    const double hi = n.has_attr("max") ? n.attr("max")->as_float() : inf;
    std::string lo_s, hi_s;
    if (flt) {
      lo_s = lit(lo), hi_s = lit(hi);
    } else {
      const int64_t bits = dtype_bits(in);
      const int64_t tmin = in == DType::kU8 ? 0 : (in == DType::kI64 ? std::numeric_limits<int64_t>::min() : -(int64_t{1} << (bits - 1)));
      const int64_t tmax = in == DType::kU8 ? 255 : (in == DType::kI64 ? std::numeric_limits<int64_t>::max() : (int64_t{1} << (bits - 1)) - 1);
      auto clampd = [&](double v) {
        if (v <= static_cast<double>(tmin)) return tmin;
        if (v >= static_cast<double>(tmax)) return tmax;
        return static_cast<int64_t>(v);
      };
      lo_s = int_literal(clampd(std::ceil(lo))), hi_s = int_literal(clampd(std::floor(hi)));
    }
    const std::string low = "(" + a[0] + " < " + lo_s + " ? " + lo_s + " : " + a[0] + ")";
    return "(" + low + " > " + hi_s + " ? " + hi_s + " : " + low + ")";
  }
  return unsupported(n, "no kernel for dtype " + dname(in));
}

StatusOr<std::string> Lowerer::member_expr(const Node& n, const std::unordered_map<const Value*, std::string>& var) {
  if (n.op_name() == "constant") {
    const Tensor& t = n.attr("value")->as_tensor();
    if (t.numel() != 1) return unsupported(n, "not a scalar constant");
    if (is_integer(t.dtype())) return int_literal(t.get_i64(0));
    return literal(t.dtype(), is_float(t.dtype()) ? t.get_f64(0) : static_cast<double>(t.get_i64(0)));
  }
  if (n.op_name() == "identity") return var.at(n.operand(0));
  std::vector<std::string> a;
  for (const Value* v : n.operands()) {
    KILN_RETURN_IF_ERROR(reg(n, v->dtype()).status());
    a.push_back(var.at(v));
  }
  return op_expr(n, a);
}

StatusOr<std::string> Lowerer::fused_expr(const Node& n, const std::vector<std::string>& a) {
  // Longest expression inlined: operands used twice are repeated, so deep bodies could blow up.
  constexpr size_t kMaxExpr = 4096;
  const Graph& body = n.region(0);
  if (n.num_results() != 1 || body.num_outputs() != 1 || body.num_inputs() != static_cast<int>(a.size()))
    return unsupported(n, "not a one-result fused node");
  std::unordered_map<const Value*, std::string> var;
  for (int k = 0; k < body.num_inputs(); ++k) var[body.input(k)] = a[static_cast<size_t>(k)];
  for (const auto& m : body.nodes()) {
    if (m->num_results() != 1) return unsupported(*m, "not one result");
    const std::string& op = m->op_name();
    if (op == "quantize" || op == "amax" || (op != "constant" && op != "identity" && !m->op()->has(kTraitElementwise)))
      return unsupported(*m, "not elementwise");
    KILN_ASSIGN_OR_RETURN(std::string e, member_expr(*m, var));
    KILN_ASSIGN_OR_RETURN(std::string rt, reg(*m, m->result()->dtype()));
    e = "((" + rt + ")" + round_expr(m->result()->dtype(), e) + ")";
    if (e.size() > kMaxExpr) return unsupported(*m, "expression too long to inline");
    var[m->result()] = std::move(e);
  }
  return var.at(body.output(0));
}

Status Lowerer::pointwise(const std::string& label, const std::vector<const Node*>& nodes,
                          const std::vector<const Value*>& inputs, const std::vector<const Value*>& outputs,
                          const std::vector<int>& in_bufs, const std::vector<int>& out_bufs) {
  // amax epilogues' outputs are one value each, combined by an atomic after the loop.
  auto is_amax = [&](size_t k) { return outputs[k]->producer() && outputs[k]->producer()->op_name() == "amax"; };
  size_t first_out = 0;
  while (first_out + 1 < outputs.size() && is_amax(first_out)) ++first_out;
  const Sizes shape = bufs_[out_bufs[first_out]].shape;
  const int64_t count = product(shape);
  // 16-byte vectors of `w` elements when every tensor of the output's size is aligned; a
  // broadcast input is read per element at the vector's first offset plus the lane.
  std::vector<DType> full;
  bool aligned = true, broadcast = false;
  for (int id : in_bufs) {
    if (product(bufs_[id].shape) == count) full.push_back(bufs_[id].dtype), aligned &= aligned16(id);
    else broadcast |= product(bufs_[id].shape) != 1;
  }
  for (size_t k = 0; k < out_bufs.size(); ++k)
    if (!is_amax(k)) full.push_back(bufs_[out_bufs[k]].dtype), aligned &= aligned16(out_bufs[k]);
  int64_t w = aligned && count > 0 ? vector_width(full) : 0;
  if (w && (count % w != 0 || (broadcast && shape.back() % w != 0))) w = 0;
  std::unordered_map<const Value*, std::string> var;
  std::unordered_map<const Value*, std::set<size_t>> deps;  // the inputs each value is computed from
  ElementwiseAccess access;
  std::set<size_t> same_element_inputs;
  std::string params, body, stage, store, prologue, epilogue;
  std::vector<Sizes> strides;
  std::vector<std::string> names;
  std::vector<int> args;
  const Node& first = *nodes.front();
  auto staged = [&](const std::string& a, DType t) {
    const std::string st = *storage_type(t), vt = vector_type(w * dtype_storage_bytes(t, 1));
    return std::make_pair("    alignas(16) " + st + " " + a + "[" + std::to_string(w) + "];\n",
                          "*reinterpret_cast<" + vt + "*>(" + a + ")");
  };
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Buffer& b = bufs_[in_bufs[k]];
    KILN_ASSIGN_OR_RETURN(std::string st, storage(first, b.dtype));
    KILN_ASSIGN_OR_RETURN(std::string rt, reg(first, b.dtype));
    const std::string p = "in" + std::to_string(k), off = "o" + std::to_string(k);
    params += "const " + st + "* __restrict__ " + p + ", ";
    args.push_back(in_bufs[k]);
    std::string index = "i";
    if (product(b.shape) == 1) {
      index = "0";
    } else if (w && product(b.shape) == count) {
      const auto [decl, vec] = staged("a" + std::to_string(k), b.dtype);
      stage += decl + "    " + vec + " = reinterpret_cast<const " + vector_type(w * dtype_storage_bytes(b.dtype, 1)) +
               "*>(" + p + ")[q];\n";
      index = "";
    } else if (b.shape != shape) {
      strides.push_back(broadcast_strides(b.shape, shape));
      names.push_back(off);
      index = off + (w && strides.back().back() != 0 ? " + e" : "");
    }
    var[inputs[k]] = "v" + std::to_string(k);
    deps[inputs[k]].insert(k);
    if ((index == "i" || index.empty() || count == 1) && product(b.shape) == count && whole_root(in_bufs[k]))
      same_element_inputs.insert(k);
    else
      access.other_reads.insert(root(in_bufs[k]));
    body += "    const " + rt + " v" + std::to_string(k) + " = " +
            load_expr(b.dtype, index.empty() ? "a" + std::to_string(k) + "[e]" : p + "[" + index + "]") + ";\n";
  }
  if (!names.empty()) stage += index_code("i", shape, strides, names);
  int next = static_cast<int>(inputs.size());
  for (const Node* n : nodes) {
    const Value* r = n->result();
    for (const Value* v : n->operands())
      if (auto d = deps.find(v); d != deps.end()) deps[r].insert(d->second.begin(), d->second.end());
    // A quantize epilogue's value is x / scale in f32 until its store rounds it to f8.
    const bool to_f8 = n->op_name() == "quantize";
    std::string rt = "float";
    if (!to_f8) {
      KILN_ASSIGN_OR_RETURN(rt, reg(*n, r->dtype()));
    }
    std::string e;
    if (n->op_name() == "amax") {
      // |x| as f32 bits (see amax() in state.cpp): an integer max gives max |x|, or nan.
      const std::string acc = "kiln_am" + std::to_string(next++);
      prologue += "  unsigned " + acc + " = 0u;\n";
      body += "    " + amax_fold(acc, var.at(n->operand(0))) + "\n";
      var[r] = acc;
      continue;
    }
    if (to_f8) {
      need_fp8();
      e = "(" + quantize_quotient(n->operand(0)->dtype(), var.at(n->operand(0)), var.at(n->operand(1))) + ")";
    } else {
      KILN_ASSIGN_OR_RETURN(e, member_expr(*n, var));
    }
    const std::string name = "v" + std::to_string(next++);
    body += "    const " + rt + " " + name + " = " + (to_f8 ? e : round_expr(r->dtype(), e)) + ";\n";
    var[r] = name;
  }
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Buffer& b = bufs_[out_bufs[k]];
    const std::string o = "out" + std::to_string(k), s = "s" + std::to_string(k);
    args.push_back(out_bufs[k]);
    if (is_amax(k)) {
      params += "unsigned* __restrict__ " + o + (k + 1 < outputs.size() ? ", " : "");
      const std::string acc = var.at(outputs[k]);
      epilogue += amax_combine(acc, o);
      steps_.push_back({"step memset dst=b" + std::to_string(out_bufs[k]) + " bytes=4", {out_bufs[k]}});
      continue;
    }
    KILN_ASSIGN_OR_RETURN(std::string st, storage(first, b.dtype));
    params += st + "* __restrict__ " + o + (k + 1 < outputs.size() ? ", " : "");
    if (!w) {
      body += "    " + o + "[i] = " + store_expr(b.dtype, var.at(outputs[k])) + ";\n";
      continue;
    }
    const auto [decl, vec] = staged(s, b.dtype);
    stage += decl;
    body += "    " + s + "[e] = " + store_expr(b.dtype, var.at(outputs[k])) + ";\n";
    store += "    reinterpret_cast<" + vector_type(w * dtype_storage_bytes(b.dtype, 1)) + "*>(" + o + ")[q] = " + vec + ";\n";
  }
  if (count == 0) return ok_status();
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (is_amax(k) || !whole_root(out_bufs[k])) continue;
    for (size_t in : deps[outputs[k]])
      if (same_element_inputs.count(in) && bufs_[in_bufs[in]].dtype == bufs_[out_bufs[k]].dtype)
        access.same_element.insert({root(in_bufs[in]), root(out_bufs[k])});
  }
  // A kernel that also reduces (amax) keeps its grid small: one atomic per block.
  const int64_t max_blocks = epilogue.empty() ? 0 : 1024;
  if (!w) {
    launch_elementwise(kernel_name(label), params, count, stage + body, args, prologue, epilogue, max_blocks);
  } else {
    launch_vectors(kernel_name(label), params, count, w, stage + "    #pragma unroll\n    for (int e = 0; e < " +
                   std::to_string(w) + "; ++e) {\n" + body + "    }\n" + store, args, prologue, epilogue, max_blocks);
  }
  elementwise_steps_[steps_.size() - 1] = std::move(access);
  return ok_status();
}

Status Lowerer::strided_copy(const Node& n, int in, int out, const Sizes& out_shape, const Sizes& in_strides,
                             int64_t in_base, const Sizes& out_strides, int64_t out_base, const Sizes& iter) {
  (void)out_shape;
  const DType t = bufs_[in].dtype;
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  const int64_t count = product(iter);
  if (count == 0) return ok_status();
  KILN_ASSIGN_OR_RETURN(const bool vectorized, vector_copy(n, in, out, iter, in_strides, in_base, out_strides, out_base));
  if (vectorized) return ok_status();
  const std::string body = index_code("i", iter, {in_strides, out_strides}, {"src", "dst"}, {in_base, out_base}) +
                           "    y[dst] = x[src];\n";
  launch_elementwise(kernel_name(n.op_name()), "const " + st + "* __restrict__ x, " + st + "* __restrict__ y", count,
                     body, {in, out});
  return ok_status();
}

/// Blocks a middle-dim reduction aims for (two per SM of a 132-SM H100/H200) before it splits
/// its reduced rows across blocks.
constexpr int64_t kReduceBlocks = 264;
/// Reductions over fewer elements than this take a thread per output.
constexpr int64_t kShortReduction = 64;

bool Lowerer::defer_to_reduce(const Node& n) {
  if (n.num_results() != 1 || n.num_operands() == 0) return false;
  const Value* r = n.result();
  if (r->uses().size() != 1 || r->uses()[0].user == nullptr) return false;
  const Node& u = *r->uses()[0].user;
  static const std::set<std::string> kReductions = {"reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod"};
  if (!kReductions.count(u.op_name()) || u.operand(0) != r || u.num_regions() > 0) return false;
  if (!storage_type(r->dtype()) || !reg_type(r->dtype())) return false;
  // Operands of the result's size (the same layout) or one element; each read once per element.
  const int64_t count = product(sizes_of(r));
  std::vector<std::string> names;
  for (const Value* v : n.operands()) {
    const int64_t c = product(sizes_of(v));
    if ((c != count && c != 1) || !storage_type(v->dtype()) || !reg_type(v->dtype())) return false;
    if (!val_.count(v)) return false;
    names.push_back("a" + std::to_string(names.size()));
  }
  if (!(n.op_name() == "fused" ? fused_expr(n, names) : op_expr(n, names)).ok()) return false;
  reduce_prologue_.insert(&n);
  return true;
}

/// The accumulator type of reductions over `t`: f32 for narrow floats, f64 for f64.
std::string acc_type(DType t) {
  if (t == DType::kF64) return "double";
  return is_float(t) ? "float" : "long long";
}

Status Lowerer::reduce(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_RETURN_IF_ERROR(reg(n, t).status());
  const Sizes xs = sizes_of(x);
  const int64_t rank = static_cast<int64_t>(xs.size());
  const Sizes axes = n.get_ints("axes");
  std::vector<bool> mask(xs.size(), axes.empty());
  for (int64_t a : axes) mask[static_cast<size_t>(norm_axis(a, rank))] = true;
  const Sizes cs = contiguous_strides(xs);
  Sizes kd, ks, rd, rs;
  for (size_t d = 0; d < xs.size(); ++d) {
    (mask[d] ? rd : kd).push_back(xs[d]);
    (mask[d] ? rs : ks).push_back(cs[d]);
  }
  const int64_t rows = product(kd), len = product(rd);
  const std::string acc = acc_type(t);
  const std::string& op = n.op_name();
  const bool flt = is_float(t);
  const DType at = t == DType::kF64 ? DType::kF64 : DType::kF32;
  std::string init, comb;
  if (op == "reduce_sum" || op == "reduce_mean") {
    init = flt ? literal(at, 0) : "0LL";
    comb = "a + b";
  } else if (op == "reduce_prod") {
    init = flt ? literal(at, 1) : "1LL";
    comb = "a * b";
  } else if (op == "reduce_max" || op == "reduce_min") {
    const bool mx = op == "reduce_max";
    const double inf = std::numeric_limits<double>::infinity();
    init = flt ? literal(at, mx ? -inf : inf) : int_literal(mx ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max());
    const std::string cmp = mx ? "b > a" : "b < a";
    comb = flt ? "isnan(a) ? a : ((isnan(b) || " + cmp + ") ? b : a)" : "(" + cmp + ") ? b : a";
  } else {
    return unsupported(n, "op is not supported by the cuda lowering");
  }
  std::string fin = "acc";
  if (op == "reduce_mean") fin = "acc / (" + acc + ")" + int_literal(len);
  // What the kernels read: x, or the operands of the elementwise node that computes x (its only
  // reader is this reduction), computing x's element on each load.
  std::string x_params;
  std::vector<int> x_args;
  std::function<std::string(const std::string&)> load;
  const Node* pro = x->producer() && reduce_prologue_.count(x->producer()) ? x->producer() : nullptr;
  if (pro == nullptr) {
    x_params = "const " + st + "* __restrict__ x, ";
    x_args = {buf(x)};
    load = [&](const std::string& at) { return load_expr(t, "x[" + at + "]"); };
  } else {
    for (int k = 0; k < pro->num_operands(); ++k) {
      const Value* v = pro->operand(k);
      KILN_ASSIGN_OR_RETURN(std::string sk, storage(*pro, v->dtype()));
      x_params += "const " + sk + "* __restrict__ p" + std::to_string(k) + ", ";
      x_args.push_back(buf(v));
    }
    load = [&, pro](const std::string& at) {
      std::vector<std::string> a;
      for (int k = 0; k < pro->num_operands(); ++k) {
        const Value* v = pro->operand(k);
        const bool scalar = product(sizes_of(v)) == 1;
        a.push_back(load_expr(v->dtype(), "p" + std::to_string(k) + "[" + (scalar ? std::string("0") : at) + "]"));
      }
      // defer_to_reduce checked that the expression builds
      return round_expr(t, pro->op_name() == "fused" ? *fused_expr(*pro, a) : *op_expr(*pro, a));
    };
  }
  auto with_x = [&](std::vector<int> rest) {
    rest.insert(rest.begin(), x_args.begin(), x_args.end());
    return rest;
  };
  const int out = activation_for(n.result());
  if (rows == 0) return ok_status();
  // Every kernel below combines two accumulators with this.
  const std::string comb_fn = "auto comb = [](" + acc + " a, " + acc + " b) -> " + acc + " { return " + comb + "; };\n";
  // Blocks that each reduce a chunk of R write f32/f64/i64 partials [splits, rows]; a second
  // kernel combines a row's partials and finishes (mean's division, the store's rounding).
  auto launch_split = [&](const std::string& body, int64_t blocks, int64_t splits) {
    const DType pt = acc == "double" ? DType::kF64 : acc == "float" ? DType::kF32 : DType::kI64;
    const int partial = add_buffer("activation", pt, {splits, rows});
    const std::string name = kernel_name(op);
    add_kernel(name, x_params + acc + "* __restrict__ partial", body);
    launch(name, blocks, with_x({partial}));
    launch_elementwise(kernel_name(op + "_splits"), "const " + acc + "* __restrict__ partial, " + st + "* __restrict__ y",
                       rows,
                       "    " + comb_fn +
                       "    " + acc + " acc = partial[i];\n"
                       "    for (int s = 1; s < " + std::to_string(splits) + "; ++s) acc = comb(acc, partial[s * " +
                           int_literal(rows) + " + i]);\n"
                       "    y[i] = " + store_expr(t, fin) + ";\n",
                       {partial, out});
  };
  std::string body = "  " + comb_fn;
  // Short reductions (a GQA key/value gradient summed over the [B, kv, rep, T, hd] repeat dim:
  // millions of rows of 4) take a thread per output, which walks its few elements itself;
  // neighbouring threads read neighbouring elements when the kept dims end x. A block per row
  // would run one block-wide reduction per handful of loads.
  if (len < kShortReduction) {
    const std::string L = int_literal(len);
    const std::string short_body = "    " + comb_fn + index_code("i", kd, {ks}, {"base"}) + "    " + acc + " acc = " + init +
                                   ";\n    for (long long j = 0; j < " + L + "; ++j) {\n" +
                                   index_code("j", rd, {rs}, {"off"}) + "      acc = comb(acc, (" + acc + ")" +
                                   load("base + off") + ");\n    }\n    y[i] = " + store_expr(t, fin) + ";\n";
    launch_elementwise(kernel_name(op), x_params + st + "* __restrict__ y", rows, short_body, with_x({out}));
    return ok_status();
  }
  // Kept dims after the last reduced one, x viewed as [O, R, I] (a channels-last global pool:
  // [N, H*W, C]; RoPE's table gradient [B, T, heads, hd] summed over B and heads): a warp reads
  // 32 neighbours along I for a row r, the block's 8 warps take every 8th r, and shared memory
  // combines them. A row per block would read I-strided single elements. O and R may interleave
  // (reduced dims between kept ones); then their offsets come from index arithmetic.
  size_t first = xs.size(), last = 0;
  for (size_t d = 0; d < xs.size(); ++d)
    if (mask[d]) first = std::min(first, d), last = d;
  const bool kept_inner = first < xs.size() && last + 1 < xs.size();
  bool contiguous = kept_inner;
  for (size_t d = first; contiguous && d <= last; ++d) contiguous = mask[d];
  const int64_t inner = kept_inner ? product(Sizes(xs.begin() + static_cast<std::ptrdiff_t>(last) + 1, xs.end())) : 1;
  // Sums over every dim but the trailing kept ones: 16-byte column loads (column_reduce.cpp).
  if (pro == nullptr && contiguous && rows == inner && (op == "reduce_sum" || op == "reduce_mean")) {
    KILN_ASSIGN_OR_RETURN(const bool columns, column_sum(n, buf(x), len, inner, fin, out));
    if (columns) return ok_status();
  }
  if (kept_inner && inner >= 8 && len >= 64) {
    const int64_t outer = rows / inner, tiles = (inner + 31) / 32, warps = kBlock / 32;
    // Few outputs (a squeeze-excite pool over [16, 112*112, 32] has 16 tiles) would leave most
    // of the GPU idle with each warp walking thousands of rows: split R into chunks, one block
    // each, whose partials a second kernel combines.
    const int64_t splits = std::clamp<int64_t>(kReduceBlocks / (outer * tiles), 1, len / 64);
    const int64_t chunk = (len + splits - 1) / splits;
    const std::string C = int_literal(chunk), L = int_literal(len), I = int_literal(inner);
    body += "  __shared__ " + acc + " part[" + std::to_string(warps) + "][33];\n";
    body += "  const int lane = threadIdx.x & 31, wrp = threadIdx.x >> 5;\n";
    body += "  for (long long blk = blockIdx.x; blk < " + int_literal(outer * tiles * splits) + "; blk += gridDim.x) {\n";
    body += "    const long long s = blk / " + int_literal(outer * tiles) + ", ot = blk % " + int_literal(outer * tiles) + ";\n";
    body += "    const long long o = ot / " + int_literal(tiles) + ", i = (ot % " + int_literal(tiles) + ") * 32 + lane;\n";
    body += "    const long long r1 = min((s + 1) * " + C + ", " + L + ");\n";
    body += "    " + acc + " acc = " + init + ";\n";
    body += "    if (i < " + I + ") {\n";
    if (contiguous) {
      body += "#pragma unroll 8\n      for (long long r = s * " + C + " + wrp; r < r1; r += " + std::to_string(warps) + ")\n";
      body += "        acc = comb(acc, (" + acc + ")" + load("(o * " + L + " + r) * " + I + " + i") + ");\n";
    } else {
      Sizes od, os;  // the kept dims before the last reduced one, and their strides in x
      for (size_t d = 0; d < last; ++d)
        if (!mask[d]) od.push_back(xs[d]), os.push_back(cs[d]);
      body += "      " + index_code("o", od, {os}, {"base"});
      body += "#pragma unroll 8\n      for (long long r = s * " + C + " + wrp; r < r1; r += " + std::to_string(warps) + ") {\n";
      body += "        " + index_code("r", rd, {rs}, {"off"});
      body += "        acc = comb(acc, (" + acc + ")" + load("base + off + i") + ");\n      }\n";
    }
    body += "    }\n    part[wrp][lane] = acc;\n    __syncthreads();\n";
    body += "    if (wrp == 0 && i < " + I + ") {\n";
    body += "      for (int w = 1; w < " + std::to_string(warps) + "; ++w) acc = comb(acc, part[w][lane]);\n";
    if (splits == 1) {
      body += "      y[o * " + I + " + i] = " + store_expr(t, fin) + ";\n    }\n";
    } else {
      body += "      partial[s * " + int_literal(rows) + " + o * " + I + " + i] = acc;\n    }\n";
    }
    body += "    __syncthreads();\n  }\n";
    if (splits == 1) {
      const std::string name = kernel_name(op);
      add_kernel(name, x_params + st + "* __restrict__ y", body);
      launch(name, outer * tiles, with_x({out}));
      return ok_status();
    }
    launch_split(body, outer * tiles * splits, splits);
    return ok_status();
  }
  // Reduced dims that end x are one contiguous run of `len` elements.
  if (first < xs.size() && last + 1 == xs.size() &&
      std::all_of(mask.begin() + static_cast<std::ptrdiff_t>(first), mask.end(), [](bool m) { return m; }))
    rd = {len}, rs = {1};
  // A block per row. Few long rows (a global norm's sum of squares over a whole weight is one
  // row of millions) would leave the GPU idle behind one block each, so R is split into chunks
  // of at least 4096 elements, a block each, whose partials a second kernel combines. Such a
  // split aims for 4 blocks per SM and each thread keeps 4 loads in flight: with one load per
  // thread and 2 blocks per SM, a 235 MB sum of squares streamed at a fifth of the bandwidth.
  const int64_t splits = std::clamp<int64_t>(2 * kReduceBlocks / rows, 1, std::max<int64_t>(1, len / 4096));
  const int64_t chunk = (len + splits - 1) / splits;
  body += "  for (long long blk = blockIdx.x; blk < " + int_literal(rows * splits) + "; blk += gridDim.x) {\n";
  body += "    const long long row = blk % " + int_literal(rows) + ", s = blk / " + int_literal(rows) + ";\n";
  body += index_code("row", kd, {ks}, {"base"});
  body += "    " + acc + " acc = " + init + ";\n";
  body += "    const long long j1 = min((s + 1) * " + int_literal(chunk) + ", " + int_literal(len) + ");\n";
  body += "#pragma unroll 4\n    for (long long j = s * " + int_literal(chunk) + " + threadIdx.x; j < j1; j += blockDim.x) {\n";
  body += index_code("j", rd, {rs}, {"off"});
  body += "      acc = comb(acc, (" + acc + ")" + load("base + off") + ");\n    }\n";
  body += "    acc = kiln_block_reduce(acc, (" + acc + ")" + init + ", comb);\n";
  if (splits == 1) {
    body += "    if (threadIdx.x == 0) y[row] = " + store_expr(t, fin) + ";\n  }\n";
    const std::string name = kernel_name(op);
    add_kernel(name, x_params + st + "* __restrict__ y", body);
    launch(name, rows, with_x({out}));
    return ok_status();
  }
  body += "    if (threadIdx.x == 0) partial[s * " + int_literal(rows) + " + row] = acc;\n  }\n";
  launch_split(body, rows * splits, splits);
  return ok_status();
}

Status Lowerer::arg_reduce(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_RETURN_IF_ERROR(reg(n, t).status());
  const auto [len, inner, rows] = rows_around_axis(sizes_of(x), n.get_int("axis"));
  const std::string acc = is_float(t) ? (t == DType::kF64 ? "double" : "float") : "long long";
  const bool mx = n.op_name() == "argmax", last = n.get_int("select_last_index") != 0;
  const std::string order = std::string("(c == b ? 0 : ((c > b) == ") + (mx ? "true" : "false") + " ? 1 : -1))";
  const std::string cmp = is_float(t) ? "(isnan(c) || isnan(b)) ? ((int)isnan(c) - (int)isnan(b)) : " + order : order;
  const int out = activation_for(n.result());
  if (rows == 0 || len == 0) return ok_status();
  std::string body = "  auto better = [](" + acc + " c, long long ci, " + acc + " b, long long bi) -> bool {\n"
                     "    if (ci < 0) return false;\n    if (bi < 0) return true;\n"
                     "    const int cmp = " + cmp + ";\n    if (cmp != 0) return cmp > 0;\n"
                     "    return " + (last ? "ci > bi" : "ci < bi") + ";\n  };\n";
  body += "  for (long long row = blockIdx.x; row < " + int_literal(rows) + "; row += gridDim.x) {\n";
  body += "    const long long base = (row / " + int_literal(inner) + ") * " + int_literal(len * inner) +
          " + row % " + int_literal(inner) + ";\n";
  body += "    " + acc + " v = 0; long long vi = -1;\n";
  body += "    for (long long j = threadIdx.x; j < " + int_literal(len) + "; j += blockDim.x) {\n";
  body += "      const " + acc + " c = (" + acc + ")" + load_expr(t, "x[base + j * " + int_literal(inner) + "]") + ";\n";
  body += "      if (better(c, j, v, vi)) { v = c; vi = j; }\n    }\n";
  body += "    kiln_block_argreduce(v, vi, better);\n";
  body += "    if (threadIdx.x == 0) y[row] = vi;\n  }\n";
  const std::string name = kernel_name(n.op_name());
  add_kernel(name, "const " + st + "* __restrict__ x, long long* __restrict__ y", body);
  launch(name, rows, {buf(x), out});
  return ok_status();
}

Status Lowerer::softmax(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_RETURN_IF_ERROR(reg(n, t).status());
  const auto [len, inner, rows] = rows_around_axis(sizes_of(x), n.get_int("axis"));
  const bool dbl = t == DType::kF64;
  const std::string acc = dbl ? "double" : "float", f = dbl ? "" : "f";
  const DType at = dbl ? DType::kF64 : DType::kF32;
  const int out = activation_for(n.result());
  if (rows == 0) return ok_status();
  const std::string at_k = "[base + j * " + int_literal(inner) + "]";
  // One pass for the max and the sum (online softmax: a thread's sum is rescaled whenever its
  // max grows), one for the result: a long row (a vocabulary's logits) is read twice, not three
  // times. -inf elements add nothing; a row of only -inf, a nan or a +inf gives nan, as the
  // three-pass form does (exp(-inf - -inf), exp(nan), exp(inf - inf)).
  const std::string ninf = literal(at, -std::numeric_limits<double>::infinity());
  std::string body = "  auto mx = [](" + acc + " a, " + acc + " b) -> " + acc + " { return b > a ? b : a; };\n";
  body += "  auto sum = [](" + acc + " a, " + acc + " b) -> " + acc + " { return a + b; };\n";
  body += "  for (long long row = blockIdx.x; row < " + int_literal(rows) + "; row += gridDim.x) {\n";
  body += "    const long long base = (row / " + int_literal(inner) + ") * " + int_literal(len * inner) +
          " + row % " + int_literal(inner) + ";\n";
  body += "    " + acc + " mt = " + ninf + ", st = 0;\n";
  body += "    for (long long j = threadIdx.x; j < " + int_literal(len) + "; j += blockDim.x) {\n";
  body += "      const " + acc + " v = " + load_expr(t, "x" + at_k) + ";\n";
  body += "      if (v > mt) { st = st * exp" + f + "(mt - v) + 1; mt = v; }\n";
  body += "      else if (v != " + ninf + ") st += exp" + f + "(v - mt);\n    }\n";
  body += "    const " + acc + " m = kiln_block_reduce(mt, " + ninf + ", mx);\n";
  body += "    " + acc + " s = kiln_block_reduce(mt == " + ninf + " ? st : st * exp" + f + "(mt - m), (" + acc + ")0, sum);\n";
  body += "    if (m == " + literal(at, std::numeric_limits<double>::infinity()) + ") s = " +
          literal(at, std::numeric_limits<double>::quiet_NaN()) + ";\n";
  const std::string val = n.op_name() == "softmax" ? "exp" + f + "(" + load_expr(t, "x" + at_k) + " - m) / s"
                                                   : load_expr(t, "x" + at_k) + " - m - log" + f + "(s)";
  body += "    for (long long j = threadIdx.x; j < " + int_literal(len) + "; j += blockDim.x) y" + at_k + " = " +
          store_expr(t, val) + ";\n  }\n";
  const std::string name = kernel_name(n.op_name());
  add_kernel(name, "const " + st + "* __restrict__ x, " + st + "* __restrict__ y", body);
  launch(name, rows, {buf(x), out});
  return ok_status();
}

Status Lowerer::norm(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_RETURN_IF_ERROR(reg(n, t).status());
  const Sizes xs = sizes_of(x);
  const size_t axis = static_cast<size_t>(norm_axis(n.get_int("axis", -1), static_cast<int64_t>(xs.size())));
  const Sizes trailing(xs.begin() + static_cast<std::ptrdiff_t>(axis), xs.end());
  const int64_t len = product(trailing), rows = len == 0 ? 0 : product(xs) / len;
  const bool rms = n.op_name() == "rms_norm", dbl = t == DType::kF64;
  const std::string acc = dbl ? "double" : "float", f = dbl ? "" : "f";
  const DType at = dbl ? DType::kF64 : DType::kF32;
  std::string params = "const " + st + "* __restrict__ x, ";
  std::vector<int> args = {buf(x)};
  std::vector<std::string> pre;  // per-element parameter reads
  for (int i = 1; i < n.num_operands(); ++i) {
    const Sizes ps = sizes_of(n.operand(i));
    const std::string p = i == 1 ? "scale" : "bias", o = p + "_o";
    params += "const " + st + "* __restrict__ " + p + ", ";
    args.push_back(buf(n.operand(i)));
    std::string code;
    if (ps == trailing || product(ps) == len)
      code = "      const long long " + o + " = j;\n";
    else
      code = index_code("j", trailing, {broadcast_strides(ps, trailing)}, {o});
    pre.push_back(code);
  }
  const int out = activation_for(n.result());
  args.push_back(out);
  if (rows == 0) return ok_status();
  const std::string loop = "    for (long long j = threadIdx.x; j < " + int_literal(len) + "; j += blockDim.x) ";
  std::string body = "  auto sum = [](" + acc + " a, " + acc + " b) -> " + acc + " { return a + b; };\n";
  body += "  for (long long row = blockIdx.x; row < " + int_literal(rows) + "; row += gridDim.x) {\n";
  body += "    const " + std::string(st) + "* xr = x + row * " + int_literal(len) + ";\n";
  body += "    " + acc + " mean = 0;\n";
  if (!rms) {
    body += loop + "mean += " + load_expr(t, "xr[j]") + ";\n";
    body += "    mean = kiln_block_reduce(mean, (" + acc + ")0, sum) / (" + acc + ")" + int_literal(len) + ";\n";
  }
  body += "    " + acc + " sq = 0;\n";
  body += loop + "{ const " + acc + " d = " + load_expr(t, "xr[j]") + " - mean; sq += d * d; }\n";
  body += "    sq = kiln_block_reduce(sq, (" + acc + ")0, sum);\n";
  body += "    const " + acc + " inv = " + literal(at, 1) + " / sqrt" + f + "(sq / (" + acc + ")" + int_literal(len) +
          " + " + literal(at, n.get_float("epsilon")) + ");\n";
  body += loop + "{\n";
  body += "      " + acc + " v = (" + load_expr(t, "xr[j]") + " - mean) * inv;\n";
  if (n.num_operands() > 1) body += pre[0] + "      v *= " + load_expr(t, "scale[scale_o]") + ";\n";
  if (n.num_operands() > 2) body += pre[1] + "      v += " + load_expr(t, "bias[bias_o]") + ";\n";
  body += "      y[row * " + int_literal(len) + " + j] = " + store_expr(t, "v") + ";\n    }\n  }\n";
  const std::string name = kernel_name(n.op_name());
  add_kernel(name, params + st + "* __restrict__ y", body);
  launch(name, rows, args);
  return ok_status();
}

Status Lowerer::batch_norm(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_RETURN_IF_ERROR(reg(n, t).status());
  const Sizes xs = sizes_of(x);
  const int64_t c = xs[1], plane = product(Sizes(xs.begin() + 2, xs.end()));
  const bool dbl = t == DType::kF64;
  const std::string acc = dbl ? "double" : "float", f = dbl ? "" : "f";
  std::string params = "const " + st + "* __restrict__ x, ";
  for (const char* p : {"scale", "bias", "mean", "var"}) params += "const " + st + "* __restrict__ " + std::string(p) + ", ";
  std::vector<int> args;
  for (const Value* v : n.operands()) args.push_back(buf(v));
  const int out = activation_for(n.result());
  args.push_back(out);
  auto ld = [&](const std::string& p) { return load_expr(t, p + "[ch]"); };
  const std::string body = "    const long long ch = (i / " + int_literal(plane) + ") % " + int_literal(c) + ";\n"
                           "    const " + acc + " mul = " + ld("scale") + " / sqrt" + f + "(" + ld("var") + " + " +
                           literal(dbl ? DType::kF64 : DType::kF32, n.get_float("epsilon")) + ");\n"
                           "    y[i] = " + store_expr(t, "(" + load_expr(t, "x[i]") + " - " + ld("mean") + ") * mul + " + ld("bias")) + ";\n";
  if (product(xs) == 0) return ok_status();
  launch_elementwise(kernel_name("batch_norm"), params + st + "* __restrict__ y", product(xs), body, args);
  return ok_status();
}

Status Lowerer::gemm_operand(const Node& n, const Value* v, const Sizes& batch_dims, int64_t rows, int64_t cols,
                             int& id, int64_t& stride) {
  Sizes vs = sizes_of(v);
  const Sizes vb(vs.begin(), vs.end() - std::min<std::ptrdiff_t>(2, static_cast<std::ptrdiff_t>(vs.size())));
  id = buf(v);
  if (product(vb) == product(batch_dims)) {
    stride = rows * cols;
    return ok_status();
  }
  if (product(vb) == 1) {
    stride = 0;
    return ok_status();
  }
  // Partial batch broadcast: cuBLASLt takes one stride per operand, so expand the operand first.
  Sizes full = batch_dims;
  full.push_back(rows);
  full.push_back(cols);
  Sizes src = vb;
  src.push_back(rows);
  src.push_back(cols);
  const int tmp = add_buffer("activation", v->dtype(), full, "");
  KILN_RETURN_IF_ERROR(gather_view(n, id, tmp, full, broadcast_strides(src, full), 0));
  id = tmp;
  stride = rows * cols;
  return ok_status();
}

std::string fmt_float(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

Status Lowerer::matmul(const Node& n) {
  KILN_ASSIGN_OR_RETURN(const bool gemv, small_m_gemm(n));
  if (gemv) return ok_status();
  const DType t = n.result()->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return unsupported_dtype(n, t);
  Sizes as = sizes_of(n.operand(0)), bs = sizes_of(n.operand(1));
  if (as.size() == 1) as.insert(as.begin(), 1);
  if (bs.size() == 1) bs.push_back(1);
  const int64_t m = as[as.size() - 2], k = as.back(), nn = bs.back();
  const Sizes ys = sizes_of(n.result());
  const int64_t batch = m * nn == 0 ? 0 : product(ys) / (m * nn);
  Sizes bdims;
  {
    const Sizes ab(as.begin(), as.end() - 2), bb(bs.begin(), bs.end() - 2);
    const size_t r = std::max(ab.size(), bb.size());
    for (size_t d = 0; d < r; ++d) {
      const int64_t x = d + ab.size() >= r ? ab[d + ab.size() - r] : 1;
      const int64_t y = d + bb.size() >= r ? bb[d + bb.size() - r] : 1;
      bdims.push_back(x == 1 ? y : x);
    }
  }
  const int out = activation_for(n.result());
  note_dtype(t);
  if (product(ys) == 0) return ok_status();
  if (k == 0) {
    steps_.push_back({"step memset dst=b" + std::to_string(out) + " bytes=" + std::to_string(bufs_[out].bytes), {out}});
    return ok_status();
  }
  // A 1-D operand reshaped to a matrix keeps its bytes, so its buffer serves as is.
  int a_id, b_id;
  int64_t sa, sb;
  {
    // gemm_operand reads the operand's own shape; promote 1-D shapes through the batch test.
    const Value* av = n.operand(0);
    const Value* bv = n.operand(1);
    KILN_RETURN_IF_ERROR(gemm_operand(n, av, bdims, m, k, a_id, sa));
    KILN_RETURN_IF_ERROR(gemm_operand(n, bv, bdims, k, nn, b_id, sb));
  }
  gemm_ = true;
  const std::string dt = dname(t);
  const std::string compute = t == DType::kF32 && opts_.allow_tf32 ? "tf32" : "f32";
  // Operands that are folded transposes of their last two dims are read transposed.
  const bool ta = transposed_.count(n.operand(0)) > 0, tb = transposed_.count(n.operand(1)) > 0;
  // A weight shared by every batch (stride 0) over a contiguous A is one GEMM of batch * m
  // rows: cuBLASLt picks far better tiles for one tall GEMM than for many short ones (a
  // ConvNeXt Linear over [N, H, W, C] is M = N*H*W, not N*H GEMMs of M = W), and a bias add
  // can become the epilogue. D and a residual C are contiguous, so they fold the same way.
  const bool fold = batch > 1 && sb == 0 && sa == m * k && !ta;
  GemmEpilogue ep = gemm_epilogue(n.result(), out, false, batch == 1 || fold);
  take_bias_grad(n, ep, fold ? m * batch : m, nn, k, fold ? 1 : batch);
  const std::string epilogue = ep.epilogue;
  std::vector<int> used = {a_id, b_id, out};
  used.insert(used.end(), ep.used.begin(), ep.used.end());
  steps_.push_back({"step gemm a=b" + std::to_string(a_id) + " b=b" + std::to_string(b_id) + " d=b" + std::to_string(out) +
                        ep.extra + " m=" + std::to_string(fold ? m * batch : m) + " n=" + std::to_string(nn) + " k=" + std::to_string(k) +
                        " batch=" + std::to_string(fold ? 1 : batch) + " trans_a=" + (ta ? "1" : "0") + " trans_b=" + (tb ? "1" : "0") + " lda=" + std::to_string(ta ? m : k) +
                        " ldb=" + std::to_string(tb ? k : nn) + " ldd=" + std::to_string(nn) + " stride_a=" + std::to_string(sa) +
                        " stride_b=" + std::to_string(sb) + " stride_d=" + std::to_string(m * nn) + " dtype=" + dt +
                        " compute=" + compute + " alpha=" + fmt_float(1) + " beta=" + fmt_float(ep.beta) +
                        " epilogue=" + epilogue,
                    used});
  return ok_status();
}

Status Lowerer::linear(const Node& n) {
  KILN_ASSIGN_OR_RETURN(const bool gemv, small_m_gemm(n));
  if (gemv) return ok_status();
  const DType t = n.result()->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return unsupported_dtype(n, t);
  const Sizes ws = sizes_of(n.operand(1));
  const int64_t nn = ws[0], k = ws[1];
  const int64_t m = nn == 0 ? 0 : product(sizes_of(n.result())) / nn;
  const bool bias = n.num_operands() == 3;
  const int out = activation_for(n.result());
  note_dtype(t);
  if (m * nn == 0) return ok_status();
  if (k == 0) {
    if (!bias) {
      steps_.push_back({"step memset dst=b" + std::to_string(out) + " bytes=" + std::to_string(bufs_[out].bytes), {out}});
      return ok_status();
    }
    return gather_view(n, buf(n.operand(2)), out, {m, nn}, {0, 1}, 0);
  }
  gemm_ = true;
  const int a = buf(n.operand(0)), b = buf(n.operand(1));
  std::string text = "step gemm a=b" + std::to_string(a) + " b=b" + std::to_string(b) + " d=b" + std::to_string(out);
  std::vector<int> used = {a, b, out};
  if (bias) {
    text += " bias=b" + std::to_string(buf(n.operand(2)));
    used.push_back(buf(n.operand(2)));
  }
  const std::string compute = t == DType::kF32 && opts_.allow_tf32 ? "tf32" : "f32";
  const GemmEpilogue ep = gemm_epilogue(n.result(), out, bias, true);
  const std::string& epilogue = ep.epilogue;
  used.insert(used.end(), ep.used.begin(), ep.used.end());
  text += ep.extra + " m=" + std::to_string(m) + " n=" + std::to_string(nn) + " k=" + std::to_string(k) +
          " batch=1 trans_a=0 trans_b=1 lda=" + std::to_string(k) + " ldb=" + std::to_string(k) +
          " ldd=" + std::to_string(nn) + " stride_a=" + std::to_string(m * k) + " stride_b=0 stride_d=" +
          std::to_string(m * nn) + " dtype=" + dname(t) + " compute=" + compute + " alpha=" + fmt_float(1) +
          " beta=" + fmt_float(ep.beta) + " epilogue=" + epilogue;
  steps_.push_back({text, used});
  return ok_status();
}

Status Lowerer::matmul_acc(const Node& n) {
  const Value *a = n.operand(0), *b = n.operand(1), *c = n.operand(2);
  const DType t = n.result()->dtype(), ab = a->dtype();
  for (DType d : {t, ab})
    if (d != DType::kF32 && d != DType::kF16 && d != DType::kBF16) return unsupported_dtype(n, d);
  const Sizes as = sizes_of(a), bs = sizes_of(b);
  const bool ta = transposed_.count(a) > 0, tb = transposed_.count(b) > 0;
  const int64_t m = as[0], k = as[1], nn = bs[1];
  note_dtype(t);
  note_dtype(ab);
  // In place: cuBLASLt takes D = C when they share a layout, so a sum nothing else reads is
  // overwritten instead of held next to its successor.
  const int cid = buf(c);
  const std::vector<Value*>& outs = c->producer() ? c->producer()->graph()->outputs() : std::vector<Value*>{};
  const bool in_place = c->uses().size() == 1 && bufs_[cid].kind == "activation" && !transposed_.count(c) &&
                        std::find(outs.begin(), outs.end(), c) == outs.end();
  int out;
  if (in_place) {
    out = cid;
    val_[n.result()] = out;
    if (!n.result()->name().empty()) bufs_[out].name = n.result()->name();
  } else {
    out = activation_for(n.result());
  }
  if (m * nn == 0) return ok_status();
  if (k == 0) {
    if (!in_place)
      steps_.push_back({"step copy src=b" + std::to_string(cid) + " dst=b" + std::to_string(out) + " bytes=" +
                            std::to_string(bufs_[out].bytes),
                        {cid, out}});
    return ok_status();
  }
  gemm_ = true;
  const int a_id = buf(a), b_id = buf(b);
  const std::string mixed = ab == t ? "" : " a_dtype=" + dname(ab) + " b_dtype=" + dname(ab);
  steps_.push_back({"step gemm a=b" + std::to_string(a_id) + " b=b" + std::to_string(b_id) + " d=b" + std::to_string(out) +
                        " c=b" + std::to_string(cid) + " ldc=" + std::to_string(nn) + " m=" + std::to_string(m) +
                        " n=" + std::to_string(nn) + " k=" + std::to_string(k) + " batch=1 trans_a=" + (ta ? "1" : "0") +
                        " trans_b=" + (tb ? "1" : "0") + " lda=" + std::to_string(ta ? m : k) +
                        " ldb=" + std::to_string(tb ? k : nn) + " ldd=" + std::to_string(nn) +
                        " stride_a=0 stride_b=0 stride_d=0 dtype=" + dname(t) + mixed +
                        " compute=" + (ab == DType::kF32 && opts_.allow_tf32 ? "tf32" : "f32") +
                        " alpha=1 beta=1 epilogue=none",
                    {a_id, b_id, out, cid}});
  return ok_status();
}

/// Whether a conv goes through im2col and cuBLASLt: 1-D and 2-D float convs with few groups
/// whose column buffer stays within kColLimitBytes.
bool conv_as_gemm(const Node& n) {
  const DType t = n.operand(0)->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
  const Sizes xs = sizes_of(n.operand(0)), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  if (xs.size() != 3 && xs.size() != 4) return false;
  const int64_t groups = n.get_int("groups", 1);
  if (groups < 1 || groups > kMaxGemmGroups || product(ys) == 0 || xs[1] == 0) return false;
  const int64_t taps = product(Sizes(ws.begin() + 2, ws.end())), plane = product(Sizes(ys.begin() + 2, ys.end()));
  if (taps == 0) return false;
  return dtype_storage_bytes(t, xs[0] * xs[1] * taps * plane) <= kColLimitBytes;
}

// conv as GEMMs: col[N][C*taps][P] = im2col(x), then per group g and sample n
// y_n[g rows] = W_g[C_out/g, K] @ col_n[g rows of K, P] with K = C/g * taps, P = output pixels,
// which is NCHW directly. The bias is broadcast into y first and the GEMM accumulates onto it
// (beta 1), so f16/bf16 results are rounded once, as the reference does; cuBLASLt's bias
// epilogue adds per column, which is per pixel in this layout. A relu user becomes the epilogue.
Status Lowerer::conv_gemm(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  const Sizes xs = sizes_of(x), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  const size_t nsp = xs.size() - 2;
  const Window win = window_of(n, nsp);
  const Sizes &strides = win.strides, &pads = win.pads, &dil = win.dilations;
  const int64_t groups = n.get_int("groups", 1);
  const int64_t batch = xs[0], cin = xs[1], cout = ws[0], cg_out = cout / groups;
  const Sizes in_sp(xs.begin() + 2, xs.end()), k_sp(ws.begin() + 2, ws.end()), out_sp(ys.begin() + 2, ys.end());
  const Sizes in_st = contiguous_strides(in_sp);
  const int64_t taps = product(k_sp), plane = product(out_sp), kdim = cin / groups * taps;
  const int out = activation_for(n.result());
  note_dtype(t);

  // A 1x1 kernel with unit strides and no padding needs no im2col: x[n] already is [C, P].
  bool pointwise_kernel = true;
  for (size_t d = 0; d < nsp; ++d)
    pointwise_kernel &= k_sp[d] == 1 && strides[d] == 1 && pads[d] == 0 && pads[nsp + d] == 0;
  int col = buf(x);
  if (!pointwise_kernel) {
    col = add_buffer("activation", t, {batch, cin * taps, plane});
    // 32-bit unsigned index arithmetic where the column buffer allows: 64-bit division is slow.
    const bool narrow = batch * cin * taps * plane <= int64_t{0xffffffff};
    auto lit = [&](int64_t v) { return narrow ? std::to_string(v) + "u" : int_literal(v); };
    std::string body = narrow ? "    unsigned r_ = (unsigned)i;\n" : "    long long r_ = i;\n";
    for (size_t d = nsp; d-- > 0;)
      body += "    const long long o" + std::to_string(d) + " = r_ % " + lit(out_sp[d]) + "; r_ /= " +
              lit(out_sp[d]) + ";\n";
    for (size_t d = nsp; d-- > 0;)
      body += "    const long long k" + std::to_string(d) + " = r_ % " + lit(k_sp[d]) + "; r_ /= " +
              lit(k_sp[d]) + ";\n";
    // r_ is now n * C + c: the input plane to read.
    std::string outside, off = "r_ * " + int_literal(product(in_sp));
    for (size_t d = 0; d < nsp; ++d) {
      const std::string D = std::to_string(d);
      body += "    const long long p" + D + " = o" + D + " * " + int_literal(strides[d]) + " - " + int_literal(pads[d]) +
              " + k" + D + " * " + int_literal(dil[d]) + ";\n";
      outside += (d ? " || p" : "p") + D + " < 0 || p" + D + " >= " + int_literal(in_sp[d]);
      off += " + p" + D + " * " + int_literal(in_st[d]);
    }
    body += "    y[i] = (" + outside + ") ? " + st + "() : x[" + off + "];\n";
    launch_elementwise(kernel_name("im2col"), "const " + st + "* __restrict__ x, " + st + "* __restrict__ y",
                       batch * cin * taps * plane, body, {buf(x), col});
  }
  const bool bias = n.num_operands() == 3;
  if (bias)
    launch_elementwise(kernel_name("conv_bias"), "const " + st + "* __restrict__ b, " + st + "* __restrict__ y",
                       product(ys), "    y[i] = b[(i / " + int_literal(plane) + ") % " + int_literal(cout) + "];\n",
                       {buf(n.operand(2)), out});
  const std::string act = sole_activation(n.result(), false);
  if (!act.empty()) absorb_user(n.result(), out);
  gemm_ = true;
  const std::string compute = t == DType::kF32 && opts_.allow_tf32_conv ? "tf32" : "f32";
  const int w = buf(n.operand(1));
  for (int64_t g = 0; g < groups; ++g) {
    // Group g: rows g*C_out/g.. of W and y, rows g*K.. of each sample's columns.
    const int a = groups == 1 ? w : view(w, g * cg_out * kdim, cg_out * kdim);
    const int b = groups == 1 ? col : view(col, g * kdim * plane, ((batch - 1) * groups + 1) * kdim * plane);
    const int d = groups == 1 ? out : view(out, g * cg_out * plane, ((batch - 1) * cout + cg_out) * plane);
    steps_.push_back({"step gemm a=b" + std::to_string(a) + " b=b" + std::to_string(b) + " d=b" + std::to_string(d) +
                          " m=" + std::to_string(cg_out) + " n=" + std::to_string(plane) + " k=" + std::to_string(kdim) +
                          " batch=" + std::to_string(batch) + " trans_a=0 trans_b=0 lda=" + std::to_string(kdim) +
                          " ldb=" + std::to_string(plane) + " ldd=" + std::to_string(plane) +
                          " stride_a=0 stride_b=" + std::to_string(cin * taps * plane) +
                          " stride_d=" + std::to_string(cout * plane) + " dtype=" + dname(t) + " compute=" + compute +
                          " alpha=" + fmt_float(1) + " beta=" + fmt_float(bias ? 1 : 0) +
                          " epilogue=" + (act.empty() ? "none" : act),
                      {a, b, d}});
  }
  return ok_status();
}

Status Lowerer::conv(const Node& n) {
  if (n.get_string("layout", "nchw") == "nhwc") {
    // Channels-last convs (the layout-nhwc pass): depthwise ones through the generated kernel,
    // the rest through cuDNN.
    const ConvPrologue* prologue = nullptr;
    if (auto it = prologue_.find(&n); it != prologue_.end()) prologue = &it->second;
    KILN_ASSIGN_OR_RETURN(const bool depthwise, conv_depthwise_nhwc(n, prologue));
    if (depthwise) return ok_status();
    // The kernel declined: the deferred pointwise node gets its own kernel after all.
    if (prologue != nullptr) KILN_RETURN_IF_ERROR(lower_node(*prologue->node));
    KILN_ASSIGN_OR_RETURN(const bool cudnn, conv_cudnn(n));
    if (cudnn) return ok_status();
    return invalid_argument("conv " + n.result()->type().str() + ": layout=\"nhwc\" runs through cuDNN (or the " +
                            "depthwise kernel) only, and " +
                            (opts_.conv != "cudnn" ? std::string("the backend option conv is '") + opts_.conv + "'"
                                                   : std::string("cuDNN cannot take this conv (dtype, asymmetric padding or size)")) +
                            "; drop the layout-nhwc pass for it");
  }
  KILN_ASSIGN_OR_RETURN(const bool stem, conv_stem(n));
  if (stem) return ok_status();
  KILN_ASSIGN_OR_RETURN(const bool depthwise, conv_depthwise(n));
  if (depthwise) return ok_status();
  KILN_ASSIGN_OR_RETURN(const bool pointwise_gemm, conv_1x1(n));
  if (pointwise_gemm) return ok_status();
  KILN_ASSIGN_OR_RETURN(const bool cudnn, conv_cudnn(n));
  if (cudnn) return ok_status();
  if (conv_as_gemm(n)) return conv_gemm(n);
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_RETURN_IF_ERROR(reg(n, t).status());
  const Sizes xs = sizes_of(x), ws = sizes_of(n.operand(1)), ys = sizes_of(n.result());
  const size_t nsp = xs.size() - 2;
  const Window win = window_of(n, nsp);
  const Sizes &strides = win.strides, &pads = win.pads, &dil = win.dilations;
  const int64_t groups = n.get_int("groups", 1);
  const int64_t cin = xs[1], cout = ws[0], cg_in = cin / groups, cg_out = cout / groups;
  const Sizes in_sp(xs.begin() + 2, xs.end()), k_sp(ws.begin() + 2, ws.end()), out_sp(ys.begin() + 2, ys.end());
  const Sizes in_st = contiguous_strides(in_sp);
  const std::string acc = acc_type(t);
  const bool bias = n.num_operands() == 3;
  std::vector<int> args = {buf(x), buf(n.operand(1))};
  if (bias) args.push_back(buf(n.operand(2)));
  const int out = activation_for(n.result());
  args.push_back(out);
  std::string body = "    long long r_ = i;\n";
  for (size_t d = nsp; d-- > 0;)
    body += "    const long long o" + std::to_string(d) + " = r_ % " + int_literal(out_sp[d]) + "; r_ /= " + int_literal(out_sp[d]) + ";\n";
  body += "    const long long oc = r_ % " + int_literal(cout) + ", nb = r_ / " + int_literal(cout) + ";\n";
  body += "    const long long g = oc / " + int_literal(cg_out) + ";\n";
  body += "    " + acc + " acc = " + (bias ? "(" + acc + ")" + load_expr(t, "b[oc]") : "0") + ";\n";
  body += "    for (long long ic = 0; ic < " + int_literal(cg_in) + "; ++ic) {\n";
  body += "      const " + st + "* xp = x + (nb * " + int_literal(cin) + " + g * " + int_literal(cg_in) + " + ic) * " +
          int_literal(product(in_sp)) + ";\n";
  body += "      const " + st + "* wp = w + (oc * " + int_literal(cg_in) + " + ic) * " + int_literal(product(k_sp)) + ";\n";
  std::string xoff = "0", woff = "0";
  for (size_t d = 0; d < nsp; ++d) {
    const std::string D = std::to_string(d);
    body += std::string(6 + 2 * d, ' ') + "for (long long k" + D + " = 0; k" + D + " < " + int_literal(k_sp[d]) + "; ++k" + D +
            ") {\n";
    body += std::string(8 + 2 * d, ' ') + "const long long p" + D + " = o" + D + " * " + int_literal(strides[d]) + " - " +
            int_literal(pads[d]) + " + k" + D + " * " + int_literal(dil[d]) + ";\n";
    body += std::string(8 + 2 * d, ' ') + "if (p" + D + " < 0 || p" + D + " >= " + int_literal(in_sp[d]) + ") continue;\n";
    xoff += " + p" + D + " * " + int_literal(in_st[d]);
    woff = "(" + woff + ") * " + int_literal(k_sp[d]) + " + k" + D;
  }
  body += std::string(6 + 2 * nsp, ' ') + "acc += (" + acc + ")" + load_expr(t, "xp[" + xoff + "]") + " * (" + acc + ")" +
          load_expr(t, "wp[" + woff + "]") + ";\n";
  for (size_t d = nsp; d-- > 0;) body += std::string(6 + 2 * d, ' ') + "}\n";
  body += "    }\n    y[i] = " + store_expr(t, "acc") + ";\n";
  std::string params = "const " + st + "* __restrict__ x, const " + st + "* __restrict__ w, ";
  if (bias) params += "const " + st + "* __restrict__ b, ";
  if (product(ys) == 0) return ok_status();
  launch_elementwise(kernel_name("conv"), params + st + "* __restrict__ y", product(ys), body, args);
  return ok_status();
}

Status Lowerer::pool(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_RETURN_IF_ERROR(reg(n, t).status());
  const bool mx = n.op_name() == "max_pool";
  const Sizes xs = sizes_of(x), ys = sizes_of(n.result());
  const size_t nsp = xs.size() - 2;
  const Sizes kernel = n.get_ints("kernel_shape");
  const Window win = window_of(n, nsp, mx);
  const Sizes &strides = win.strides, &pads = win.pads, &dil = win.dilations;
  const Sizes in_sp(xs.begin() + 2, xs.end()), out_sp(ys.begin() + 2, ys.end());
  const Sizes in_st = contiguous_strides(in_sp);
  const std::string acc = acc_type(t);
  const bool include_pad = n.get_int("count_include_pad", 0) == 1;
  std::string init = "0";
  if (mx) {
    if (is_float(t)) {
      init = literal(t == DType::kF64 ? DType::kF64 : DType::kF32, -std::numeric_limits<double>::infinity());
    } else {
      const int bits = dtype_bits(t);
      init = t == DType::kU8 ? "0LL" : (t == DType::kI64 ? int_literal(std::numeric_limits<int64_t>::min()) : int_literal(-(int64_t{1} << (bits - 1))));
    }
  }
  std::string body = "    long long r_ = i;\n";
  for (size_t d = nsp; d-- > 0;)
    body += "    const long long o" + std::to_string(d) + " = r_ % " + int_literal(out_sp[d]) + "; r_ /= " + int_literal(out_sp[d]) + ";\n";
  body += "    const " + st + "* xp = x + r_ * " + int_literal(product(in_sp)) + ";\n";
  body += "    " + acc + " acc = " + init + "; long long valid = 0, padded = 1;\n";
  std::string xoff = "0";
  for (size_t d = 0; d < nsp; ++d) {
    const std::string D = std::to_string(d);
    body += "    { const long long s = o" + D + " * " + int_literal(strides[d]) + " - " + int_literal(pads[d]) +
            "; const long long e = s + " + int_literal(kernel[d]) + ", lim = " + int_literal(in_sp[d] + pads[nsp + d]) +
            "; padded *= (e < lim ? e : lim) - s; }\n";
  }
  for (size_t d = 0; d < nsp; ++d) {
    const std::string D = std::to_string(d);
    body += std::string(4 + 2 * d, ' ') + "for (long long k" + D + " = 0; k" + D + " < " + int_literal(kernel[d]) + "; ++k" + D + ") {\n";
    body += std::string(6 + 2 * d, ' ') + "const long long p" + D + " = o" + D + " * " + int_literal(strides[d]) + " - " +
            int_literal(pads[d]) + " + k" + D + " * " + int_literal(dil[d]) + ";\n";
    body += std::string(6 + 2 * d, ' ') + "if (p" + D + " < 0 || p" + D + " >= " + int_literal(in_sp[d]) + ") continue;\n";
    xoff += " + p" + D + " * " + int_literal(in_st[d]);
  }
  const std::string pad_in(4 + 2 * nsp, ' ');
  body += pad_in + "const " + acc + " v = (" + acc + ")" + load_expr(t, "xp[" + xoff + "]") + ";\n";
  body += pad_in + (mx ? "if (v > acc || v != v) acc = v;\n" : "acc += v;\n") + pad_in + "++valid;\n";
  for (size_t d = nsp; d-- > 0;) body += std::string(4 + 2 * d, ' ') + "}\n";
  if (!mx) body += "    (void)valid; (void)padded;\n    acc = acc / (" + acc + ")" + (include_pad ? "padded" : "valid") + ";\n";
  body += "    y[i] = " + store_expr(t, "acc") + ";\n";
  const int out = activation_for(n.result());
  if (product(ys) == 0) return ok_status();
  launch_elementwise(kernel_name(n.op_name()), "const " + st + "* __restrict__ x, " + st + "* __restrict__ y", product(ys),
                     body, {buf(x), out});
  return ok_status();
}

Status Lowerer::gather(const Node& n) {
  const Value* data = n.operand(0);
  const Value* idx = n.operand(1);
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, data->dtype()));
  KILN_ASSIGN_OR_RETURN(std::string it, storage(n, idx->dtype()));
  const Sizes ds = sizes_of(data);
  const size_t axis = static_cast<size_t>(norm_axis(n.get_int("axis", 0), static_cast<int64_t>(ds.size())));
  const int64_t dim = ds[axis], inner = product(Sizes(ds.begin() + static_cast<std::ptrdiff_t>(axis) + 1, ds.end()));
  const int64_t cnt = product(sizes_of(idx));
  const int out = activation_for(n.result());
  const int64_t total = product(sizes_of(n.result()));
  if (total == 0) return ok_status();
  // Out-of-range indices cannot raise an error on the device; they read zeros.
  const std::string body = "    const long long o = i / " + int_literal(cnt * inner) + ", j = (i / " + int_literal(inner) +
                           ") % " + int_literal(cnt) + ", k = i % " + int_literal(inner) + ";\n"
                           "    long long ix = (long long)ind[j];\n    if (ix < 0) ix += " + int_literal(dim) + ";\n"
                           "    y[i] = (ix < 0 || ix >= " + int_literal(dim) + ") ? " + st + "() : x[(o * " + int_literal(dim) +
                           " + ix) * " + int_literal(inner) + " + k];\n";
  launch_elementwise(kernel_name("gather"), "const " + st + "* __restrict__ x, const " + it + "* __restrict__ ind, " + st +
                     "* __restrict__ y", total, body, {buf(data), buf(idx), out});
  return ok_status();
}

bool Lowerer::zeros_for_scatter(const Value* v) const {
  if (!is_all_zeros(v) || !v->has_uses()) return false;
  const std::vector<Value*>& outs = v->graph()->outputs();
  if (std::find(outs.begin(), outs.end(), v) != outs.end()) return false;
  for (const Use& u : v->uses())
    if (!u.user || u.user->op_name() != "scatter_add" || u.index != 0) return false;
  return true;
}

Status Lowerer::scatter_add(const Node& n) {
  const Value *data = n.operand(0), *idx = n.operand(1), *upd = n.operand(2);
  const DType t = data->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  KILN_ASSIGN_OR_RETURN(std::string it, storage(n, idx->dtype()));
  if (!is_float(t) && t != DType::kI32 && t != DType::kI64)
    return unsupported(n, "scatter_add of " + std::string(dtype_name(t)) + " (float, i32 or i64 only)");
  const Sizes ds = sizes_of(data);
  const size_t axis = static_cast<size_t>(norm_axis(n.get_int("axis", 0), static_cast<int64_t>(ds.size())));
  const int64_t dim = ds[axis], inner = product(Sizes(ds.begin() + static_cast<std::ptrdiff_t>(axis) + 1, ds.end()));
  const int64_t cnt = product(sizes_of(idx)), total = product(sizes_of(upd));
  const int out = activation_for(n.result());
  const int64_t bytes = dtype_storage_bytes(t, product(ds));
  if (bytes == 0) return ok_status();
  if (is_all_zeros(data)) {
    steps_.push_back({"step memset dst=b" + std::to_string(out) + " bytes=" + std::to_string(bytes), {out}});
  } else {
    const int src = buf(data);
    steps_.push_back({"step copy src=b" + std::to_string(src) + " dst=b" + std::to_string(out) + " bytes=" +
                          std::to_string(bytes),
                      {src, out}});
  }
  if (total == 0) return ok_status();
  // Repeated indices accumulate through atomics (so the sum's order, and its last bits in
  // floating point, may differ between runs). Out-of-range indices, which cannot raise an error
  // on the device, add nothing.
  const std::string target = t == DType::kI64 ? "(unsigned long long*)&y[dst], (unsigned long long)u[i]" : "&y[dst], u[i]";
  const std::string body = "    const long long o = i / " + int_literal(cnt * inner) + ", j = (i / " + int_literal(inner) +
                           ") % " + int_literal(cnt) + ", k = i % " + int_literal(inner) + ";\n"
                           "    long long ix = (long long)ind[j];\n    if (ix < 0) ix += " + int_literal(dim) + ";\n"
                           "    if (ix >= 0 && ix < " + int_literal(dim) + ") {\n"
                           "      const long long dst = (o * " + int_literal(dim) + " + ix) * " + int_literal(inner) + " + k;\n"
                           "      atomicAdd(" + target + ");\n    }\n";
  launch_elementwise(kernel_name("scatter_add"), "const " + it + "* __restrict__ ind, const " + st + "* __restrict__ u, " + st +
                     "* __restrict__ y", total, body, {buf(idx), buf(upd), out});
  return ok_status();
}

Status Lowerer::pad(const Node& n) {
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  KILN_ASSIGN_OR_RETURN(std::string st, storage(n, t));
  const std::string mode = n.get_string("mode", "constant");
  if (mode == "constant") KILN_RETURN_IF_ERROR(reg(n, t).status());
  const Sizes xs = sizes_of(x), ys = sizes_of(n.result()), pads = n.get_ints("pads");
  const size_t r = xs.size();
  const Sizes xst = contiguous_strides(xs);
  std::string body = "    long long r_ = i, off = 0; bool fill = false;\n";
  for (size_t d = r; d-- > 0;) {
    const std::string N = int_literal(xs[d]);
    body += "    { long long s = r_ % " + int_literal(ys[d]) + " - " + int_literal(pads[d]) + "; r_ /= " + int_literal(ys[d]) + ";\n";
    if (mode == "constant")
      body += "      if (s < 0 || s >= " + N + ") fill = true;\n";
    else if (mode == "edge")
      body += "      s = s < 0 ? 0 : (s >= " + N + " ? " + N + " - 1 : s);\n";
    else
      body += "      if (s < 0) s = -s; else if (s >= " + N + ") s = 2 * (" + N + " - 1) - s;\n";
    body += "      off += s * " + int_literal(xst[d]) + "; }\n";
  }
  const std::string fillv = mode == "constant" ? store_expr(t, literal(t, n.get_float("value", 0.0))) : st + "()";
  body += "    y[i] = fill ? " + fillv + " : x[off];\n";
  const int out = activation_for(n.result());
  if (product(ys) == 0) return ok_status();
  launch_elementwise(kernel_name("pad"), "const " + st + "* __restrict__ x, " + st + "* __restrict__ y", product(ys), body,
                     {buf(x), out});
  return ok_status();
}

namespace {

/// One arena buffer to place: its aligned size and the steps it is live over (inclusive).
struct Interval {
  int id;
  int64_t size;
  int first, last;
};

/// First fit in allocation order: each buffer, as its first step comes, at the lowest offset
/// free at that moment. Returns the arena size; `offset` gets each buffer's offset.
int64_t first_fit(const std::vector<Interval>& bufs, int steps, std::vector<int64_t>& offset) {
  std::vector<std::vector<size_t>> alloc_at(static_cast<size_t>(steps + 2)), free_at(static_cast<size_t>(steps + 2));
  for (size_t i = 0; i < bufs.size(); ++i) {
    alloc_at[static_cast<size_t>(bufs[i].first + 1)].push_back(i);
    free_at[static_cast<size_t>(bufs[i].last + 1)].push_back(i);
  }
  std::vector<std::pair<int64_t, int64_t>> live;  // (offset, size), sorted by offset
  int64_t arena = 0;
  for (size_t t = 0; t < alloc_at.size(); ++t) {
    for (size_t i : alloc_at[t]) {
      const int64_t size = bufs[i].size;
      int64_t at = 0;
      auto it = live.begin();
      for (; it != live.end(); ++it) {
        if (it->first - at >= size) break;
        at = std::max(at, align_up(it->first + it->second));
      }
      offset[i] = at;
      if (size > 0) live.insert(it, {at, size});
      arena = std::max(arena, at + size);
    }
    for (size_t i : free_at[t]) {
      auto it = std::find_if(live.begin(), live.end(), [&](const auto& p) { return p.first == offset[i] && p.second > 0; });
      if (bufs[i].size > 0 && it != live.end()) live.erase(it);
    }
  }
  return arena;
}

/// Greedy by size (TFLite's arena planner): the largest buffers first, each in the smallest gap
/// between the buffers already placed whose lifetimes overlap its own. Usually closer to the
/// peak of live bytes than first fit when a few large buffers come and go.
int64_t greedy_by_size(const std::vector<Interval>& bufs, std::vector<int64_t>& offset) {
  std::vector<size_t> order(bufs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return bufs[a].size != bufs[b].size ? bufs[a].size > bufs[b].size : bufs[a].first < bufs[b].first;
  });
  std::vector<size_t> placed;
  int64_t arena = 0;
  std::vector<std::pair<int64_t, int64_t>> busy;
  for (size_t i : order) {
    const Interval& b = bufs[i];
    busy.clear();
    for (size_t j : placed)
      if (bufs[j].first <= b.last && b.first <= bufs[j].last) busy.push_back({offset[j], bufs[j].size});
    std::sort(busy.begin(), busy.end());
    int64_t at = 0, best = -1, best_gap = std::numeric_limits<int64_t>::max();
    for (const auto& [off, size] : busy) {
      if (off - at >= b.size && off - at < best_gap) best = at, best_gap = off - at;
      at = std::max(at, align_up(off + size));
    }
    offset[i] = best >= 0 ? best : at;
    arena = std::max(arena, offset[i] + b.size);
    if (b.size > 0) placed.push_back(i);
  }
  return arena;
}

}  // namespace

int64_t Lowerer::plan_memory() {
  const int last_step = static_cast<int>(steps_.size());
  std::vector<int> first(bufs_.size(), std::numeric_limits<int>::max()), last(bufs_.size(), -2);
  for (int s = 0; s < last_step; ++s)
    for (int b : steps_[static_cast<size_t>(s)].buffers) {
      const int r = root(b);
      first[r] = std::min(first[r], s);
      last[r] = std::max(last[r], s);
    }
  std::vector<Interval> arena_bufs;
  for (size_t b = 0; b < bufs_.size(); ++b) {
    const std::string& k = bufs_[b].kind;
    if (k != "input" && k != "output" && k != "activation") continue;
    int f = k == "input" ? -1 : first[b];
    int l = k == "output" ? last_step : last[b];
    if (f == std::numeric_limits<int>::max()) f = -1;
    l = std::max(l, f);
    arena_bufs.push_back({static_cast<int>(b), align_up(bufs_[b].bytes), f, l});
  }
  // Both placements, the smaller arena wins (first fit on a tie: the plans before stay as they were).
  std::vector<int64_t> fit(arena_bufs.size()), greedy(arena_bufs.size());
  const int64_t by_fit = first_fit(arena_bufs, last_step, fit);
  const int64_t by_size = greedy_by_size(arena_bufs, greedy);
  const std::vector<int64_t>& offset = by_size < by_fit ? greedy : fit;
  for (size_t i = 0; i < arena_bufs.size(); ++i) bufs_[static_cast<size_t>(arena_bufs[i].id)].offset = offset[i];
  return std::min(by_fit, by_size);
}

void Lowerer::drop_unread_weights() {
  std::vector<bool> read(bufs_.size(), false);
  // A step reads what its buffer list names and, to be safe, every bN its text names.
  for (const Step& s : steps_) {
    for (int b : s.buffers) read[static_cast<size_t>(root(b))] = true;
    for (size_t at = s.text.find('b'); at != std::string::npos; at = s.text.find('b', at + 1)) {
      if (at == 0 || (s.text[at - 1] != '=' && s.text[at - 1] != ',')) continue;
      size_t end = at + 1;
      while (end < s.text.size() && std::isdigit(static_cast<unsigned char>(s.text[end]))) ++end;
      if (end == at + 1 || end - at > 10) continue;  // not bN, or more digits than any buffer id
      const size_t id = std::stoul(s.text.substr(at + 1, end - at - 1));
      if (id < bufs_.size()) read[static_cast<size_t>(root(static_cast<int>(id)))] = true;
    }
  }
  for (const auto& [name, id] : variables_) read[static_cast<size_t>(id)] = true;
  std::string kept;
  for (size_t i = 0; i < bufs_.size(); ++i) {
    Buffer& b = bufs_[i];
    if (b.kind != "weight") continue;
    if (!read[i]) {
      b.shape = {0};
      b.bytes = 0;
      b.offset = 0;
      continue;
    }
    kept.resize(static_cast<size_t>(align_up(static_cast<int64_t>(kept.size()))), '\0');
    const int64_t at = static_cast<int64_t>(kept.size());
    kept.append(weights_, static_cast<size_t>(b.offset), static_cast<size_t>(b.bytes));
    b.offset = at;
  }
  weights_ = std::move(kept);
}

std::string Lowerer::write_plan(int64_t arena) {
  std::string p = "kiln-plan 1\n";
  p += "arena bytes=" + std::to_string(arena) + "\n";
  p += "workspace bytes=" + std::to_string(gemm_ ? kWorkspaceBytes : 0) + "\n";
  if (!mesh_line_.empty()) p += mesh_line_ + "\n";
  for (size_t i = 0; i < bufs_.size(); ++i) {
    const Buffer& b = bufs_[i];
    p += "buffer " + std::to_string(i) + " kind=" + b.kind + " dtype=" + dname(b.dtype) + " shape=" + dims_text(b.shape) +
         " bytes=" + std::to_string(b.bytes) + " offset=" + std::to_string(b.offset);
    if (b.base >= 0) p += " base=" + std::to_string(b.base);
    if (!b.name.empty() && b.name.find_first_of(" \t\n=#") == std::string::npos) p += " name=" + b.name;
    if (!b.rank_axis.empty()) p += " rank_axis=" + b.rank_axis + " rank_stride=" + std::to_string(b.rank_stride);
    p += "\n";
  }
  for (size_t i = 0; i < inputs_.size(); ++i)
    p += "input " + inputs_[i].first + " buffer=" + std::to_string(inputs_[i].second) + io_placement(true, i) + "\n";
  for (size_t i = 0; i < outputs_.size(); ++i)
    p += "output " + outputs_[i].first + " buffer=" + std::to_string(outputs_[i].second) + io_placement(false, i) + "\n";
  // Weights before their copies, which name them (the runtime refreshes a copy when its weight is written).
  for (const auto& [name, id] : variables_)
    if (!copy_of_.count(name)) p += "variable " + name + " buffer=" + std::to_string(id) + "\n";
  for (const auto& [name, master] : copy_of_)
    p += "variable " + name + " buffer=" + std::to_string(variables_.at(name)) + " copy_of=" + master + "\n";
  for (const std::string& k : kernels_) p += "kernel " + k + "\n";
  for (const Step& s : steps_) p += s.text + "\n";
  return p;
}

StatusOr<LoweredGraph> Lowerer::run(const Graph& g) {
  record_mesh(g);
  for (int i = 0; i < g.num_inputs(); ++i) {
    const Value* v = g.input(i);
    KILN_RETURN_IF_ERROR(check_static(v));
    const std::string name = v->name().empty() ? "input" + std::to_string(i) : v->name();
    val_[v] = add_buffer("input", v->dtype(), sizes_of(v), name);
    inputs_.push_back({name, val_[v]});
  }
  KILN_RETURN_IF_ERROR(lower_graph_nodes(g));
  std::set<int> claimed;
  for (int i = 0; i < g.num_outputs(); ++i) {
    const Value* v = g.output(i);
    const std::string name = g.output_name(i).empty() ? "output" + std::to_string(i) : g.output_name(i);
    const int id = buf(v);
    if (bufs_[id].kind == "activation" && !claimed.count(id)) {
      bufs_[id].kind = "output";
      if (bufs_[id].name.empty()) bufs_[id].name = name;
      claimed.insert(id);
      outputs_.push_back({name, id});
      continue;
    }
    // Inputs, weights, views and repeated outputs get a buffer of their own.
    const int out = add_buffer("output", v->dtype(), sizes_of(v), name);
    claimed.insert(out);
    outputs_.push_back({name, out});
    if (bufs_[out].bytes > 0)
      steps_.push_back({"step copy src=b" + std::to_string(id) + " dst=b" + std::to_string(out) + " bytes=" +
                            std::to_string(bufs_[out].bytes),
                        {id, out}});
  }
  KILN_RETURN_IF_ERROR(finish_state());
  drop_unread_weights();
  place_rank_weights();
  const int64_t arena = plan_memory();
  LoweredGraph out;
  out.plan = write_plan(arena);
  out.weights = std::move(weights_);
  out.source = prelude(fp16_, bf16_) + source_;
  out.kernels = kernels_;
  return out;
}

static void bind_regions(Graph& g, Status& status) {
  for (Node* n : g.node_list()) {
    if (n->op_name() != "fused" || !status.ok()) continue;
    Graph& body = n->region(0);
    for (int i = 0; i < body.num_inputs() && i < n->num_operands(); ++i) body.input(i)->set_type(n->operand(i)->type());
    status = infer_types(body);
    if (status.ok()) bind_regions(body, status);
  }
}

}  // namespace detail

using detail::Lowerer;
using detail::value_label;

StatusOr<LoweredGraph> lower_graph(const Graph& g, const LoweringOptions& opts) { return Lowerer(opts).run(g); }

Status bind_symbols(Graph& g, const std::map<std::string, int64_t>& sizes) {
  for (Value* v : g.inputs()) {
    TensorType t = v->type();
    for (Dim& d : t.shape) {
      if (d.is_static()) continue;
      auto it = sizes.find(d.symbol_name());
      if (it == sizes.end())
        return invalid_argument("symbol '" + d.symbol_name() + "' of input " + value_label(v) +
                                " has no size; bind it with --sym " + d.symbol_name() + "=N");
      d = Dim(it->second);
    }
    v->set_type(std::move(t));
  }
  KILN_RETURN_IF_ERROR(infer_types(g));
  Status s;
  detail::bind_regions(g, s);
  return s;
}

}  // namespace kiln::cuda
