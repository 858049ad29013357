// The pointwise ops after a conv that a conv kernel applies to each output before storing it:
// an inference batch_norm, single elementwise ops and fuse-pointwise groups (activations,
// residual adds, per-channel scales), each only as the sole user of the value before it.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

/// The one node reading `v` (perhaps through several operands), or nullptr when v is a graph
/// output or has several users.
const Node* only_user(const Value* v) {
  const Node* u = nullptr;
  for (const Use& use : v->uses()) {
    if (use.user == nullptr || (u != nullptr && use.user != u)) return nullptr;
    u = use.user;
  }
  return u;
}

}  // namespace

StatusOr<Lowerer::ConvTail> Lowerer::conv_tail(const Node& conv, int out, const std::vector<std::string>& coords) {
  ConvTail tail;
  const Value* v = conv.result();
  tail.value = v;
  const DType t = v->dtype();
  const Sizes ys = sizes_of(v);
  int next = 0;
  // Reads operand `o` (broadcast against the conv's result, or a [C] vector of a batch_norm) at
  // the thread's coordinates into a new register; false when it does not qualify (no buffer yet,
  // another dtype, not broadcastable).
  auto load_operand = [&](const Value* o, std::string& code, std::string& params, std::vector<int>& args,
                          std::map<const Value*, std::string>& names, bool per_channel = false) -> bool {
    if (names.count(o)) return true;
    if (!val_.count(o) || o->dtype() != t) return false;
    Sizes os = sizes_of(o);
    if (per_channel) {
      if (os.size() != 1 || os[0] != ys[1]) return false;
      os.resize(ys.size() - 1, 1);  // [C] -> [C, 1, ...]
    }
    if (os.size() > ys.size()) return false;
    for (size_t d = 0; d < os.size(); ++d)
      if (os[d] != 1 && os[d] != ys[ys.size() - os.size() + d]) return false;
    const Sizes st = broadcast_strides(os, ys);
    std::string off;
    for (size_t d = 0; d < st.size(); ++d)
      if (st[d] != 0) off += (off.empty() ? "" : " + ") + std::string("(long long)") + coords[d] + " * " + int_literal(st[d]);
    const std::string p = "tail" + std::to_string(tail.args.size() + args.size());
    params += ", const " + *storage_type(t) + "* __restrict__ " + p;
    args.push_back(buf(o));
    const std::string name = "e" + std::to_string(next++);
    code += "      const float " + name + " = " + load_expr(t, p + "[" + (off.empty() ? "0" : off) + "]") + ";\n";
    names[o] = name;
    return true;
  };
  for (;;) {
    const Node* u = only_user(v);
    if (u == nullptr || absorbed_.count(u) || u->num_results() != 1 || u->result()->dtype() != t ||
        sizes_of(u->result()) != ys)
      break;
    std::string code, params;
    std::vector<int> args;
    std::map<const Value*, std::string> names = {{v, "v"}};
    bool ok = true;
    std::string result;
    if (u->op_name() == "batch_norm") {
      // Its [C] vectors broadcast along dim 1: not a channels-last conv's channels.
      if (u->num_operands() != 5 || u->operand(0) != v || conv.get_string("layout", "nchw") != "nchw") break;
      std::vector<std::string> p;
      for (int i = 1; i < 5 && ok; ++i) {
        ok = u->operand(i) != v && load_operand(u->operand(i), code, params, args, names, true);
        if (ok) p.push_back(names.at(u->operand(i)));
      }
      if (!ok) break;
      result = "(v - " + p[2] + ") * (" + p[0] + " / sqrtf(" + p[3] + " + " +
               literal(DType::kF32, u->get_float("epsilon")) + ")) + " + p[1];
    } else {
      // One elementwise op, or a fused pointwise group, computed on registers node by node.
      const bool group = u->op_name() == "fused";
      if (group ? (u->num_regions() != 1 || !pure_pointwise(*u)) : !u->op()->has(kTraitElementwise)) break;
      std::vector<const Node*> nodes;
      if (group) {
        const Graph& body = u->region(0);
        for (const auto& m : body.nodes()) {
          if (m->op_name() == "quantize" || m->op_name() == "amax") ok = false;
          nodes.push_back(m.get());
        }
        for (int i = 0; i < u->num_operands() && ok; ++i) {
          const Value* o = u->operand(i);
          if (o != v) ok = load_operand(o, code, params, args, names);
          if (ok) names[body.input(i)] = names.at(o);
        }
      } else {
        nodes.push_back(u);
        for (const Value* o : u->operands())
          if (ok && o != v) ok = load_operand(o, code, params, args, names);
      }
      if (ok) ok = register_code(nodes, names, code, next, "e");
      if (!ok) break;
      result = names.at(group ? u->region(0).output(0) : u->result());
    }
    tail.code += code + "      v = " + round_expr(t, result) + ";\n";
    tail.params += params;
    tail.args.insert(tail.args.end(), args.begin(), args.end());
    absorbed_.insert(u);
    val_[u->result()] = out;
    if (!u->result()->name().empty()) bufs_[out].name = u->result()->name();
    tail.ops.push_back(u->op_name());
    v = tail.value = u->result();
  }
  return tail;
}

bool Lowerer::register_code(const std::vector<const Node*>& nodes, std::map<const Value*, std::string>& names,
                            std::string& code, int& next, const std::string& prefix) {
  for (const Node* m : nodes) {
    std::string e;
    if (m->op_name() == "constant") {
      const Tensor& c = m->attr("value")->as_tensor();
      e = is_float(c.dtype()) ? literal(c.dtype(), c.get_f64(0)) : int_literal(c.get_i64(0));
    } else if (m->op_name() == "identity") {
      e = names.at(m->operand(0));
    } else {
      std::vector<std::string> a;
      for (const Value* o : m->operands()) a.push_back(names.at(o));
      auto expr = op_expr(*m, a);
      if (!expr.ok()) return false;
      e = *expr;
    }
    std::optional<std::string> rt = reg_type(m->result()->dtype());
    if (!rt) return false;
    const std::string name = prefix + std::to_string(next++);
    code += "      const " + *rt + " " + name + " = " + round_expr(m->result()->dtype(), e) + ";\n";
    names[m->result()] = name;
  }
  return true;
}

namespace {

/// The nodes of a pointwise node or group that reads one value (constants aside), or an empty
/// list when `n` is not one.
std::vector<const Node*> unary_pointwise_nodes(const Node& n, bool pure_group) {
  if (n.num_operands() != 1 || n.num_results() != 1) return {};
  if (n.op_name() == "fused") {
    if (n.num_regions() != 1 || !pure_group) return {};
    std::vector<const Node*> nodes;
    for (const auto& m : n.region(0).nodes()) {
      if (m->op_name() == "quantize" || m->op_name() == "amax") return {};
      nodes.push_back(m.get());
    }
    return nodes;
  }
  if (!n.op()->has(kTraitElementwise)) return {};
  return {&n};
}

}  // namespace

bool Lowerer::defer_to_conv_prologue(const Node& n) {
  if (opts_.depthwise != "kernel" || n.num_results() != 1) return false;
  const Value* v = n.result();
  const Node* conv = only_user(v);
  if (conv == nullptr || conv->op_name() != "conv" || conv->num_operands() < 2 || conv->operand(0) != v ||
      conv->operand(1) == v || (conv->num_operands() == 3 && conv->operand(2) == v) ||
      conv->get_string("layout", "nchw") != "nhwc" || conv->get_int("groups", 1) <= 1 || prologue_.count(conv))
    return false;
  if (n.num_operands() != 1 || n.operand(0)->dtype() != v->dtype() || sizes_of(n.operand(0)) != sizes_of(v))
    return false;
  const bool pure = n.op_name() == "fused" && n.num_regions() == 1 && pure_pointwise(n);
  const std::vector<const Node*> nodes = unary_pointwise_nodes(n, pure);
  if (nodes.empty()) return false;
  std::optional<std::string> code = conv_prologue(n, nodes);
  if (!code) return false;
  prologue_[conv] = {&n, std::move(*code)};
  return true;
}

std::optional<std::string> Lowerer::conv_prologue(const Node& pro, const std::vector<const Node*>& nodes) {
  std::map<const Value*, std::string> names = {{pro.operand(0), "v"}};
  if (pro.op_name() == "fused") names[pro.region(0).input(0)] = "v";
  std::string code;
  int next = 0;
  if (!register_code(nodes, names, code, next, "p")) return std::nullopt;
  const Value* r = pro.op_name() == "fused" ? pro.region(0).output(0) : pro.result();
  return "  auto pro = [](float v) -> float {\n" + code + "      return " + round_expr(pro.result()->dtype(), names.at(r)) +
         ";\n  };\n";
}

}  // namespace kiln::cuda::detail
