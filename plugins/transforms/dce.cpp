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
    // one walk. Graph inputs are part of the signature and stay, even when unused. A
    // region's own outputs are its roots: dead nodes inside a live region go too.
    auto erase_dead = [&](Node& n) -> StatusOr<WalkAction> {
      if (has_used_results(n) || has_side_effects(n)) return WalkAction::kAdvance;
      KILN_RETURN_IF_ERROR(n.graph()->erase_node(&n));
      changed = true;
      return WalkAction::kSkip;  // its regions went with it
    };
    KILN_RETURN_IF_ERROR(walk(g, erase_dead, {.reverse = true}));
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
