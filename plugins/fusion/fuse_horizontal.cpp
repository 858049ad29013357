// The fuse-horizontal pass: linears/matmuls that read the same activation with constant weights
// of one shape (Q/K/V, gate/up projections) become one batched matmul over stacked weights.
//
//   x[..., K] -> reshape [M, K] -> matmul with W[G, K, N] -> [G, M, N] -> split on axis 0
//
// Each original result is a contiguous [M, N] slice of the batched result (the CUDA lowering
// makes the split and the reshapes views), so no output is copied.
#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "fusion.h"

namespace kiln::fusion {
namespace {

/// The weight of a projection `n` of `x` as [K, N] (matmul) or [N, K] (linear, transposed):
/// a constant, the same dtype as x, static shapes; nullptr when `n` is no such projection. A
/// linear may have a bias [N] of that dtype (PyTorch's nn.Linear as its front end gives it; ONNX
/// exports the same as matmul, then add): it is added to the projection's slice afterwards.
const Tensor* projection_weight(const Node& n, bool& transposed) {
  const bool lin = n.op_name() == "linear" && (n.num_operands() == 2 || n.num_operands() == 3);
  if (!lin && n.op_name() != "matmul") return nullptr;
  const Tensor* w = constant_tensor(n.operand(1));
  if (!w || n.num_results() != 1 || w->rank() != 2) return nullptr;
  const DType t = n.result()->dtype();
  if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return nullptr;
  if (n.operand(0)->dtype() != t || w->dtype() != t || n.operand(0)->shape().size() < 2) return nullptr;
  for (const Dim& d : n.operand(0)->shape())
    if (!d.is_static()) return nullptr;
  if (n.num_operands() == 3) {
    const Value* bias = n.operand(2);
    if (bias->dtype() != t || bias->shape().size() != 1 || bias->shape()[0] != Dim(w->shape()[0])) return nullptr;
  }
  transposed = lin;
  return w;
}

class FuseHorizontal final : public Pass {
 public:
  FuseHorizontal(int64_t min_rows, int64_t max_group) : min_rows_(min_rows), max_group_(max_group) {}

  StatusOr<bool> run(Graph& g) override {
    // Candidates by (activation, K, N, dtype), in graph order.
    std::map<std::tuple<const Value*, int64_t, int64_t, DType>, std::vector<Node*>> groups;
    std::vector<std::tuple<const Value*, int64_t, int64_t, DType>> order;
    for (Node* n : g.node_list()) {
      bool tr = false;
      const Tensor* w = projection_weight(*n, tr);
      if (!w) continue;
      const int64_t k = w->shape()[tr ? 1 : 0], nn = w->shape()[tr ? 0 : 1];
      int64_t m = 1;
      const Shape& xs = n->operand(0)->shape();
      for (size_t d = 0; d + 1 < xs.size(); ++d) m *= xs[d].value();
      if (m < min_rows_) continue;
      auto key = std::make_tuple(n->operand(0), k, nn, n->result()->dtype());
      if (!groups.count(key)) order.push_back(key);
      groups[key].push_back(n);
    }
    bool changed = false;
    for (const auto& key : order) {
      std::vector<Node*>& members = groups[key];
      for (size_t at = 0; at + 1 < members.size(); at += static_cast<size_t>(max_group_)) {
        const size_t end = std::min(members.size(), at + static_cast<size_t>(max_group_));
        if (end - at < 2) break;
        KILN_RETURN_IF_ERROR(fuse(g, std::vector<Node*>(members.begin() + static_cast<std::ptrdiff_t>(at),
                                                        members.begin() + static_cast<std::ptrdiff_t>(end))));
        changed = true;
      }
    }
    if (changed) reorder(g);
    return changed;
  }

 private:
  static Status fuse(Graph& g, const std::vector<Node*>& members) {
    Node* first = members.front();
    Value* x = first->operand(0);
    const DType t = first->result()->dtype();
    const int64_t groups = static_cast<int64_t>(members.size());
    bool tr = false;
    const Tensor* w0 = projection_weight(*first, tr);
    const int64_t k = w0->shape()[tr ? 1 : 0], nn = w0->shape()[tr ? 0 : 1];
    int64_t m = 1;
    for (size_t d = 0; d + 1 < x->shape().size(); ++d) m *= x->shape()[d].value();
    // Stack the weights as [G, K, N], transposing linear's [N, K].
    Tensor stacked(t, {groups, k, nn});
    const size_t es = static_cast<size_t>(dtype_storage_bytes(t, 1));
    std::byte* dst = stacked.mutable_data();
    for (int64_t gi = 0; gi < groups; ++gi) {
      const Tensor* w = projection_weight(*members[static_cast<size_t>(gi)], tr);
      const std::byte* src = w->data();
      std::byte* out = dst + static_cast<size_t>(gi * k * nn) * es;
      if (!tr) {
        std::memcpy(out, src, static_cast<size_t>(k * nn) * es);
        continue;
      }
      for (int64_t r = 0; r < nn; ++r)
        for (int64_t c = 0; c < k; ++c)
          std::memcpy(out + static_cast<size_t>(c * nn + r) * es, src + static_cast<size_t>(r * k + c) * es, es);
    }
    const std::string base = first->result()->name().empty() ? "horizontal" : first->result()->name();
    Value* x2 = x;
    if (x->shape().size() != 2) {
      KILN_ASSIGN_OR_RETURN(Node * rs, g.create_node("reshape", {x}, {TensorType{t, {Dim(m), Dim(k)}}},
                                                     {{"shape", std::vector<int64_t>{m, k}}}, first,
                                                     {base + "_rows"}));
      rs->set_loc(first->loc());
      x2 = rs->result();
    }
    KILN_ASSIGN_OR_RETURN(Node * wc, g.create_node("constant", {}, {stacked.type()}, {{"value", stacked}}, first,
                                                   {base + "_weights"}));
    KILN_ASSIGN_OR_RETURN(Node * mm, g.create_node("matmul", {x2, wc->result()},
                                                   {TensorType{t, {Dim(groups), Dim(m), Dim(nn)}}}, {}, first,
                                                   {base + "_stacked"}));
    mm->set_loc(first->loc());
    std::vector<TensorType> part_types(static_cast<size_t>(groups), TensorType{t, {Dim(1), Dim(m), Dim(nn)}});
    std::vector<std::string> part_names;
    for (int64_t gi = 0; gi < groups; ++gi) part_names.push_back(base + "_part" + std::to_string(gi));
    KILN_ASSIGN_OR_RETURN(Node * split, g.create_node("split", {mm->result()}, part_types,
                                                      {{"axis", int64_t{0}},
                                                       {"sizes", std::vector<int64_t>(static_cast<size_t>(groups), 1)}},
                                                      first, part_names));
    split->set_loc(first->loc());
    // All reshapes go in before `first`, so members are erased only afterwards.
    std::vector<Node*> backs;
    for (int64_t gi = 0; gi < groups; ++gi) {
      Node* n = members[static_cast<size_t>(gi)];
      Value* r = n->result();
      std::vector<int64_t> shape;
      for (const Dim& d : r->shape()) shape.push_back(d.value());
      KILN_ASSIGN_OR_RETURN(Node * back, g.create_node("reshape", {split->result(static_cast<int>(gi))}, {r->type()},
                                                       {{"shape", shape}}, first));
      back->set_loc(n->loc());
      if (n->num_operands() == 3) {  // linear's bias, added to the slice as ONNX's matmul + add has it
        KILN_ASSIGN_OR_RETURN(back, g.create_node("add", {back->result(), n->operand(2)}, {r->type()}, {}, first));
        back->set_loc(n->loc());
      }
      r->replace_all_uses_with(back->result());
      backs.push_back(back);
    }
    for (int64_t gi = 0; gi < groups; ++gi) {
      Node* n = members[static_cast<size_t>(gi)];
      const std::string name = n->result()->name();
      Node* weight = n->operand(1)->producer();
      KILN_RETURN_IF_ERROR(g.erase_node(n));
      backs[static_cast<size_t>(gi)]->result()->set_name(name);
      if (!weight->result()->has_uses()) KILN_RETURN_IF_ERROR(g.erase_node(weight));
    }
    return ok_status();
  }

  int64_t min_rows_, max_group_;
};

}  // namespace

PassInfo fuse_horizontal_pass_info() {
  PassInfo info;
  info.name = "fuse-horizontal";
  info.version = "0.1.0";
  info.summary = "merge projections of one activation with same-shape constant weights into one batched matmul";
  info.options = {
      {"min-rows", OptionType::kInt, int64_t{64}, "fewest activation rows worth merging (below: GEMV territory)"},
      {"max-group-size", OptionType::kInt, int64_t{8}, "most projections in one matmul"},
  };
  info.create = [](const Options& opts) -> StatusOr<std::unique_ptr<Pass>> {
    const int64_t min_rows = opts.get_int("min-rows"), max_group = opts.get_int("max-group-size");
    if (max_group < 2)
      return invalid_argument("fuse-horizontal: max-group-size must be at least 2, got " + std::to_string(max_group));
    return std::unique_ptr<Pass>(std::make_unique<FuseHorizontal>(min_rows, max_group));
  };
  return info;
}

}  // namespace kiln::fusion
