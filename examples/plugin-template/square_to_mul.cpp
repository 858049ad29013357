// Example pass plugin: rewrites pow(x, 2) into mul(x, x), which every backend runs faster.
//
// Copy this folder to start a plugin. A plugin is one shared library exporting the entry
// point that KILN_PLUGIN defines; its register function adds passes (or front ends, backends)
// to the registry. Passes rewrite kiln::Graph through the SDK headers only.
#include <kiln/ir/graph.h>
#include <kiln/ir/tensor.h>
#include <kiln/plugin.h>

namespace {

/// True when `v` is produced by a `constant` whose elements all equal `expected`.
bool is_constant_equal_to(const kiln::Value* v, double expected) {
  const kiln::Node* producer = v->producer();
  if (!producer || producer->op_name() != "constant") return false;
  const kiln::Attribute* value = producer->attr("value");
  if (!value || value->kind() != kiln::AttrKind::kTensor) return false;
  const kiln::Tensor& t = value->as_tensor();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (t.get_f64(i) != expected) return false;
  return t.numel() > 0;
}

class SquareToMul : public kiln::Pass {
 public:
  explicit SquareToMul(bool keep_names) : keep_names_(keep_names) {}

  kiln::StatusOr<bool> run(kiln::Graph& g) override {
    bool changed = false;
    for (kiln::Node* n : g.node_list()) {
      if (n->op_name() != "pow" || !is_constant_equal_to(n->operand(1), 2.0)) continue;
      kiln::Value* x = n->operand(0);
      // Broadcasting against a larger exponent would change the shape; leave those alone.
      if (n->result()->type() != x->type()) continue;
      auto mul = g.create_node("mul", {x, x}, {n->result()->type()}, {}, n,
                               {keep_names_ ? n->result()->name() : ""});
      if (!mul.ok()) return mul.status();
      n->result()->set_name("");
      n->result()->replace_all_uses_with((*mul)->result());
      KILN_RETURN_IF_ERROR(g.erase_node(n));
      changed = true;
    }
    return changed;
  }

 private:
  bool keep_names_;
};

kiln::Status register_plugin(kiln::Registry& registry) {
  kiln::PassInfo info;
  info.name = "square-to-mul";
  info.version = "0.1.0";
  info.summary = "rewrite pow(x, 2) as mul(x, x)";
  info.options = {{"keep-names", kiln::OptionType::kBool, true,
                   "give the new mul the name of the pow it replaces"}};
  info.create = [](const kiln::Options& options) -> kiln::StatusOr<std::unique_ptr<kiln::Pass>> {
    return std::unique_ptr<kiln::Pass>(new SquareToMul(options.get_bool("keep-names")));
  };
  return registry.add_pass(std::move(info));
}

}  // namespace

KILN_PLUGIN("square-to-mul", "0.1.0", register_plugin)
