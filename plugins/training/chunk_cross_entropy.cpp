// The chunk-cross-entropy pass: a cross-entropy over the logits of an output head
// (`cross_entropy(linear(h, w), t)`) becomes the sum of the same over row chunks of `h`, each
// chunk computing its own logits. Only one chunk's logits (and their softmax and gradient) need
// to be alive at a time, instead of the whole [rows, vocabulary] tensor several times over: the
// chunked head of torchtune and Liger's fused linear cross-entropy. Run it before autocast,
// fp8-training and autodiff, so that each chunk's contraction is cast and differentiated.
//
// A vocabulary that is not a multiple of `align` (GPT-2's 50257) gives logits, and every head
// GEMM operand that is logits or their gradient, a leading dimension whose bytes are not a
// multiple of 16, and cuBLASLt then falls back to kernels several times slower. So the head's
// weight is padded once with zero rows to the next multiple and each chunk's GEMM computes the
// padded logits with the padded columns pushed to kPadLogit, so they get probability 0 and
// gradient exactly 0 and never change the loss. A linear head takes that mask as its bias (its
// own bias padded with kPadLogit): the GEMM's bias epilogue applies it, and the loss reads the
// GEMM's result itself (autocast's bf16, through the cast back) rather than a masked f32 copy; a
// slice and its gradient's pad would be two more copies. A matmul head adds the mask. Autodiff
// gives the weight's gradient as the padded gradient's first rows (nanoGPT pads its vocabulary to
// 50304 by hand, torch.compile pads such strides itself).
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

/// A padded column's logit: finite in every float dtype the head may later be cast to (f16's
/// largest magnitude; the decomposed loss multiplies log-probabilities by a zero one-hot, and an
/// infinite one would give nan), and far enough below any real logit that exp(x - lse)
/// underflows to exactly 0 in f32.
constexpr double kPadLogit = -65504.0;

/// 0 for the vocabulary's `vocab` columns, kPadLogit for the padding. Built from scalars and an
/// integer range, so autodiff does not take it for a weight.
Value* padding_mask(Builder& b, int64_t vocab, int64_t padded, DType dtype) {
  Value* column = b.op("range", {}, {{"start", Attribute(0.0)}, {"limit", Attribute(static_cast<double>(padded))},
                                     {"delta", Attribute(1.0)}, {"dtype", Attribute(DType::kI64)}});
  Value* real = b.op("less", {column, b.scalar(static_cast<double>(vocab), DType::kI64)});
  return b.where(real, b.scalar(0.0, dtype), b.scalar(kPadLogit, dtype));
}

/// `v` padded with `value` at the end of `axis` to `size`.
Value* pad_to(Builder& b, Value* v, int64_t axis, int64_t size, double value = 0.0) {
  const int64_t rank = v->type().rank();
  std::vector<int64_t> pads(static_cast<size_t>(2 * rank), 0);
  pads[static_cast<size_t>(rank + axis)] = size - require_static(v->shape(), "the head's weight")[static_cast<size_t>(axis)];
  AttrMap attrs{{"pads", Attribute(pads)}};
  if (value != 0.0) attrs["value"] = Attribute(value);
  return b.op("pad", {v}, attrs);
}

class ChunkCrossEntropy final : public Pass {
 public:
  ChunkCrossEntropy(int64_t chunks, int64_t align) : chunks_(chunks), align_(align) {}

  StatusOr<bool> run(Graph& g) override {
    if (chunks_ <= 1 && align_ <= 1) return false;
    bool changed = false;
    try {
      Builder b(g);
      for (Node* ce : g.node_list()) {
        if (ce->op_name() != "cross_entropy") continue;
        Node* head = chunkable_head(*ce);
        if (head == nullptr) continue;
        const int64_t vocab = head->result()->shape().back().value();
        // kPadLogit is finite in every float dtype but f8's.
        const DType dt = head->result()->dtype();
        const bool maskable = is_float(dt) && dt != DType::kF8E4M3FN && dt != DType::kF8E5M2;
        const int64_t padded = align_ > 1 && maskable ? (vocab + align_ - 1) / align_ * align_ : vocab;
        if (chunks_ <= 1 && padded == vocab) continue;
        b.set_insertion_point(ce);
        b.set_loc(ce->loc());
        Value* loss = chunked(b, *ce, *head, padded);
        head->result()->set_name("");
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
  /// The loss of `ce` over `head` in row chunks, each chunk's logits computed `padded` wide.
  Value* chunked(Builder& b, const Node& ce, const Node& head, int64_t padded) {
    Value *x = head.operand(0), *target = ce.operand(1);
    std::vector<Value*> operands = head.operands();
    const int64_t vocab = head.result()->shape().back().value();
    Value* mask = nullptr;  // added to each chunk's logits (a matmul head)
    if (padded != vocab) {
      // Once for all chunks: linear's weight [V, D] (and bias [V], whose padding is the mask) or
      // matmul's [D, V].
      const bool linear = head.op_name() == "linear";
      operands[1] = pad_to(b, operands[1], linear ? 0 : 1, padded);
      if (operands.size() > 2) operands[2] = pad_to(b, operands[2], 0, padded, kPadLogit);
      else if (linear) operands.push_back(padding_mask(b, vocab, padded, head.result()->dtype()));
      else mask = padding_mask(b, vocab, padded, head.result()->dtype());
    }
    const std::vector<int64_t> xs = require_static(x->shape(), "the head's input");
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < xs.size(); ++d) rows *= xs[d];
    const int64_t k = std::max<int64_t>(1, std::min(chunks_, rows));
    std::vector<int64_t> sizes;
    for (int64_t c = 0; c < k; ++c) sizes.push_back(rows / k + (c < rows % k ? 1 : 0));
    const AttrMap split{{"axis", Attribute(int64_t{0})}, {"sizes", Attribute(sizes)}};
    Value* flat_x = b.reshape(x, shape_of({rows, xs.back()}));
    Value* flat_target = b.reshape(target, shape_of({rows}));
    std::vector<Value*> xc{flat_x}, tc{flat_target};
    if (k > 1) {
      xc = b.op_n("split", {flat_x}, static_cast<int>(k), split);
      tc = b.op_n("split", {flat_target}, static_cast<int>(k), split);
    }
    const std::string name = head.result()->name();
    const int64_t ignore = ce.get_int("ignore_index");
    Value* total = nullptr;
    for (int64_t c = 0; c < k; ++c) {
      operands[0] = xc[static_cast<size_t>(c)];
      // The chunks keep the head's name as a prefix: fp8-training's `exclude` still finds them.
      const std::string chunk_name = name.empty() || k == 1 ? name : name + ".chunk" + std::to_string(c);
      Value* logits = b.op(head.op_name(), operands, head.attrs(), chunk_name);
      if (mask) logits = b.add(logits, mask);
      if (k == 1) return b.op("cross_entropy", {logits, flat_target}, ce.attrs());  // only padded
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
  int64_t align_;
};

}  // namespace

PassInfo chunk_cross_entropy_pass_info() {
  PassInfo info;
  info.name = "chunk-cross-entropy";
  info.version = "0.3.0";
  info.summary = "cross_entropy of a linear head as a sum over row chunks: one chunk's logits live at a time";
  info.options = {
      {"chunks", OptionType::kInt, int64_t{8}, "row chunks of the head (>= 1; 1 leaves the rows whole)"},
      {"align", OptionType::kInt, int64_t{64},
       "pad the vocabulary to a multiple of this many elements so the head's GEMMs have aligned leading "
       "dimensions (0 or 1: never pad)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    const int64_t chunks = o.get_int("chunks");
    const int64_t align = o.get_int("align");
    if (chunks < 1 || chunks > 4096)
      return invalid_argument("chunk-cross-entropy: option 'chunks' must be in [1, 4096], got " + std::to_string(chunks));
    if (align < 0 || align > 4096)
      return invalid_argument("chunk-cross-entropy: option 'align' must be in [0, 4096], got " + std::to_string(align));
    return std::unique_ptr<Pass>(std::make_unique<ChunkCrossEntropy>(chunks, align));
  };
  return info;
}

}  // namespace kiln::training
