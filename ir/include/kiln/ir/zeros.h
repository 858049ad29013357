// Whether a value is known at compile time to be all zeros.
#pragma once

#include "kiln/ir/graph.h"

namespace kiln {

/// `v` is a zero constant or an expand of one: autodiff's zero gradients, which canonicalize
/// folds into dense constants when they are small.
inline bool is_all_zeros(const Value* v) {
  const Node* p = v->producer();
  if (p && p->op_name() == "expand") p = p->operand(0)->producer();
  if (!p || p->op_name() != "constant") return false;
  const Tensor& t = p->attr("value")->as_tensor();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (is_float(t.dtype()) ? t.get_f64(i) != 0.0 : t.get_i64(i) != 0) return false;
  return true;
}

}  // namespace kiln
