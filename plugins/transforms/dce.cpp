// The dce pass: removes nodes whose results are never used.
#include <memory>

#include "transforms.h"

namespace kiln::transforms {
namespace {

class Dce final : public Pass {
 public:
  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    // In reverse order every user is seen before its producers, so a dead chain goes in
    // one walk. Graph inputs are part of the signature and stay, even when unused.
    std::vector<Node*> nodes = g.node_list();
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
      Node* n = *it;
      if (!has_used_results(*n) && !has_side_effects(*n)) {
        KILN_RETURN_IF_ERROR(g.erase_node(n));
        changed = true;
        continue;
      }
      // A region's own outputs are its roots: dead nodes inside a live region go too.
      for (int r = 0; r < n->num_regions(); ++r) {
        KILN_ASSIGN_OR_RETURN(bool c, run(n->region(r)));
        changed |= c;
      }
    }
    return changed;
  }
};

}  // namespace

PassInfo dce_pass_info() {
  PassInfo info;
  info.name = "dce";
  info.version = "0.1.0";
  info.summary = "remove nodes whose results are unused (nodes with side effects stay)";
  info.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<Dce>());
  };
  return info;
}

}  // namespace kiln::transforms
