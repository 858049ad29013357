// Shared by the quantizer plugins: which contractions compute a graph output (the layers that
// keep-output-layers leaves in float).
#pragma once

#include <set>
#include <string>

#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"

namespace kiln {

/// The contractions that compute a graph output directly: seen from each output back through
/// casts, views (reshape, transpose, squeeze, unsqueeze, flatten, identity), softmax and a
/// constant bias add. These are a language model's lm_head and a classifier's last layer,
/// which quantization recipes usually leave in full precision; exporters give them no stable name
/// (`output`, `onnx::MatMul_686`), so `exclude` cannot find them.
inline std::set<const Node*> output_layers(const Graph& g) {
  static const std::set<std::string> kPassThrough = {"cast",    "reshape", "transpose", "squeeze",     "unsqueeze",
                                                     "flatten", "identity", "softmax",  "log_softmax"};
  std::set<const Node*> found;
  for (const Value* out : g.outputs()) {
    const Value* v = out;
    for (int hops = 0; hops < 16 && v != nullptr && v->producer() != nullptr; ++hops) {
      const Node* p = v->producer();
      if (p->op() != nullptr && p->op()->has(kTraitContraction)) {
        found.insert(p);
        break;
      }
      const Value* next = nullptr;
      if (kPassThrough.count(p->op_name()) && p->num_operands() >= 1) {
        next = p->operand(0);
      } else if (p->op_name() == "add" && p->num_operands() == 2) {
        // bias: the other operand is a constant
        if (constant_tensor(p->operand(1)) != nullptr) next = p->operand(0);
        else if (constant_tensor(p->operand(0)) != nullptr) next = p->operand(1);
      }
      v = next;
    }
  }
  return found;
}

}  // namespace kiln
