// Builder: typed node creation for the training passes.
#include "builder.h"

namespace kiln::training {

std::vector<int64_t> require_static(const Shape& s, const std::string& what) {
  if (!is_static(s))
    throw BuildError{invalid_argument(what + " has shape " + shape_str(s) +
                                      "; training graphs need static shapes (give the model fixed dims)")};
  return static_sizes(s);
}

std::vector<Value*> Builder::op_n(const std::string& name, std::vector<Value*> operands, int num_results,
                                  AttrMap attrs) {
  std::vector<TensorType> placeholder(static_cast<size_t>(num_results));
  auto node = g_.create_node(name, std::move(operands), placeholder, std::move(attrs), before_);
  if (!node.ok()) throw BuildError{node.status()};
  Node* n = *node;
  n->set_loc(loc_);
  std::vector<TensorType> in;
  for (Value* v : n->operands()) in.push_back(v->type());
  auto types = infer_node_types(*n, std::move(in));
  if (!types.ok()) {
    Status s = types.status();
    (void)g_.erase_node(n);
    throw BuildError{s};
  }
  std::vector<Value*> out;
  for (int r = 0; r < n->num_results(); ++r) {
    n->result(r)->set_type((*types)[static_cast<size_t>(r)]);
    out.push_back(n->result(r));
  }
  return out;
}

Value* Builder::op(const std::string& name, std::vector<Value*> operands, AttrMap attrs,
                   const std::string& result_name) {
  Value* v = op_n(name, std::move(operands), 1, std::move(attrs))[0];
  if (!result_name.empty()) v->set_name(result_name);
  return v;
}

Value* Builder::constant(Tensor t, const std::string& name) {
  return op("constant", {}, {{"value", Attribute(std::move(t))}}, name);
}

Value* Builder::scalar(double v, DType dtype) { return constant(Tensor::scalar_f64(dtype, v)); }

Value* Builder::zeros(const TensorType& like) {
  const std::vector<int64_t> sizes = require_static(like.shape, "a zero gradient");
  // A broadcast scalar rather than a dense constant: no weight-sized literal in the graph.
  return expand(scalar(0.0, like.dtype), shape_of(sizes));
}

Value* Builder::cast(Value* a, DType to) {
  if (a->dtype() == to) return a;
  return op("cast", {a}, {{"to", Attribute(to)}});
}

Value* Builder::reshape(Value* a, const Shape& shape) {
  if (a->shape() == shape) return a;
  return op("reshape", {a}, {{"shape", Attribute(require_static(shape, "a reshaped gradient"))}});
}

Value* Builder::transpose(Value* a, std::vector<int64_t> perm) {
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity &= perm[i] == static_cast<int64_t>(i);
  if (identity) return a;
  return op("transpose", {a}, {{"perm", Attribute(std::move(perm))}});
}

Value* Builder::transpose_last2(Value* a) {
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < a->type().rank(); ++i) perm.push_back(i);
  std::swap(perm[perm.size() - 1], perm[perm.size() - 2]);
  return transpose(a, perm);
}

Value* Builder::expand(Value* a, const Shape& shape) {
  if (a->shape() == shape) return a;
  return op("expand", {a}, {{"shape", Attribute(require_static(shape, "an expanded gradient"))}});
}

Value* Builder::reduce(const std::string& name, Value* a, std::vector<int64_t> axes, bool keepdims) {
  return op(name, {a}, {{"axes", Attribute(std::move(axes))}, {"keepdims", Attribute(keepdims ? 1 : 0)}});
}

Value* Builder::sum_to(Value* g, const Shape& shape) {
  if (g->shape() == shape) return g;
  const int64_t lead = g->type().rank() - static_cast<int64_t>(shape.size());
  if (lead < 0) throw BuildError{internal_error("sum_to: gradient " + g->type().str() + " has lower rank than " + shape_str(shape))};
  std::vector<int64_t> axes;
  for (int64_t d = 0; d < g->type().rank(); ++d) {
    if (d < lead) {
      axes.push_back(d);
      continue;
    }
    const Dim& want = shape[static_cast<size_t>(d - lead)];
    if (want.is_static() && want.value() == 1 && g->shape()[static_cast<size_t>(d)] != want) axes.push_back(d);
  }
  Value* r = axes.empty() ? g : reduce("reduce_sum", g, axes, /*keepdims=*/true);
  return reshape(r, shape);
}

}  // namespace kiln::training
