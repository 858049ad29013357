// The convert-bf16 pass: an f32 graph computes in bf16. Weights are cast at compile time, f32
// inputs are cast on entry, and f32 outputs are cast back so the graph's signature is unchanged.
#include <string>
#include <vector>

#include "fp8.h"

namespace kiln::fp8 {
namespace {

/// Whether `v` feeds a per-tensor scale operand, which the quant ops require in f32.
bool feeds_scale(const Value* v) {
  for (const Use& u : v->uses()) {
    if (u.user == nullptr) continue;
    const std::string& op = u.user->op_name();
    if (((op == "quantize" || op == "dequantize") && u.index == 1) || (op == "scaled_matmul" && (u.index == 2 || u.index == 3)))
      return true;
  }
  return false;
}

class ConvertBf16 : public Pass {
 public:
  StatusOr<bool> run(Graph& g) override {
    for (const auto& n : g.nodes())
      if (n->num_regions() > 0)
        return error_at(n->loc(), StatusCode::kFailedPrecondition,
                        "convert-bf16: " + n->op_name() + " holds a region; run convert-bf16 before fusion passes");
    bool changed = false;
    Node* first = g.nodes().empty() ? nullptr : g.nodes().front().get();
    for (Value* in : g.inputs()) {
      if (in->dtype() != DType::kF32 || !in->has_uses()) continue;
      KILN_ASSIGN_OR_RETURN(Node * c, g.create_node("cast", {in}, {TensorType{DType::kBF16, in->shape()}},
                                                    {{"to", Attribute(DType::kBF16)}}, first, {in->name() + ".bf16"}));
      std::vector<Use> uses = in->uses();
      for (const Use& u : uses)
        if (u.user != c) u.user ? u.user->set_operand(u.index, c->result()) : g.set_output(u.index, c->result());
      changed = true;
    }
    std::vector<DType> out_dtypes;
    for (const Value* v : g.outputs()) out_dtypes.push_back(v->dtype());
    for (Node* n : g.node_list()) {
      if (n->op_name() == "constant") {
        const Attribute* a = n->attr("value");
        if (!a || a->kind() != AttrKind::kTensor || a->as_tensor().dtype() != DType::kF32 || feeds_scale(n->result()))
          continue;
        const Tensor& t = a->as_tensor();
        Tensor b(DType::kBF16, t.shape());
        for (int64_t i = 0; i < t.numel(); ++i) b.set_f64(i, t.get_f64(i));
        n->set_attr("value", Attribute(b));
        changed = true;
        continue;
      }
      // Ops that name an f32 result (cast, range, dequantize, scaled_matmul) now name bf16.
      for (const auto& [name, attr] : n->attrs())
        if (attr.kind() == AttrKind::kDType && attr.as_dtype() == DType::kF32) {
          n->set_attr(name, Attribute(DType::kBF16));
          changed = true;
        }
    }
    KILN_RETURN_IF_ERROR(infer_types(g));
    for (int i = 0; i < g.num_outputs(); ++i) {
      Value* v = g.output(i);
      if (out_dtypes[static_cast<size_t>(i)] != DType::kF32 || v->dtype() != DType::kBF16) continue;
      const std::string name = v->name();
      if (!name.empty()) v->set_name(name + ".bf16");
      KILN_ASSIGN_OR_RETURN(Node * c, g.create_node("cast", {v}, {TensorType{DType::kF32, v->shape()}},
                                                    {{"to", Attribute(DType::kF32)}}, nullptr, {name}));
      g.set_output(i, c->result());
      changed = true;
    }
    return changed;
  }
};

}  // namespace

PassInfo convert_bf16_pass_info() {
  PassInfo info;
  info.name = "convert-bf16";
  info.version = "0.1.0";
  info.summary = "compute an f32 graph in bf16: weights cast at compile time, f32 inputs and outputs cast at the edges";
  info.options = {};
  info.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<ConvertBf16>());
  };
  return info;
}

}  // namespace kiln::fp8
