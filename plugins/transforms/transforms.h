// Private to the kiln-transforms plugin: the pass factories and the graph helpers they share.
#pragma once

#include <algorithm>
#include <vector>

#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"
#include "kiln/ir/walk.h"

namespace kiln::transforms {

/// Registry entries of the three passes (registered by register.cpp).
PassInfo canonicalize_pass_info();
PassInfo cse_pass_info();
PassInfo dce_pass_info();

/// Whether `n`, or any node nested in its regions, has kTraitSideEffects: such a node is
/// never removed, merged or folded.
inline bool has_side_effects(const Node& n) {
  return walk(n, [](const Node& m) {
    return m.op() && m.op()->has(kTraitSideEffects) ? WalkAction::kInterrupt : WalkAction::kAdvance;
  });
}

/// Whether any result of `n` is used (by a node or as a graph output).
inline bool has_used_results(const Node& n) {
  for (int i = 0; i < n.num_results(); ++i)
    if (n.result(i)->has_uses()) return true;
  return false;
}

/// Erases `n`, whose results must be unused, then every operand producer that this left
/// without uses (and without side effects), transitively. Keeps a rewrite from leaving
/// behind the constants and views it just bypassed.
inline Status erase_with_dead_producers(Node* n) {
  std::vector<Node*> work{n};
  while (!work.empty()) {
    Node* cur = work.back();
    work.pop_back();
    std::vector<Node*> producers;
    for (Value* v : cur->operands())
      if (v->producer() && std::find(producers.begin(), producers.end(), v->producer()) ==
                               producers.end())
        producers.push_back(v->producer());
    KILN_RETURN_IF_ERROR(cur->graph()->erase_node(cur));
    // cur was the last user of each producer pushed here, so none is pushed twice.
    for (Node* p : producers)
      if (!has_used_results(*p) && !has_side_effects(*p)) work.push_back(p);
  }
  return ok_status();
}

}  // namespace kiln::transforms
