// The autocast pass: mixed precision by op policy, like torch.autocast. Contractions (the ops
// PyTorch runs in low precision: matmul, linear, conv, attention) take their float32 operands
// cast to bf16 (or f16) and give their result back as float32; every other op (softmax, norms,
// losses, reductions, pointwise math) keeps computing in float32. Run it before autodiff: the
// gradients of those ops then run in low precision too, while the weights, their gradients and
// the optimizer state stay float32 (master weights). fp8-training's FP8 GEMMs (scaled_matmul) keep
// their f8 operands and write their result in the low precision.
#include <set>

#include "autodiff.h"

namespace kiln::training {
namespace {

class Autocast final : public Pass {
 public:
  Autocast(DType low, std::set<std::string> ops) : low_(low), ops_(std::move(ops)) {}

  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    try {
      Builder b(g);
      for (Node* n : g.node_list()) {
        if (!ops_.count(n->op_name()) || n->num_results() != 1 || n->result()->dtype() != DType::kF32) continue;
        b.set_insertion_point(n);
        b.set_loc(n->loc());
        // An FP8 GEMM (fp8-training's scaled_matmul) keeps its f8 operands and f32 scales and
        // gives its result (and takes its bias) in the low dtype, as Transformer Engine's FP8
        // GEMMs write the activation dtype: half the bytes of an f32 result to write and read.
        const bool fp8_gemm = n->op_name() == "scaled_matmul";
        AttrMap attrs = n->attrs();
        if (fp8_gemm) attrs["dtype"] = Attribute(low_);
        std::vector<Value*> operands;
        for (int i = 0; i < n->num_operands(); ++i) {
          Value* v = n->operand(i);
          const bool cast = v->dtype() == DType::kF32 && (!fp8_gemm || i == 4);
          operands.push_back(cast ? b.cast(v, low_) : v);
        }
        Value* low = b.op(n->op_name(), operands, attrs);
        Value* back = b.cast(low, DType::kF32);
        back->set_name(n->result()->name());
        n->result()->set_name("");
        n->result()->replace_all_uses_with(back);
        KILN_RETURN_IF_ERROR(g.erase_node(n));
        changed = true;
      }
    } catch (const BuildError& e) {
      return e.status.with_context("autocast");
    }
    return changed;
  }

 private:
  DType low_;
  std::set<std::string> ops_;
};

}  // namespace

PassInfo autocast_pass_info() {
  PassInfo info;
  info.name = "autocast";
  info.version = "0.1.0";
  info.summary = "mixed precision: contractions compute in bf16/f16 from f32 operands, everything else stays f32";
  info.options = {
      {"dtype", OptionType::kString, std::string("bf16"), "the low precision: bf16 or f16"},
      {"ops", OptionType::kStringList,
       std::vector<std::string>{"matmul", "linear", "conv", "attention", "scaled_matmul"},
       "ops computed in low precision (PyTorch's autocast list for these ops; scaled_matmul, fp8-training's FP8 "
       "GEMM, only gives its result in it)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    const std::string d = o.get_string("dtype");
    if (d != "bf16" && d != "f16")
      return invalid_argument("autocast: option 'dtype' must be bf16 or f16, got '" + d + "'");
    const auto& ops = o.get_strings("ops");
    for (const std::string& op : ops)
      if (!OpRegistry::global().find(op)) return invalid_argument("autocast: option 'ops' names an unknown op '" + op + "'");
    return std::unique_ptr<Pass>(
        std::make_unique<Autocast>(d == "bf16" ? DType::kBF16 : DType::kF16, std::set<std::string>(ops.begin(), ops.end())));
  };
  return info;
}

}  // namespace kiln::training
