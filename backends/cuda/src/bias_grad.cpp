// Bias gradients as a GEMM epilogue: a linear's weight gradient dW = dyᵀ·x reads dy, and its bias
// gradient db = Σ_rows dy reads the same rows, so cuBLASLt computes db while it computes dW
// (CUBLASLT_EPILOGUE_BGRADA/BGRADB) instead of a reduction kernel reading dy again.
//
// Autodiff emits the reduction (reduce_sum over every dim but the last) before the matmul. It is
// deferred to the matmul when every reader of its result comes after the matmul; otherwise the
// matmul (with the views and transpose between its operands and values already lowered) is
// lowered early, where the reduction stands. Either way the matmul's step writes the sum as its
// bias gradient or, when the step takes another path (GEMV, another epilogue, sizes cuBLASLt's
// epilogue kernels may not take), the reduction is lowered right after it.
#include "lowerer.h"

namespace kiln::cuda::detail {
namespace {

bool is_view(const Node* n) {
  static const std::set<std::string> kViews = {"reshape", "flatten", "squeeze", "unsqueeze", "identity"};
  return n != nullptr && n->num_operands() == 1 && n->num_results() == 1 && kViews.count(n->op_name()) > 0;
}

/// Every value that is `v` or a view of it, through chains of views either way (the same bytes
/// in the same row-major order).
std::vector<const Value*> views_of(const Value* v) {
  while (is_view(v->producer())) v = v->producer()->operand(0);
  std::vector<const Value*> out{v};
  for (size_t i = 0; i < out.size(); ++i)
    for (const Use& u : out[i]->uses())
      if (is_view(u.user)) out.push_back(u.user->result());
  return out;
}

bool is_2d_transpose(const Node* n) {
  if (n == nullptr || n->op_name() != "transpose" || n->num_operands() != 1) return false;
  if (n->operand(0)->type().rank() != 2) return false;
  const Sizes perm = n->get_ints("perm");
  return perm.empty() || perm == Sizes{1, 0};
}

/// Position of every node of `g`, for order checks.
std::unordered_map<const Node*, size_t> positions(const Graph& g) {
  std::unordered_map<const Node*, size_t> pos;
  for (const auto& n : g.nodes()) pos.emplace(n.get(), pos.size());
  return pos;
}

}  // namespace

bool Lowerer::views_to_lowered(const Value* v, std::vector<const Node*>& chain) const {
  std::vector<const Node*> back;
  while (!val_.count(v)) {
    const Node* p = v->producer();
    if (!is_view(p) && !is_2d_transpose(p)) return false;
    back.push_back(p);
    v = p->operand(0);
  }
  chain.insert(chain.end(), back.rbegin(), back.rend());
  return true;
}

StatusOr<bool> Lowerer::bias_grad_by_gemm(const Node& r) {
  if (r.op_name() != "reduce_sum" || r.num_operands() != 1 || r.num_results() != 1 || r.num_regions() > 0) return false;
  const Value* x = r.operand(0);
  const DType t = x->dtype();
  if ((t != DType::kF32 && t != DType::kF16 && t != DType::kBF16) || r.result()->dtype() != t) return false;
  const Sizes xs = sizes_of(x);
  const int64_t rank = static_cast<int64_t>(xs.size());
  if (rank < 2) return false;
  // Every dim but the last, each once: the sum over the rows of x viewed as [K, C].
  std::vector<bool> reduced(xs.size(), false);
  const Sizes axes = r.get_ints("axes");
  for (int64_t a : axes) {
    const int64_t d = norm_axis(a, rank);
    if (d < 0 || d >= rank || reduced[static_cast<size_t>(d)]) return false;
    reduced[static_cast<size_t>(d)] = true;
  }
  for (int64_t d = 0; d < rank; ++d)
    if (reduced[static_cast<size_t>(d)] != (d + 1 < rank)) return false;
  const int64_t cols = xs.back(), rows = product(xs) / std::max<int64_t>(cols, 1);
  if (cols == 0 || rows < 2) return false;
  // A 2-D matmul reading x as [K, C]: transposed as its A (dW = dyᵀ·x: db is A's sum over k), or
  // as its B (dW = xᵀ·dy: db is B's).
  const Node* mm = nullptr;
  int operand = -1;
  for (const Value* v : views_of(x)) {
    if (sizes_of(v) != Sizes{rows, cols}) continue;
    for (const Use& u : v->uses()) {
      const Node* user = u.user;
      if (is_2d_transpose(user))
        for (const Use& tu : user->result()->uses())
          if (tu.user && tu.user->op_name() == "matmul" && tu.index == 0) mm = tu.user, operand = 0;
      if (!mm && user && user->op_name() == "matmul" && u.index == 1) mm = user, operand = 1;
      if (mm) break;
    }
    if (mm) break;
  }
  if (!mm || mm->num_operands() != 2 || mm->result()->dtype() != t || mm->graph() != r.graph() || bias_grad_.count(mm))
    return false;
  if (mm->operand(0)->type().rank() != 2 || mm->operand(1)->type().rank() != 2) return false;
  // The matmul comes after the reduction and before everything that reads its result.
  if (bias_grad_order_graph_ != r.graph()) {
    bias_grad_order_ = positions(*r.graph());
    bias_grad_order_graph_ = r.graph();
  }
  const size_t at = bias_grad_order_.at(mm);
  if (at < bias_grad_order_.at(&r) || absorbed_.count(mm)) return false;
  bool late = true;  // the graph's outputs (no user node) are read after every node
  for (const Use& u : r.result()->uses())
    late = late && (!u.user || (bias_grad_order_.count(u.user) && bias_grad_order_.at(u.user) > at));
  bias_grad_[mm] = {&r, operand};
  if (late) return true;
  // Early: the views and transposes leading to the matmul's operands, then the matmul, here.
  std::vector<const Node*> chain;
  if (!views_to_lowered(mm->operand(0), chain) || !views_to_lowered(mm->operand(1), chain)) {
    bias_grad_.erase(mm);
    return false;
  }
  for (const Node* c : chain) {
    if (absorbed_.count(c)) continue;  // the other operand's chain shares it
    KILN_RETURN_IF_ERROR(lower_node(*c));
    absorbed_.insert(c);
  }
  KILN_RETURN_IF_ERROR(lower_with_bias_grad(*mm));
  absorbed_.insert(mm);
  return true;
}

Status Lowerer::lower_with_bias_grad(const Node& mm) {
  const auto it = bias_grad_.find(&mm);
  pending_bias_grad_ = it->second;
  bias_grad_.erase(it);
  const Node* r = pending_bias_grad_.reduce;
  Status s = lower_node(mm);
  const bool taken = pending_bias_grad_.reduce == nullptr;
  pending_bias_grad_ = {};
  KILN_RETURN_IF_ERROR(s);
  return taken ? ok_status() : reduce(*r);
}

void Lowerer::take_bias_grad(const Node& mm, GemmEpilogue& ep, int64_t m, int64_t nn, int64_t k, int64_t batch) {
  const Node* r = pending_bias_grad_.reduce;
  if (r == nullptr || ep.epilogue != "none" || ep.beta != 0 || !ep.extra.empty() || batch != 1) return;
  // cuBLASLt's bias-gradient kernels: k = 1 is known to give wrong sums (OneFlow falls back there),
  // and every dim a multiple of 16 bytes keeps to the tensor-core kernels that carry the epilogue.
  const int64_t vec = 16 / dtype_storage_bytes(mm.result()->dtype(), 1);
  if (k < 2 || m % vec != 0 || nn % vec != 0 || k % vec != 0) return;
  const int64_t len = pending_bias_grad_.operand == 0 ? m : nn;
  if (product(sizes_of(r->result())) != len) return;
  const int out = activation_for(r->result());
  ep.extra += " bias=b" + std::to_string(out);
  ep.used.push_back(out);
  ep.epilogue = pending_bias_grad_.operand == 0 ? "bgrad_a" : "bgrad_b";
  pending_bias_grad_ = {};
}

}  // namespace kiln::cuda::detail
