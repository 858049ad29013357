// The decompose-losses pass: the loss ops a backend does not lower (option `ops`) spelled out in
// core ops (log_softmax, a one-hot pick, masked sums; cross_entropy_grad as softmax - onehot).
// Run it after autodiff (the loss ops' own gradient rules are the cheaper ones) and before
// fusion, which then fuses the pieces. The CUDA backends lower the cross-entropy ops themselves
// and take only mse_loss.
//
// A cross_entropy kept whole reads its logits through a widening cast (autocast's bf16 head cast
// back to f32) from the narrow source, with the loss still in the wide dtype, and a kept
// cross_entropy_grad whose result is only cast (back to bf16 for the head's GEMMs) writes that
// dtype itself: the kernels then read and write the logits' bytes in their own dtype, with the
// math in f32 either way. A kept cross_entropy and the cross_entropy_grad of the same logits then
// become one cross_entropy_with_grad when the gradient's scale does not depend on the loss (a
// training step's), which reads the logits once.
#include <algorithm>
#include <set>
#include <unordered_map>

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

/// onehot(target) and (target != ignore_index) as [.., 1] columns in `dt`.
std::pair<Value*, Value*> onehot_and_keep(Builder& b, const Node& n, DType dt, bool column_keep) {
  Value *logits = n.operand(0), *target = n.operand(1);
  const std::vector<int64_t> ls = require_static(logits->shape(), n.op_name() + "'s logits");
  Shape col = target->shape();
  col.push_back(Dim(1));
  Value* iota = b.op("range", {}, {{"start", Attribute(0.0)}, {"limit", Attribute(static_cast<double>(ls.back()))},
                                   {"delta", Attribute(1.0)}, {"dtype", Attribute(target->dtype())}});
  Value* t = b.reshape(target, col);
  Value* onehot = b.cast(b.op("equal", {t, iota}), dt);
  Value* ignore = b.scalar(static_cast<double>(n.get_int("ignore_index")), target->dtype());
  Value* keep = b.cast(b.op("not_equal", {column_keep ? t : target, ignore}), dt);
  return {onehot, keep};
}

Value* cross_entropy(Builder& b, const Node& n) {
  Value* logits = n.operand(0);
  const int64_t last = logits->type().rank() - 1;
  auto [onehot, keep] = onehot_and_keep(b, n, logits->dtype(), false);
  Value* logp = b.op("log_softmax", {logits}, {{"axis", Attribute(-1)}});
  Value* picked = b.reduce("reduce_sum", b.mul(logp, onehot), {last}, false);
  Value* total = b.neg(b.reduce("reduce_sum", b.mul(picked, keep), all_axes(keep), false));
  if (n.get_string("reduction") == "mean") total = b.div(total, b.reduce("reduce_sum", keep, all_axes(keep), false));
  return total->dtype() == n.result()->dtype() ? total : b.cast(total, n.result()->dtype());
}

Value* cross_entropy_grad(Builder& b, const Node& n) {
  Value* logits = n.operand(0);
  auto [onehot, keep] = onehot_and_keep(b, n, logits->dtype(), true);
  Value* per_row = b.mul(b.sub(b.op("softmax", {logits}, {{"axis", Attribute(-1)}}), onehot), keep);
  Value* grad = b.mul(per_row, b.cast(n.operand(2), logits->dtype()));
  return grad->dtype() == n.result()->dtype() ? grad : b.cast(grad, n.result()->dtype());
}

bool narrow_float(DType t) { return t == DType::kBF16 || t == DType::kF16; }

/// Reads a kept loss op's logits through a cast from bf16/f16 (exact, so the op's value is
/// unchanged) and, for cross_entropy_grad, writes the dtype its only user casts to.
/// Casts it bypasses are left to `dead` (erased once the walk is over: the walk's node list holds
/// the cast after `n`).
bool read_through_casts(Node& n, std::vector<Node*>& dead) {
  bool changed = false;
  Value* logits = n.operand(0);
  Node* up = logits->producer();
  if (up && up->op_name() == "cast" && up->num_operands() == 1 && narrow_float(up->operand(0)->dtype()) &&
      (logits->dtype() == DType::kF32 || logits->dtype() == DType::kF64)) {
    if (!n.has_attr("dtype")) n.set_attr("dtype", Attribute(n.result()->dtype()));
    n.set_operand(0, up->operand(0));
    if (logits->uses().empty()) dead.push_back(up);
    changed = true;
  }
  if (n.op_name() != "cross_entropy_grad" || n.result()->uses().size() != 1) return changed;
  Node* down = n.result()->uses()[0].user;
  if (!down || down->op_name() != "cast" || !narrow_float(down->result()->dtype())) return changed;
  n.set_attr("dtype", Attribute(down->result()->dtype()));
  n.result()->set_type(down->result()->type());
  n.result()->set_name(down->result()->name());
  down->result()->set_name("");
  down->result()->replace_all_uses_with(n.result());
  dead.push_back(down);
  return true;
}

/// Pairs a kept cross_entropy with the cross_entropy_grad of the same logits and targets into one
/// cross_entropy_with_grad, when the gradient's dloss does not depend on the loss (a training
/// step's: the seed, a loss scale, the mean's count): the logits are then read once, and need
/// not stay alive from the forward to the backward. The nodes computing dloss after `ce` move
/// before it; a side-effecting one among them (state) leaves the pair alone.
bool pair_with_gradient(Graph& g, Node& ce, std::vector<Node*>& dead) {
  Node* grad = nullptr;
  for (const Use& u : ce.operand(0)->uses())
    if (u.user && u.user != &ce && u.user->op_name() == "cross_entropy_grad" && u.index == 0 &&
        u.user->operand(1) == ce.operand(1) && u.user->get_int("ignore_index") == ce.get_int("ignore_index") &&
        std::find(dead.begin(), dead.end(), u.user) == dead.end()) {
      grad = u.user;
      break;
    }
  if (!grad) return false;
  std::unordered_map<const Node*, size_t> at;
  for (Node* n : g.node_list()) at[n] = at.size();
  // The nodes after `ce` that dloss needs; none may read the loss.
  std::vector<Node*> cone, work;
  std::set<const Node*> seen;
  if (Node* p = grad->operand(2)->producer()) work.push_back(p);
  while (!work.empty()) {
    Node* n = work.back();
    work.pop_back();
    if (n == &ce) return false;
    if (at.at(n) < at.at(&ce) || !seen.insert(n).second) continue;
    if (n->op() && n->op()->has(kTraitSideEffects)) return false;
    cone.push_back(n);
    for (Value* v : n->operands())
      if (Node* p = v->producer(); p && p->graph() == &g) work.push_back(p);
  }
  std::sort(cone.begin(), cone.end(), [&](Node* a, Node* b) { return at.at(a) < at.at(b); });
  for (Node* n : cone) g.move_node_before(n, &ce);
  Builder b(g);
  b.set_insertion_point(&ce);
  b.set_loc(ce.loc());
  AttrMap attrs = ce.attrs();
  attrs["dtype"] = Attribute(ce.result()->dtype());
  attrs["grad_dtype"] = Attribute(grad->result()->dtype());
  const std::vector<Value*> both = b.op_n("cross_entropy_with_grad", {ce.operand(0), ce.operand(1), grad->operand(2)}, 2, attrs);
  for (auto [from, to] : {std::pair{ce.result(), both[0]}, std::pair{grad->result(), both[1]}}) {
    to->set_name(from->name());
    from->set_name("");
    from->replace_all_uses_with(to);
  }
  dead.push_back(&ce);
  dead.push_back(grad);
  return true;
}

class DecomposeLosses final : public Pass {
 public:
  explicit DecomposeLosses(std::set<std::string> ops) : ops_(std::move(ops)) {}

  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    std::vector<Node*> dead;
    try {
      Builder b(g);
      for (Node* n : g.node_list()) {
        const std::string& op = n->op_name();
        if (op != "cross_entropy" && op != "cross_entropy_grad" && op != "mse_loss") continue;
        if (!ops_.count(op == "mse_loss" ? op : "cross_entropy")) {
          if (op != "mse_loss") changed |= read_through_casts(*n, dead);
          continue;
        }
        b.set_insertion_point(n);
        b.set_loc(n->loc());
        Value* v = op == "mse_loss" ? mse(b, *n) : op == "cross_entropy" ? cross_entropy(b, *n) : cross_entropy_grad(b, *n);
        v->set_name(n->result()->name());
        n->result()->set_name("");
        n->result()->replace_all_uses_with(v);
        KILN_RETURN_IF_ERROR(g.erase_node(n));
        changed = true;
      }
      if (!ops_.count("cross_entropy"))
        for (Node* n : g.node_list())
          if (n->op_name() == "cross_entropy" && std::find(dead.begin(), dead.end(), n) == dead.end())
            changed |= pair_with_gradient(g, *n, dead);
    } catch (const BuildError& e) {
      return e.status.with_context("decompose-losses");
    }
    for (Node* n : dead) KILN_RETURN_IF_ERROR(g.erase_node(n));
    return changed;
  }

 private:
  std::set<std::string> ops_;
};

}  // namespace

PassInfo decompose_losses_pass_info() {
  PassInfo info;
  info.name = "decompose-losses";
  info.version = "0.2.0";
  info.summary = "the loss ops a backend does not lower (cross_entropy and its gradient, mse_loss) in core ops";
  static const std::vector<std::string> kAll = {"cross_entropy", "mse_loss"};
  info.options = {{"ops", OptionType::kStringList, kAll,
                   "the losses to spell out (cross_entropy covers cross_entropy_grad); the CUDA backends lower "
                   "cross_entropy themselves and need only mse_loss"}};
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    std::set<std::string> ops;
    for (const std::string& op : o.has("ops") ? o.get_strings("ops") : kAll) {
      if (op != "cross_entropy" && op != "mse_loss")
        return invalid_argument("decompose-losses: option 'ops' names '" + op + "'; it takes cross_entropy and mse_loss");
      ops.insert(op);
    }
    return std::unique_ptr<Pass>(std::make_unique<DecomposeLosses>(std::move(ops)));
  };
  return info;
}

}  // namespace kiln::training
