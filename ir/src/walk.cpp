// The shared walker over graphs and their regions (the rules for callbacks are in walk.h).
#include "kiln/ir/walk.h"

#include <algorithm>
#include <vector>

namespace kiln::walk_detail {

StatusOr<bool> walk_node(Node& n, const NodeVisitor& fn, WalkOptions options) {
  if (options.order == WalkOrder::kPreOrder) {
    KILN_ASSIGN_OR_RETURN(WalkAction action, fn(n));
    // After kSkip `n` may be gone (erased by the callback): touch nothing of it.
    if (action != WalkAction::kAdvance) return action == WalkAction::kInterrupt;
  }
  // num_regions() is read each time: a pre-order callback may have added a region to `n`.
  for (int r = 0; r < n.num_regions(); ++r) {
    KILN_ASSIGN_OR_RETURN(bool interrupted, walk_graph(n.region(r), fn, options));
    if (interrupted) return true;
  }
  if (options.order == WalkOrder::kPostOrder) {
    KILN_ASSIGN_OR_RETURN(WalkAction action, fn(n));
    return action == WalkAction::kInterrupt;
  }
  return false;
}

StatusOr<bool> walk_graph(Graph& g, const NodeVisitor& fn, WalkOptions options) {
  // A snapshot, so that erasing the visited node (or one already visited) leaves the walk intact.
  std::vector<Node*> nodes = g.node_list();
  if (options.reverse) std::reverse(nodes.begin(), nodes.end());
  for (Node* n : nodes) {
    KILN_ASSIGN_OR_RETURN(bool interrupted, walk_node(*n, fn, options));
    if (interrupted) return true;
  }
  return false;
}

StatusOr<bool> walk_graphs(Graph& g, const GraphVisitor& fn, WalkOrder order) {
  if (order == WalkOrder::kPreOrder) {
    KILN_ASSIGN_OR_RETURN(WalkAction action, fn(g));
    if (action != WalkAction::kAdvance) return action == WalkAction::kInterrupt;
  }
  // Read after a pre-order callback, which may have erased or created nodes with regions.
  std::vector<Graph*> nested;
  for (const auto& n : g.nodes())
    for (int r = 0; r < n->num_regions(); ++r) nested.push_back(&n->region(r));
  for (Graph* sub : nested) {
    KILN_ASSIGN_OR_RETURN(bool interrupted, walk_graphs(*sub, fn, order));
    if (interrupted) return true;
  }
  if (order == WalkOrder::kPostOrder) {
    KILN_ASSIGN_OR_RETURN(WalkAction action, fn(g));
    return action == WalkAction::kInterrupt;
  }
  return false;
}

}  // namespace kiln::walk_detail
