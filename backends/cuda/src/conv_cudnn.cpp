// conv as one cuDNN plan step (docs/artifact.md, `step conv`): the bias, a same-shape residual
// add (plain or inside a fuse-pointwise group) and a following relu ride along, as cuDNN's
// conv-bias-activation computes relu(conv(x) + z + bias).
#include <algorithm>

#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

std::string join_ints(const Sizes& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

/// Whether `v`'s only user is a `fused` group computing add(v, other) or relu(add(v, other)),
/// `other` of v's shape and dtype. Returns the group and sets `other` and `relu`.
const Node* fused_residual(const Value* v, const Value** other, bool* relu) {
  if (v->uses().size() != 1 || v->uses()[0].user == nullptr) return nullptr;
  const Node& u = *v->uses()[0].user;
  if (u.op_name() != "fused" || u.num_results() != 1 || u.num_operands() != 2 || u.num_regions() != 1) return nullptr;
  const Graph& body = u.region(0);
  const auto& nodes = body.nodes();
  if (nodes.empty() || nodes.size() > 2 || body.num_outputs() != 1) return nullptr;
  const Node& add = *nodes.front();
  if (add.op_name() != "add" || add.num_operands() != 2) return nullptr;
  const int at = u.operand(0) == v ? 0 : 1;
  // The add must read both group inputs, v's and the other's, once each.
  const Value *mine = body.input(at), *theirs = body.input(1 - at);
  if (!((add.operand(0) == mine && add.operand(1) == theirs) || (add.operand(0) == theirs && add.operand(1) == mine)))
    return nullptr;
  *relu = nodes.size() == 2;
  if (*relu) {
    const Node& r = *nodes.back();
    if (r.op_name() != "relu" || r.operand(0) != add.result() || body.output(0) != r.result()) return nullptr;
  } else if (body.output(0) != add.result()) {
    return nullptr;
  }
  *other = u.operand(1 - at);
  if (*other == v || (*other)->dtype() != v->dtype() || sizes_of(*other) != sizes_of(v) ||
      u.result()->dtype() != v->dtype())
    return nullptr;
  return &u;
}

}  // namespace

StatusOr<bool> Lowerer::conv_cudnn(const Node& n) {
  if (opts_.conv != "cudnn") return false;
  const Value* x = n.operand(0);
  const DType t = x->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
  // Channels-last convs (layout-nhwc) are described in NCHW order; the step's layout=nhwc
  // tells the runtime the strides.
  const bool channels_last = n.get_string("layout", "nchw") == "nhwc";
  auto nchw = [&](Sizes s) {
    if (channels_last && s.size() >= 3) std::rotate(s.begin() + 1, s.end() - 1, s.end());
    return s;
  };
  const Sizes xs = nchw(sizes_of(x)), ws = nchw(sizes_of(n.operand(1))), ys = nchw(sizes_of(n.result()));
  if (xs.size() < 3 || xs.size() > 5) return false;
  const size_t nsp = xs.size() - 2;
  const Window win = window_of(n, nsp);
  const Sizes &strides = win.strides, &pads = win.pads, &dil = win.dilations;
  // cuDNN pads both sides alike; ONNX's asymmetric pads (auto_pad SAME_*) take the other paths.
  for (size_t d = 0; d < nsp; ++d)
    if (pads[d] != pads[nsp + d]) return false;
  // The legacy API takes int dims and tensors of fewer than 2^31 elements.
  for (const Sizes* s : {&xs, &ws, &ys})
    if (product(*s) == 0 || product(*s) >= (int64_t{1} << 31)) return false;
  const int64_t groups = n.get_int("groups", 1);

  const int out = activation_for(n.result());
  std::vector<int> used = {buf(x), buf(n.operand(1))};
  std::string text = "step conv x=b" + std::to_string(buf(x)) + " w=b" + std::to_string(buf(n.operand(1))) +
                     " y=b" + std::to_string(out);
  if (n.num_operands() == 3) {
    text += " bias=b" + std::to_string(buf(n.operand(2)));
    used.push_back(buf(n.operand(2)));
  }
  // relu(conv + z + bias): first a residual add (plain, or a fused add[+relu] group), then a relu.
  const Value* v = n.result();
  const Value* z = nullptr;
  bool relu = false;
  auto same_shape = [](const Value* v, const Value* r) { return sizes_of(r) == sizes_of(v); };
  if ((z = sole_add_operand(v, same_shape))) {
    const Value* sum = v->uses()[0].user->result();
    absorb_user(v, out);
    v = sum;
    relu = !sole_activation(v, false).empty();
    if (relu) absorb_user(v, out);
  } else if (const Node* group = fused_residual(v, &z, &relu); group && val_.count(z)) {
    absorbed_.insert(group);
    val_[group->result()] = out;
    if (!group->result()->name().empty()) bufs_[out].name = group->result()->name();
  } else {
    z = nullptr;
    relu = !sole_activation(v, false).empty();
    if (relu) absorb_user(v, out);
  }
  if (z) {
    text += " z=b" + std::to_string(buf(z));
    used.push_back(buf(z));
  }
  used.push_back(out);
  text += " n=" + std::to_string(xs[0]) + " c=" + std::to_string(xs[1]) + " k=" + std::to_string(ws[0]) +
          " spatial=" + join_ints(Sizes(xs.begin() + 2, xs.end())) + " kernel=" + join_ints(Sizes(ws.begin() + 2, ws.end())) +
          " pad=" + join_ints(Sizes(pads.begin(), pads.begin() + static_cast<std::ptrdiff_t>(nsp))) +
          " stride=" + join_ints(strides) + " dilation=" + join_ints(dil) + " groups=" + std::to_string(groups) +
          " dtype=" + dname(t) + " math=" + (t == DType::kF32 && opts_.allow_tf32_conv ? "tf32" : "f32") +
          " activation=" + (relu ? "relu" : "none") + (channels_last ? " layout=nhwc" : "");
  steps_.push_back({text, used});
  gemm_ = true;  // the plan's workspace serves cuDNN as it serves cuBLASLt
  return true;
}

}  // namespace kiln::cuda::detail
