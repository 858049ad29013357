// The decompose-losses pass: cross_entropy and mse_loss spelled out in core ops (log_softmax, a
// one-hot pick, masked sums), for backends that lower those but not the loss ops (the CUDA
// backends). Run it after autodiff (the loss ops' own gradient rules are the cheaper ones) and
// before fusion, which then fuses the pieces.
#include "autodiff.h"

namespace kiln::training {
namespace {

std::vector<int64_t> all_axes(const Value* v) {
  std::vector<int64_t> axes;
  for (int64_t d = 0; d < v->type().rank(); ++d) axes.push_back(d);
  return axes;
}

Value* mse(Builder& b, const Node& n) {
  Value* d = b.sub(n.operand(0), n.operand(1));
  const std::string op = n.get_string("reduction") == "mean" ? "reduce_mean" : "reduce_sum";
  return b.reduce(op, b.mul(d, d), all_axes(d), false);
}

Value* cross_entropy(Builder& b, const Node& n) {
  Value *logits = n.operand(0), *target = n.operand(1);
  const std::vector<int64_t> ls = require_static(logits->shape(), "cross_entropy's logits");
  Shape col = target->shape();
  col.push_back(Dim(1));
  Value* iota = b.op("range", {}, {{"start", Attribute(0.0)}, {"limit", Attribute(static_cast<double>(ls.back()))},
                                   {"delta", Attribute(1.0)}, {"dtype", Attribute(target->dtype())}});
  Value* onehot = b.cast(b.op("equal", {b.reshape(target, col), iota}), logits->dtype());
  Value* logp = b.op("log_softmax", {logits}, {{"axis", Attribute(-1)}});
  Value* picked = b.reduce("reduce_sum", b.mul(logp, onehot), {static_cast<int64_t>(ls.size()) - 1}, false);
  Value* keep = b.cast(b.op("not_equal", {target, b.scalar(static_cast<double>(n.get_int("ignore_index")), target->dtype())}),
                       logits->dtype());
  Value* total = b.neg(b.reduce("reduce_sum", b.mul(picked, keep), all_axes(keep), false));
  if (n.get_string("reduction") != "mean") return total;
  return b.div(total, b.reduce("reduce_sum", keep, all_axes(keep), false));
}

class DecomposeLosses final : public Pass {
 public:
  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    try {
      Builder b(g);
      for (Node* n : g.node_list()) {
        if (n->op_name() != "cross_entropy" && n->op_name() != "mse_loss") continue;
        b.set_insertion_point(n);
        b.set_loc(n->loc());
        Value* v = n->op_name() == "mse_loss" ? mse(b, *n) : cross_entropy(b, *n);
        v->set_name(n->result()->name());
        n->result()->set_name("");
        n->result()->replace_all_uses_with(v);
        KILN_RETURN_IF_ERROR(g.erase_node(n));
        changed = true;
      }
    } catch (const BuildError& e) {
      return e.status.with_context("decompose-losses");
    }
    return changed;
  }
};

}  // namespace

PassInfo decompose_losses_pass_info() {
  PassInfo info;
  info.name = "decompose-losses";
  info.version = "0.1.0";
  info.summary = "cross_entropy and mse_loss in core ops, for backends that do not lower them (cuda)";
  info.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<DecomposeLosses>());
  };
  return info;
}

}  // namespace kiln::training
