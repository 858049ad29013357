// GEMM fusion at the edges of a cuBLASLt step: the users of a matmul/linear result that its
// epilogue applies (a bias add, a relu/tanh-gelu, a residual add as C with beta 1), and
// transposed operands read through trans_a/trans_b.
#include "lowerer.h"

namespace kiln::cuda::detail {

const Value* Lowerer::sole_add_operand(const Value* v, bool (*fits)(const Value* v, const Value* other)) const {
  if (v->uses().size() != 1 || v->uses()[0].user == nullptr) return nullptr;
  const Node& u = *v->uses()[0].user;
  if (u.op_name() != "add" || u.num_operands() != 2 || u.result()->dtype() != v->dtype()) return nullptr;
  if (sizes_of(u.result()) != sizes_of(v)) return nullptr;
  const Value* other = u.operand(0) == v ? u.operand(1) : u.operand(0);
  // The other operand must already have a buffer: it may be computed after the GEMM.
  if (other == v || other->dtype() != v->dtype() || !val_.count(other) || !fits(v, other)) return nullptr;
  return other;
}

Lowerer::GemmEpilogue Lowerer::gemm_epilogue(const Value* v, int out, bool has_bias, bool bias_ok) {
  GemmEpilogue e;
  e.bias = has_bias;
  const int64_t n = sizes_of(v).empty() ? 1 : sizes_of(v).back();
  if (!has_bias && bias_ok) {
    // A [n] (or [1, ..., n]) addend is cuBLASLt's per-column bias.
    auto is_bias = [](const Value* v, const Value* b) {
      const Sizes bs = sizes_of(b);
      return !bs.empty() && bs.back() == sizes_of(v).back() && product(bs) == bs.back();
    };
    if (const Value* b = sole_add_operand(v, is_bias)) {
      e.extra += " bias=b" + std::to_string(buf(b));
      e.used.push_back(buf(b));
      e.bias = e.absorbed_bias = true;
      const Value* sum = v->uses()[0].user->result();
      absorb_user(v, out);
      v = sum;
    }
  }
  const std::string act = sole_activation(v, true);
  if (!act.empty()) {
    absorb_user(v, out);
    e.epilogue = e.bias ? "bias_" + act : act;
    return e;
  }
  e.epilogue = e.bias ? "bias" : "none";
  auto same_shape = [](const Value* v, const Value* r) { return sizes_of(r) == sizes_of(v); };
  if (const Value* r = sole_add_operand(v, same_shape)) {
    // D = A @ B + 1 * C (+ bias), one rounding; C is laid out as D.
    const int c = buf(r);
    absorb_user(v, out);
    e.extra += " c=b" + std::to_string(c) + " ldc=" + std::to_string(n);
    e.used.push_back(c);
    e.beta = 1;
  }
  return e;
}

bool Lowerer::fold_transpose(const Node& n) {
  const Sizes xs = sizes_of(n.operand(0));
  const size_t r = xs.size();
  if (r < 2) return false;
  Sizes perm = n.get_ints("perm");
  if (perm.empty())
    for (size_t d = r; d-- > 0;) perm.push_back(static_cast<int64_t>(d));
  for (size_t d = 0; d < r; ++d) {
    const int64_t want = d + 2 < r ? static_cast<int64_t>(d) : static_cast<int64_t>(d + 2 == r ? r - 1 : r - 2);
    if (norm_axis(perm[d], static_cast<int64_t>(r)) != want) return false;
  }
  const int64_t batch = product(Sizes(xs.begin(), xs.end() - 2));
  for (const Use& u : n.result()->uses()) {
    // matmul_acc reads its a and b (2-D) transposed as well, never its accumulator c.
    if (u.user && u.user->op_name() == "matmul_acc" && u.index < 2 && r == 2) continue;
    if (!u.user || u.user->op_name() != "matmul" || absorbed_.count(u.user)) return false;
    const DType t = u.user->result()->dtype();
    if (t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) return false;
    const Sizes ys = sizes_of(u.user->result());
    if (ys.size() < 2 || ys.back() == 0) return false;
    // Few rows go to the GEMV path, which reads operands as stored; a partial batch broadcast
    // would be expanded by a copy that assumes the logical layout.
    if (product(ys) / ys.back() <= 64) return false;
    const int64_t out_batch = product(Sizes(ys.begin(), ys.end() - 2));
    if (batch != 1 && batch != out_batch) return false;
  }
  val_[n.result()] = buf(n.operand(0));
  transposed_.insert(n.result());
  return true;
}

}  // namespace kiln::cuda::detail
