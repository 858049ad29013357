// The chunk-cross-entropy pass: a cross-entropy over the logits of an output head
// (`cross_entropy(linear(h, w), t)`) becomes the sum of the same over row chunks of `h`, each
// chunk computing its own logits. Only one chunk's logits (and their softmax and gradient) need
// to be alive at a time, instead of the whole [rows, vocabulary] tensor several times over: the
// chunked head of torchtune and Liger's fused linear cross-entropy. Run it before autocast,
// fp8-training and autodiff, so that each chunk's contraction is cast and differentiated.
#include "autodiff.h"

namespace kiln::training {
namespace {

/// The head feeding `ce`'s logits when it can be chunked: a linear, or a matmul by a 2-D weight,
/// whose result only `ce` reads.
Node* chunkable_head(const Node& ce) {
  Value* logits = ce.operand(0);
  Node* head = logits->producer();
  if (head == nullptr || head->num_results() != 1 || head->num_regions() > 0) return nullptr;
  if (head->op_name() != "linear" && !(head->op_name() == "matmul" && head->operand(1)->type().rank() == 2))
    return nullptr;
  if (logits->uses().size() != 1 || logits->uses()[0].user != &ce) return nullptr;  // kept or returned elsewhere
  const Shape& x = head->operand(0)->shape();
  if (x.size() < 2 || !is_static(x) || !is_static(logits->shape())) return nullptr;
  return head;
}

class ChunkCrossEntropy final : public Pass {
 public:
  explicit ChunkCrossEntropy(int64_t chunks) : chunks_(chunks) {}

  StatusOr<bool> run(Graph& g) override {
    if (chunks_ <= 1) return false;
    bool changed = false;
    try {
      Builder b(g);
      for (Node* ce : g.node_list()) {
        if (ce->op_name() != "cross_entropy") continue;
        Node* head = chunkable_head(*ce);
        if (head == nullptr) continue;
        b.set_insertion_point(ce);
        b.set_loc(ce->loc());
        Value* loss = chunked(b, *ce, *head);
        loss->set_name(ce->result()->name());
        ce->result()->set_name("");
        ce->result()->replace_all_uses_with(loss);
        KILN_RETURN_IF_ERROR(g.erase_node(ce));
        KILN_RETURN_IF_ERROR(g.erase_node(head));
        changed = true;
      }
    } catch (const BuildError& e) {
      return e.status.with_context("chunk-cross-entropy");
    }
    return changed;
  }

 private:
  Value* chunked(Builder& b, const Node& ce, const Node& head) {
    Value *x = head.operand(0), *target = ce.operand(1);
    const std::vector<int64_t> xs = require_static(x->shape(), "the head's input");
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < xs.size(); ++d) rows *= xs[d];
    const int64_t k = std::min(chunks_, rows);
    std::vector<int64_t> sizes;
    for (int64_t c = 0; c < k; ++c) sizes.push_back(rows / k + (c < rows % k ? 1 : 0));
    const AttrMap split{{"axis", Attribute(int64_t{0})}, {"sizes", Attribute(sizes)}};
    std::vector<Value*> xc = b.op_n("split", {b.reshape(x, shape_of({rows, xs.back()}))}, static_cast<int>(k), split);
    Value* flat_target = b.reshape(target, shape_of({rows}));
    std::vector<Value*> tc = b.op_n("split", {flat_target}, static_cast<int>(k), split);
    const std::string name = head.result()->name();
    const int64_t ignore = ce.get_int("ignore_index");
    Value* total = nullptr;
    for (int64_t c = 0; c < k; ++c) {
      std::vector<Value*> operands = head.operands();
      operands[0] = xc[static_cast<size_t>(c)];
      // The chunks keep the head's name as a prefix: fp8-training's `exclude` still finds them.
      Value* logits = b.op(head.op_name(), operands, head.attrs(), name.empty() ? "" : name + ".chunk" + std::to_string(c));
      Value* part = b.op("cross_entropy", {logits, tc[static_cast<size_t>(c)]},
                         {{"reduction", Attribute("sum")}, {"ignore_index", Attribute(ignore)}});
      total = total ? b.add(total, part) : part;
    }
    if (ce.get_string("reduction") != "mean") return total;
    Value* keep = b.cast(b.op("not_equal", {flat_target, b.scalar(static_cast<double>(ignore), target->dtype())}),
                         total->dtype());
    return b.div(total, b.reduce("reduce_sum", keep, {0}, false));
  }

  int64_t chunks_;
};

}  // namespace

PassInfo chunk_cross_entropy_pass_info() {
  PassInfo info;
  info.name = "chunk-cross-entropy";
  info.version = "0.1.0";
  info.summary = "cross_entropy of a linear head as a sum over row chunks: one chunk's logits live at a time";
  info.options = {
      {"chunks", OptionType::kInt, int64_t{8}, "row chunks of the head (>= 1; 1 leaves the graph as it is)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    const int64_t chunks = o.get_int("chunks");
    if (chunks < 1 || chunks > 4096)
      return invalid_argument("chunk-cross-entropy: option 'chunks' must be in [1, 4096], got " + std::to_string(chunks));
    return std::unique_ptr<Pass>(std::make_unique<ChunkCrossEntropy>(chunks));
  };
  return info;
}

}  // namespace kiln::training
