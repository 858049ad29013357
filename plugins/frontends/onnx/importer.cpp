// The ONNX importer: graph inputs, initializers, node dispatch, constant folding, subgraphs.
#include "importer.h"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <functional>
#include <new>

#include <onnx/defs/schema.h>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

namespace kiln::onnx_fe {
namespace {

constexpr int kMaxOpset = 21;

std::string norm_domain(const std::string& d) { return d == "ai.onnx" ? std::string() : d; }

const HandlerTable& handlers() {
  static const HandlerTable table = [] {
    HandlerTable t;
    register_math_ops(t);
    register_tensor_ops(t);
    register_nn_ops(t);
    register_misc_ops(t);
    return t;
  }();
  return table;
}

/// Bytes of a static type, or an error when its size overflows or passes the limit.
Status check_type_size(const TensorType& t, const ImportLimits& lim, const std::string& what) {
  if (t.rank() > lim.max_rank)
    return out_of_range(what + " has rank " + std::to_string(t.rank()) + ", above the limit of " +
                        std::to_string(lim.max_rank));
  std::vector<int64_t> dims;
  for (const Dim& d : t.shape)
    if (d.is_static()) dims.push_back(d.value());
  KILN_ASSIGN_OR_RETURN(int64_t n, checked_numel(dims, what));
  const int bits = dtype_bits(t.dtype);
  if (n > lim.max_tensor_bytes / bits * 8)
    return out_of_range(what + " " + t.str() + " exceeds the tensor limit of " +
                        std::to_string(lim.max_tensor_bytes) + " bytes");
  return ok_status();
}

/// Ops newer than the onnx library's schemas (Debian's onnx 1.12 knows opset 17): the opset
/// that introduced them and how many leading inputs they require.
struct NewerOp {
  int since;
  int required;
};
const std::map<std::string, NewerOp>& newer_ops() {
  static const std::map<std::string, NewerOp> ops = {
      {"Gelu", {20, 1}}, {"Mish", {18, 1}}, {"GroupNormalization", {18, 3}}};
  return ops;
}

/// Checks the node against its onnx schema: the op exists at this opset and every required
/// input is given, so that importers never see a missing operand they rely on.
Status check_schema(const NodeCtx& ctx, const std::string& domain) {
  const onnx::NodeProto& n = ctx.proto;
  const onnx::OpSchema* s = onnx::OpSchemaRegistry::Schema(n.op_type(), ctx.opset, domain);
  if (s == nullptr) {
    auto it = newer_ops().find(n.op_type());
    if (!domain.empty() || it == newer_ops().end() || ctx.opset < it->second.since)
      return ctx.error(StatusCode::kInvalidArgument, "op does not exist at this opset");
    for (int i = 0; i < it->second.required; ++i)
      if (!ctx.has_input(i)) return ctx.error("required input " + std::to_string(i) + " is missing");
    return ok_status();
  }
  if (s->Deprecated()) return ctx.error(StatusCode::kInvalidArgument, "op is deprecated at this opset");
  const auto& formals = s->inputs();
  int present = 0;
  for (int i = 0; i < n.input_size(); ++i) present += ctx.has_input(i);
  for (size_t i = 0; i < formals.size(); ++i) {
    const auto opt = formals[i].GetOption();
    const bool missing = !ctx.has_input(static_cast<int>(i));
    if (opt == onnx::OpSchema::Single && missing)
      return ctx.error("required input " + std::to_string(i) + " ('" + formals[i].GetName() + "') is missing");
    if (opt != onnx::OpSchema::Variadic) continue;
    if (present < s->min_input())
      return ctx.error("needs at least " + std::to_string(s->min_input()) + " inputs, got " + std::to_string(present));
    for (int k = static_cast<int>(i); k < n.input_size(); ++k)
      if (!ctx.has_input(k)) return ctx.error("variadic input " + std::to_string(k) + " is empty");
  }
  return ok_status();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// NodeCtx

Value* NodeCtx::in(int i) const { return has_input(i) ? imp.lookup(proto.input(i)) : nullptr; }

Status NodeCtx::out(int i, Value* v) {
  if (!has_output(i)) return ok_status();
  if (v->name().empty()) v->set_name(proto.output(i));
  imp.bind(proto.output(i), v);
  return ok_status();
}

const onnx::AttributeProto* NodeCtx::attr(const std::string& name) const {
  for (const auto& a : proto.attribute())
    if (a.name() == name) return &a;
  return nullptr;
}

int64_t NodeCtx::attr_int(const std::string& name, int64_t fallback) const {
  const auto* a = attr(name);
  if (!a) return fallback;
  return a->type() == onnx::AttributeProto::FLOAT ? static_cast<int64_t>(a->f()) : a->i();
}

double NodeCtx::attr_float(const std::string& name, double fallback) const {
  const auto* a = attr(name);
  if (!a) return fallback;
  return a->type() == onnx::AttributeProto::INT ? static_cast<double>(a->i()) : a->f();
}

std::string NodeCtx::attr_string(const std::string& name, const std::string& fallback) const {
  const auto* a = attr(name);
  return a ? a->s() : fallback;
}

std::vector<int64_t> NodeCtx::attr_ints(const std::string& name) const {
  const auto* a = attr(name);
  if (!a) return {};
  return {a->ints().begin(), a->ints().end()};
}

std::vector<double> NodeCtx::attr_floats(const std::string& name) const {
  const auto* a = attr(name);
  if (!a) return {};
  return {a->floats().begin(), a->floats().end()};
}

StatusOr<Tensor> NodeCtx::attr_tensor(const std::string& name) const {
  const auto* a = attr(name);
  if (!a || !a->has_t()) return error("attribute '" + name + "' is missing or not a tensor");
  auto t = imp.tensor(a->t(), "attribute '" + name + "'");
  if (!t.ok()) return error(t.status().code(), t.status().message());
  return t;
}

const Tensor* NodeCtx::constant_of(const Value* v) { return constant_tensor(v); }

StatusOr<Tensor> NodeCtx::const_input(int i, const std::string& role) const {
  Value* v = in(i);
  if (!v) return error("input " + std::to_string(i) + " ('" + role + "') is missing");
  const Tensor* t = constant_of(v);
  if (!t)
    return error("input " + std::to_string(i) + " ('" + role + "', value '" + proto.input(i) +
                 "') must be a constant at import, but it is computed at run time");
  return *t;
}

StatusOr<std::vector<int64_t>> NodeCtx::const_ints(int i, const std::string& role) const {
  KILN_ASSIGN_OR_RETURN(Tensor t, const_input(i, role));
  if (!is_integer(t.dtype()))
    return error("input " + std::to_string(i) + " ('" + role + "') must be an integer tensor, got " +
                 t.type().str());
  return t.to_i64();
}

StatusOr<std::vector<double>> NodeCtx::const_floats(int i, const std::string& role) const {
  KILN_ASSIGN_OR_RETURN(Tensor t, const_input(i, role));
  return t.to_f64();
}

StatusOr<std::vector<int64_t>> NodeCtx::static_shape(const Value* v, const std::string& role) const {
  if (!is_static(v->shape()))
    return error("'" + role + "' has shape " + shape_str(v->shape()) +
                 "; kiln needs static dims here");
  return static_sizes(v->shape());
}

StatusOr<Value*> NodeCtx::op(const std::string& name, std::vector<Value*> operands, AttrMap attrs) {
  KILN_ASSIGN_OR_RETURN(auto r, op_n(name, std::move(operands), std::move(attrs), 1));
  return r[0];
}

StatusOr<std::vector<Value*>> NodeCtx::op_n(const std::string& name, std::vector<Value*> operands,
                                            AttrMap attrs, int n) {
  auto r = imp.emit(name, std::move(operands), std::move(attrs), n);
  if (!r.ok()) return error(r.status().code(), r.status().message());
  return r;
}

Value* NodeCtx::constant(Tensor t) { return imp.make_constant(std::move(t)); }

Value* NodeCtx::scalar(DType t, double v) { return constant(Tensor::scalar_f64(t, v)); }

Value* NodeCtx::ints(const std::vector<int64_t>& v) {
  return constant(Tensor::from_i64(DType::kI64, {static_cast<int64_t>(v.size())}, v));
}

std::string NodeCtx::where() const {
  std::string who = proto.name().empty() ? "(unnamed)" : "'" + proto.name() + "'";
  for (int i = 0; proto.name().empty() && i < proto.output_size(); ++i)
    if (!proto.output(i).empty()) {
      who = "producing '" + proto.output(i) + "'";
      break;
    }
  const std::string domain = proto.domain().empty() ? "ai.onnx" : proto.domain();
  return "onnx node " + who + " (op " + proto.op_type() + ", domain " + domain + ", opset " +
         (opset < 0 ? std::string("none") : std::to_string(opset)) + ")";
}

Status NodeCtx::error(const std::string& message) const {
  return error(StatusCode::kInvalidArgument, message);
}

Status NodeCtx::error(StatusCode code, const std::string& message) const {
  if (message.rfind("onnx node ", 0) == 0) return Status(code, message);
  return Status(code, where() + ": " + message);
}

// ---------------------------------------------------------------------------------------
// Importer

Importer::Importer(std::shared_ptr<const onnx::ModelProto> model, std::string path,
                   ImportOptions opts)
    : model_(std::move(model)), path_(std::move(path)), opts_(std::move(opts)) {
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  src_.base_dir = parent.empty() ? "." : parent.string();
  src_.owner = model_;
  src_.mapped = &mapped_;
  src_.limits = opts_.limits;
  for (const auto& o : model_->opset_import()) opsets_[norm_domain(o.domain())] = static_cast<int>(o.version());
}

int Importer::opset(const std::string& domain) const {
  auto it = opsets_.find(norm_domain(domain));
  return it == opsets_.end() ? -1 : it->second;
}

Value* Importer::lookup(const std::string& name) const {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    auto f = it->values.find(name);
    if (f != it->values.end()) return f->second;
  }
  return nullptr;
}

void Importer::bind(const std::string& name, Value* v) { scopes_.back().values[name] = v; }

StatusOr<Tensor> Importer::tensor(const onnx::TensorProto& t, const std::string& what) {
  return tensor_from_proto(t, src_, what);
}

Value* Importer::make_constant(Tensor t) {
  TensorType type = t.type();
  auto n = graph_->create_node("constant", {}, {type}, {{"value", Attribute(std::move(t))}});
  return n.ok() ? (*n)->result(0) : nullptr;  // "constant" is a core op: creation cannot fail
}

StatusOr<std::vector<Value*>> Importer::emit(const std::string& op, std::vector<Value*> operands,
                                             AttrMap attrs, int n) {
  std::vector<TensorType> operand_types;
  for (const Value* v : operands) {
    if (!v) return internal_error(op + ": a missing operand reached the importer");
    operand_types.push_back(v->type());
  }
  // Unrolled loops multiply nodes: cap what the import may build, not only what the file holds.
  if (graph_->num_nodes() > 8 * opts_.limits.max_nodes)
    return out_of_range("the import built more than " + std::to_string(8 * opts_.limits.max_nodes) +
                        " kiln nodes (8 times the node limit)");
  KILN_ASSIGN_OR_RETURN(Node * node, graph_->create_node(op, operands,
                                                        std::vector<TensorType>(static_cast<size_t>(n)),
                                                        std::move(attrs)));
  auto inferred = infer_node_types(*node, operand_types);
  Status bad;
  if (!inferred.ok()) bad = inferred.status();
  for (int i = 0; bad.ok() && i < n; ++i) {
    node->result(i)->set_type((*inferred)[static_cast<size_t>(i)]);
    bad = check_type_size(node->result(i)->type(), opts_.limits, op + " result");
  }
  if (!bad.ok()) {
    (void)graph_->erase_node(node);
    return bad;
  }
  bool foldable = node->num_regions() == 0;
  int64_t bytes = 0;
  for (const Value* v : operands) {
    const Tensor* t = NodeCtx::constant_of(v);
    foldable &= t != nullptr;
    if (t) bytes += static_cast<int64_t>(t->nbytes());  // bounds the work folding may do
  }
  for (int i = 0; foldable && i < n; ++i) {
    const TensorType& t = node->result(i)->type();
    foldable = is_static(t.shape);
    if (foldable) bytes += dtype_storage_bytes(t.dtype, num_elements(t.shape));
  }
  if (!foldable || bytes > opts_.fold_limit_bytes) return node->results();

  std::vector<Tensor> ins, outs;
  for (const Value* v : operands) ins.push_back(*NodeCtx::constant_of(v));
  for (int i = 0; i < n; ++i) {
    const TensorType& t = node->result(i)->type();
    outs.emplace_back(t.dtype, static_sizes(t.shape));
  }
  Interpreter interp;
  KernelContext kc{*node, ins, outs, interp};
  Status s;
  try {
    s = node->op()->reference(kc);
  } catch (const std::exception& e) {
    s = internal_error(op + ": folding failed: " + e.what());
  }
  (void)graph_->erase_node(node);
  if (!s.ok()) return s;
  std::vector<Value*> res;
  for (Tensor& t : outs) res.push_back(make_constant(std::move(t)));
  return res;
}

Status Importer::check_sizes(const onnx::GraphProto& g, int depth, int64_t& nodes) const {
  if (depth > opts_.limits.max_nesting)
    return out_of_range("onnx graph '" + g.name() + "' is nested " + std::to_string(depth) +
                        " deep, above the limit of " + std::to_string(opts_.limits.max_nesting));
  nodes += g.node_size();
  if (nodes > opts_.limits.max_nodes)
    return out_of_range("onnx model has more than " + std::to_string(opts_.limits.max_nodes) +
                        " nodes (the node limit)");
  for (const auto& n : g.node())
    for (const auto& a : n.attribute()) {
      if (a.has_g()) KILN_RETURN_IF_ERROR(check_sizes(a.g(), depth + 1, nodes));
      for (const auto& sub : a.graphs()) KILN_RETURN_IF_ERROR(check_sizes(sub, depth + 1, nodes));
    }
  return ok_status();
}

std::set<std::string> Importer::names_needed_constant(const onnx::GraphProto& g) const {
  std::set<std::string> need;
  std::function<void(const onnx::GraphProto&)> slots = [&](const onnx::GraphProto& gg) {
    for (const auto& n : gg.node()) {
      const int v = opset(n.domain());
      for (int i = 0; i < n.input_size(); ++i)
        if (!n.input(i).empty() && needs_constant_input(n.op_type(), v, i)) need.insert(n.input(i));
      for (const auto& a : n.attribute()) {
        if (a.has_g()) slots(a.g());
        for (const auto& sub : a.graphs()) slots(sub);
      }
    }
  };
  slots(g);
  // A value is needed when a needed value is computed from it (shape-only ops excepted).
  for (int i = g.node_size() - 1; i >= 0; --i) {
    const auto& n = g.node(i);
    if (n.op_type() == "Shape" || n.op_type() == "Size") continue;
    bool produces = false;
    for (const auto& o : n.output()) produces |= need.count(o) != 0;
    if (produces)
      for (const auto& in : n.input())
        if (!in.empty()) need.insert(in);
  }
  return need;
}

Status Importer::add_inputs(const onnx::GraphProto& g) {
  const std::set<std::string> need = names_needed_constant(g);
  std::set<std::string> seen;
  for (const auto& vi : g.input()) {
    const std::string& name = vi.name();
    if (scopes_.back().values.count(name)) continue;  // has an initializer: a constant
    const std::string what = "graph input '" + name + "'";
    if (!seen.insert(name).second) return invalid_argument(what + " is declared twice");
    if (!vi.type().has_tensor_type())
      return unimplemented(what + " is not a tensor (a sequence, map or optional), which kiln does not support");
    const auto& tt = vi.type().tensor_type();
    KILN_ASSIGN_OR_RETURN(DType dt, kiln_dtype(tt.elem_type(), what));
    if (!tt.has_shape()) return invalid_argument(what + " has no shape; kiln needs at least its rank");
    TensorType type{dt, {}};
    for (const auto& d : tt.shape().dim()) {
      if (d.has_dim_value()) {
        if (d.dim_value() < 0)
          return invalid_argument(what + " has negative dim " + std::to_string(d.dim_value()));
        type.shape.push_back(Dim(d.dim_value()));
      } else if (d.has_dim_param() && !d.dim_param().empty()) {
        auto fixed = opts_.dim_values.find(d.dim_param());
        type.shape.push_back(fixed != opts_.dim_values.end() ? Dim(fixed->second) : Dim::symbol(d.dim_param()));
      } else {
        type.shape.push_back(Dim::unknown());
      }
    }
    KILN_RETURN_IF_ERROR(check_type_size(type, opts_.limits, what));
    auto given = opts_.input_values.find(name);
    if (need.count(name) && given != opts_.input_values.end()) {
      const Tensor& t = given->second;
      bool ok = t.dtype() == dt && t.rank() == type.rank();
      for (size_t d = 0; ok && d < type.shape.size(); ++d)
        ok = !type.shape[d].is_static() || type.shape[d].value() == t.shape()[d];
      if (!ok)
        return invalid_argument(what + " is declared " + type.str() + " but its given value is " +
                                t.type().str());
      Value* c = make_constant(t);
      c->set_name(name);
      bind(name, c);
      continue;
    }
    bind(name, graph_->add_input(name, type));
  }
  return ok_status();
}

Status Importer::import_nodes(const onnx::GraphProto& g, int depth) {
  for (const auto& n : g.node()) KILN_RETURN_IF_ERROR(import_node(n, depth));
  return ok_status();
}

Status Importer::import_node(const onnx::NodeProto& n, int depth) {
  ++node_index_;
  const std::string domain = norm_domain(n.domain());
  const int v = opset(domain);
  NodeCtx ctx(*this, n, v, depth);
  if (v < 0)
    return ctx.error(StatusCode::kInvalidArgument,
                     "domain '" + n.domain() + "' is not in the model's opset_import");
  for (int i = 0; i < n.input_size(); ++i)
    if (!n.input(i).empty() && lookup(n.input(i)) == nullptr)
      return ctx.error(StatusCode::kNotFound,
                       "input " + std::to_string(i) + " '" + n.input(i) +
                           "' is not defined (no initializer, graph input or earlier node produces it)");
  const auto& table = handlers();
  auto h = table.find(domain.empty() ? n.op_type() : domain + "/" + n.op_type());
  if (h == table.end())
    return ctx.error(StatusCode::kUnimplemented, "op is not supported by kiln's onnx front end");
  KILN_RETURN_IF_ERROR(check_schema(ctx, domain));
  Status s;
  try {
    s = h->second(ctx);
  } catch (const std::bad_alloc&) {
    s = out_of_range("out of memory");
  } catch (const std::exception& e) {
    s = internal_error(std::string("unexpected exception: ") + e.what());
  }
  if (!s.ok()) return ctx.error(s.code(), s.message());
  for (int i = 0; i < n.output_size(); ++i)
    if (!n.output(i).empty() && scopes_.back().values.count(n.output(i)) == 0)
      return ctx.error(StatusCode::kUnimplemented,
                       "output " + std::to_string(i) + " ('" + n.output(i) + "') is not supported");
  return ok_status();
}

StatusOr<std::vector<Value*>> Importer::inline_graph(const onnx::GraphProto& body,
                                                     const std::vector<Value*>& inputs, int depth) {
  if (static_cast<int>(inputs.size()) != body.input_size())
    return invalid_argument("subgraph '" + body.name() + "' takes " +
                            std::to_string(body.input_size()) + " inputs, got " +
                            std::to_string(inputs.size()));
  scopes_.emplace_back();
  auto run = [&]() -> StatusOr<std::vector<Value*>> {
    for (const auto& init : body.initializer()) {
      KILN_ASSIGN_OR_RETURN(Tensor t, tensor(init, "initializer '" + init.name() + "'"));
      bind(init.name(), make_constant(std::move(t)));
    }
    for (int i = 0; i < body.input_size(); ++i) bind(body.input(i).name(), inputs[static_cast<size_t>(i)]);
    KILN_RETURN_IF_ERROR(import_nodes(body, depth));
    std::vector<Value*> outs;
    for (const auto& o : body.output()) {
      Value* v = lookup(o.name());
      if (!v) return invalid_argument("subgraph '" + body.name() + "' output '" + o.name() + "' is not produced");
      outs.push_back(v);
    }
    return outs;
  };
  auto r = run();
  scopes_.pop_back();
  return r;
}

Status Importer::set_outputs(const onnx::GraphProto& g) {
  if (g.output_size() == 0) return invalid_argument("onnx graph '" + g.name() + "' declares no outputs");
  std::vector<Value*> outs;
  std::vector<std::string> names;
  for (const auto& vi : g.output()) {
    const std::string what = "graph output '" + vi.name() + "'";
    Value* v = lookup(vi.name());
    if (!v) return not_found(what + " is not produced by any node, initializer or input");
    if (vi.type().has_tensor_type()) {
      const auto& tt = vi.type().tensor_type();
      if (tt.elem_type() != 0) {
        KILN_ASSIGN_OR_RETURN(DType dt, kiln_dtype(tt.elem_type(), what));
        if (dt != v->dtype())
          return internal_error(what + " is declared " + onnx_type_name(tt.elem_type()) +
                                " but kiln computes " + v->type().str());
      }
      if (tt.has_shape()) {
        bool ok = tt.shape().dim_size() == v->type().rank();
        for (int d = 0; ok && d < tt.shape().dim_size(); ++d) {
          const auto& dd = tt.shape().dim(d);
          const Dim& got = v->shape()[static_cast<size_t>(d)];
          ok = !dd.has_dim_value() || !got.is_static() || dd.dim_value() == got.value();
        }
        if (!ok) return internal_error(what + " has a declared shape that differs from kiln's " + v->type().str());
      }
    } else {
      return unimplemented(what + " is not a tensor, which kiln does not support");
    }
    outs.push_back(v);
    names.push_back(vi.name());  // the model's name, even where the value is an input or shared
  }
  graph_->set_outputs(outs, names);
  return ok_status();
}

StatusOr<std::unique_ptr<Graph>> Importer::run() {
  const int v = opset("");
  if (v > kMaxOpset)
    return unimplemented("onnx model imports opset " + std::to_string(v) +
                         " of the default domain; kiln supports up to " + std::to_string(kMaxOpset));
  const onnx::GraphProto& g = model_->graph();
  int64_t nodes = 0;
  KILN_RETURN_IF_ERROR(check_sizes(g, 0, nodes));
  graph_ = std::make_unique<Graph>(g.name().empty() ? "main" : g.name());
  scopes_.clear();
  scopes_.emplace_back();
  if (g.sparse_initializer_size() > 0)
    return unimplemented("sparse initializers are not supported");
  for (const auto& init : g.initializer()) {
    KILN_ASSIGN_OR_RETURN(Tensor t, tensor(init, "initializer '" + init.name() + "'"));
    Value* c = make_constant(std::move(t));
    c->set_name(init.name());
    bind(init.name(), c);
  }
  KILN_RETURN_IF_ERROR(add_inputs(g));
  KILN_RETURN_IF_ERROR(import_nodes(g, 0));
  KILN_RETURN_IF_ERROR(set_outputs(g));
  Status s = verify(*graph_);
  if (!s.ok()) return internal_error("onnx import produced an invalid graph: " + s.message());
  return std::move(graph_);
}

StatusOr<std::unique_ptr<Graph>> import_onnx(const std::string& path, const ImportOptions& opts) {
  KILN_RETURN_IF_ERROR(register_extra_ops());
  KILN_ASSIGN_OR_RETURN(std::shared_ptr<onnx::ModelProto> model, read_model_file(path, opts.limits));
  Importer imp(std::move(model), path, opts);
  return imp.run();
}

}  // namespace kiln::onnx_fe
