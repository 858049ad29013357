// Liveness-based peak activation memory of a graph in a node order (memory_estimate.h).
#include "kiln/core/memory_estimate.h"

#include <algorithm>
#include <vector>

namespace kiln {

int64_t value_bytes(const Value& v) {
  int64_t numel = 1;
  for (const Dim& d : v.shape()) numel *= d.is_static() ? d.value() : kSymbolicDimEstimate;
  return dtype_storage_bytes(v.dtype(), numel);
}

bool is_view_op(const std::string& op) {
  return op == "reshape" || op == "flatten" || op == "squeeze" || op == "unsqueeze" || op == "identity";
}

StorageMap::StorageMap(const Graph& g) {
  for (const Value* v : g.inputs()) {
    root[v] = v;
    free[v] = false;
  }
  for (const auto& n : g.nodes()) {
    const bool view = is_view_op(n->op_name()) && n->num_operands() >= 1 && n->num_results() == 1;
    bool all_free = n->op_name() == "constant" || (n->num_operands() > 0 && n->num_regions() == 0);
    for (const Value* o : n->operands()) {
      if (!root.count(o)) {  // a value from an enclosing graph: never free, its own root
        root[o] = o;
        free[o] = false;
      }
      all_free &= free.at(root.at(o));
    }
    for (const Value* r : n->results()) {
      root[r] = view ? root.at(n->operand(0)) : r;
      if (!view) free[r] = all_free;
    }
  }
}

int64_t peak_activation_bytes(const Graph& g) {
  std::vector<const Node*> order;
  for (const auto& n : g.nodes()) order.push_back(n.get());
  return peak_activation_bytes(g, order);
}

int64_t peak_activation_bytes(const Graph& g, std::span<const Node* const> order) {
  const StorageMap s(g);
  const int steps = static_cast<int>(order.size());
  // Step -1 is before the first node (graph inputs); steps + 1 is never reached.
  std::unordered_map<const Value*, std::pair<int, int>> span;  // root -> first, last step
  auto touch = [&](const Value* v, int step) {
    const Value* r = s.root_of(v);
    if (s.free.at(r)) return;
    auto [it, fresh] = span.try_emplace(r, step, step);
    if (!fresh) it->second.second = std::max(it->second.second, step);
  };
  for (const Value* v : g.inputs()) touch(v, -1);
  for (int i = 0; i < steps; ++i) {
    for (const Value* o : order[static_cast<size_t>(i)]->operands()) touch(o, i);
    for (const Value* r : order[static_cast<size_t>(i)]->results()) touch(r, i);
  }
  for (const Value* o : g.outputs()) touch(o, steps);
  std::vector<int64_t> delta(static_cast<size_t>(steps) + 3, 0);
  for (const auto& [r, fl] : span) {
    const int64_t b = value_bytes(*r);
    delta[static_cast<size_t>(fl.first + 1)] += b;
    delta[static_cast<size_t>(fl.second + 2)] -= b;
  }
  int64_t live = 0, peak = 0;
  for (int64_t d : delta) peak = std::max(peak, live += d);
  return peak;
}

}  // namespace kiln
