// Collective core ops of per-rank programs: all_reduce, all_gather, reduce_scatter, all_to_all,
// broadcast over one mesh axis, point-to-point send/recv, and local_shard (a rank's block of a
// replicated value, no communication). Types are per-rank (local). The
// reference kernels meet the other ranks through the in-process exchange of run_mesh; outside a
// mesh run they are refused.
#include "kiln/ir/interpreter.h"
#include "kiln/ir/mesh_run.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// The mesh axis named by attribute `axis` and its size.
StatusOr<std::pair<int, int64_t>> mesh_axis(const InferContext& ctx) {
  const DeviceMesh& mesh = ctx.node.graph()->mesh();
  const std::string name = ctx.node.get_string("axis");
  if (mesh.empty()) return ctx.error("collective over mesh axis '" + name + "' in a graph without a mesh");
  const int a = mesh.axis_index(name);
  if (a < 0) return ctx.error("mesh " + mesh.str() + " has no axis '" + name + "'");
  return std::make_pair(a, mesh.axes[static_cast<size_t>(a)].size);
}

StatusOr<ReduceOp> reduce_attr(const InferContext& ctx) {
  const std::string s = ctx.node.get_string("reduce");
  const std::optional<ReduceOp> op = parse_reduce_op(s);
  if (!op) return ctx.error("attribute 'reduce' must be 'sum' or 'max', got '" + s + "'");
  return *op;
}

/// send's and recv's `axis`: with it, `peer` is a position along that mesh axis and the other
/// coordinates are the sender's own (a pipeline over one axis of a mesh whose other axes split
/// each stage); without it, a rank of the whole mesh.
AttrSpec p2p_axis_attr() {
  return attr_optional("axis", AttrKind::kString, "mesh axis peer counts along (absent: peer is a rank of the mesh)");
}

Status check_peer(const InferContext& ctx) {
  const DeviceMesh& mesh = ctx.node.graph()->mesh();
  const int64_t peer = ctx.node.get_int("peer");
  const std::string axis = ctx.node.get_string("axis", "");
  if (!axis.empty()) {
    KILN_ASSIGN_OR_RETURN(auto a, mesh_axis(ctx));
    if (peer < 0 || peer >= a.second)
      return ctx.error("peer " + std::to_string(peer) + " is not a position along mesh axis '" + axis + "' of " +
                       std::to_string(a.second));
    return ok_status();
  }
  if (mesh.empty() || peer < 0 || peer >= mesh.num_ranks())
    return ctx.error("peer " + std::to_string(peer) + " is not a rank of mesh " + mesh.str());
  return ok_status();
}

/// The running rank's mesh context, or an error outside run_mesh.
StatusOr<MeshContext*> mesh_of(KernelContext& ctx) {
  MeshContext* m = ctx.interpreter.mesh_context();
  if (m == nullptr || m->exchange == nullptr)
    return ctx.error("a collective runs only as part of a mesh run (run_mesh, or a parallel backend)");
  return m;
}

/// The rank a send or recv talks to (see p2p_axis_attr).
StatusOr<int64_t> peer_rank(KernelContext& ctx, const MeshContext& m) {
  const std::string axis = ctx.node.get_string("axis", "");
  if (axis.empty()) return ctx.node.get_int("peer");
  const int a = m.mesh->axis_index(axis);
  if (a < 0) return ctx.error("the mesh has no axis '" + axis + "'");
  std::vector<int64_t> coords = m.mesh->coords(m.rank);
  coords[static_cast<size_t>(a)] = ctx.node.get_int("peer");
  return m.mesh->rank_at(coords);
}

/// Every group member's tensor (group order) and this rank's position in the group.
StatusOr<std::pair<std::vector<Tensor>, int64_t>> gather_group(KernelContext& ctx, const Tensor& mine) {
  KILN_ASSIGN_OR_RETURN(MeshContext * m, mesh_of(ctx));
  const int a = m->mesh->axis_index(ctx.node.get_string("axis"));
  if (a < 0) return ctx.error("the mesh has no axis '" + ctx.node.get_string("axis") + "'");
  const std::vector<int64_t> group = m->mesh->group(m->rank, a);
  const int64_t seq = m->issued[group]++;
  KILN_ASSIGN_OR_RETURN(std::vector<Tensor> all, m->exchange->exchange(m->rank, group, seq, mine));
  return std::make_pair(std::move(all), m->mesh->coords(m->rank)[static_cast<size_t>(a)]);
}

/// Elementwise reduction in group order, in f64, rounded once (every rank gets the same bits).
void reduce_into(Tensor& out, const std::vector<Tensor>& terms, ReduceOp op) {
  for (int64_t i = 0; i < out.numel(); ++i) {
    double acc = terms[0].get_f64(i);
    for (size_t k = 1; k < terms.size(); ++k) {
      const double v = terms[k].get_f64(i);
      acc = op == ReduceOp::kSum ? acc + v : (v > acc || v != v ? v : acc);
    }
    out.set_f64(i, acc);
  }
}

StatusOr<int64_t> dim_attr(const InferContext& ctx, const std::string& name) {
  return normalize_axis(ctx, ctx.node.get_int(name), ctx.operand(0).rank());
}

/// Multiplies (factor > 0) or divides (factor < 0) static dim `d` of `t`; divisibility checked.
StatusOr<TensorType> rescale_dim(const InferContext& ctx, TensorType t, int64_t d, int64_t times, bool divide) {
  Dim& dim = t.shape[static_cast<size_t>(d)];
  if (!dim.is_static()) return ctx.error("dim " + std::to_string(d) + " must be static, got " + dim.str());
  if (divide && dim.value() % times != 0)
    return ctx.error("dim " + std::to_string(d) + " (" + dim.str() + ") does not divide into " + std::to_string(times) +
                     " ranks");
  dim = Dim(divide ? dim.value() / times : dim.value() * times);
  return t;
}

Status float_or_int(const InferContext& ctx) { return require_dtype(ctx, 0, kNumericDTypes); }

AttrSpec axis_attr() { return attr_required("axis", AttrKind::kString, "mesh axis whose groups take part"); }

}  // namespace

void register_collective_ops(OpRegistry& r) {
  add_op_or_die(r, OpDef{
      .name = "all_reduce",
      .summary = "every rank of the group gets the reduction of the group's tensors",
      .traits = kTraitSideEffects,
      .inputs = {"x"},
      .outputs = {"y"},
      .result_rule = "same as x",
      .attrs = {axis_attr(), attr_default("reduce", Attribute(std::string("sum")), "sum or max")},
      .infer = [](InferContext& ctx) -> Status {
        KILN_RETURN_IF_ERROR(float_or_int(ctx));
        KILN_RETURN_IF_ERROR(mesh_axis(ctx).status());
        KILN_RETURN_IF_ERROR(reduce_attr(ctx).status());
        ctx.results = {ctx.operand(0)};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto got, gather_group(ctx, ctx.input(0)));
        reduce_into(ctx.output(), got.first, *parse_reduce_op(ctx.node.get_string("reduce")));
        return ok_status();
      }});

  add_op_or_die(r, OpDef{
      .name = "all_gather",
      .summary = "the group's tensors concatenated along dim, on every rank of the group",
      .traits = kTraitSideEffects,
      .inputs = {"x"},
      .outputs = {"y"},
      .result_rule = "x with dim multiplied by the size of mesh axis `axis`",
      .attrs = {axis_attr(), attr_default("dim", Attribute(int64_t{0}), "dim to concatenate along")},
      .infer = [](InferContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto axis, mesh_axis(ctx));
        KILN_ASSIGN_OR_RETURN(int64_t d, dim_attr(ctx, "dim"));
        KILN_ASSIGN_OR_RETURN(TensorType t, rescale_dim(ctx, ctx.operand(0), d, axis.second, false));
        ctx.results = {t};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto got, gather_group(ctx, ctx.input(0)));
        const int64_t d = ctx.node.get_int("dim") < 0 ? ctx.node.get_int("dim") + ctx.input(0).rank() : ctx.node.get_int("dim");
        KILN_ASSIGN_OR_RETURN(ctx.output(), concat_dim(got.first, d));
        return ok_status();
      }});

  add_op_or_die(r, OpDef{
      .name = "reduce_scatter",
      .summary = "the reduction of the group's tensors, split along dim: rank k of the group keeps block k",
      .traits = kTraitSideEffects,
      .inputs = {"x"},
      .outputs = {"y"},
      .result_rule = "x with dim divided by the size of mesh axis `axis`",
      .attrs = {axis_attr(), attr_default("dim", Attribute(int64_t{0}), "dim to split"),
                attr_default("reduce", Attribute(std::string("sum")), "sum or max")},
      .infer = [](InferContext& ctx) -> Status {
        KILN_RETURN_IF_ERROR(float_or_int(ctx));
        KILN_ASSIGN_OR_RETURN(auto axis, mesh_axis(ctx));
        KILN_RETURN_IF_ERROR(reduce_attr(ctx).status());
        KILN_ASSIGN_OR_RETURN(int64_t d, dim_attr(ctx, "dim"));
        KILN_ASSIGN_OR_RETURN(TensorType t, rescale_dim(ctx, ctx.operand(0), d, axis.second, true));
        ctx.results = {t};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto got, gather_group(ctx, ctx.input(0)));
        Tensor whole(ctx.input(0).dtype(), ctx.input(0).shape());
        reduce_into(whole, got.first, *parse_reduce_op(ctx.node.get_string("reduce")));
        const int64_t d = ctx.node.get_int("dim") < 0 ? ctx.node.get_int("dim") + whole.rank() : ctx.node.get_int("dim");
        const int64_t block = ctx.output().shape()[static_cast<size_t>(d)];
        KILN_ASSIGN_OR_RETURN(ctx.output(), slice_dim(whole, d, got.second * block, (got.second + 1) * block));
        return ok_status();
      }});

  add_op_or_die(r, OpDef{
      .name = "all_to_all",
      .summary = "split along split_dim, send block k to group rank k, concatenate what arrives along concat_dim",
      .traits = kTraitSideEffects,
      .inputs = {"x"},
      .outputs = {"y"},
      .result_rule = "x with split_dim divided and concat_dim multiplied by the size of mesh axis `axis`",
      .attrs = {axis_attr(), attr_required("split_dim", AttrKind::kInt, "dim split into one block per rank"),
                attr_required("concat_dim", AttrKind::kInt, "dim the received blocks are joined along")},
      .infer = [](InferContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto axis, mesh_axis(ctx));
        KILN_ASSIGN_OR_RETURN(int64_t s, dim_attr(ctx, "split_dim"));
        KILN_ASSIGN_OR_RETURN(int64_t c, dim_attr(ctx, "concat_dim"));
        KILN_ASSIGN_OR_RETURN(TensorType t, rescale_dim(ctx, ctx.operand(0), s, axis.second, true));
        KILN_ASSIGN_OR_RETURN(t, rescale_dim(ctx, t, c, axis.second, false));
        ctx.results = {t};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto got, gather_group(ctx, ctx.input(0)));
        const int64_t rank = ctx.input(0).rank();
        const int64_t s = (ctx.node.get_int("split_dim") + rank) % rank, c = (ctx.node.get_int("concat_dim") + rank) % rank;
        const int64_t block = ctx.input(0).shape()[static_cast<size_t>(s)] / static_cast<int64_t>(got.first.size());
        std::vector<Tensor> mine;
        for (const Tensor& from : got.first) {
          KILN_ASSIGN_OR_RETURN(Tensor b, slice_dim(from, s, got.second * block, (got.second + 1) * block));
          mine.push_back(std::move(b));
        }
        KILN_ASSIGN_OR_RETURN(ctx.output(), concat_dim(mine, c));
        return ok_status();
      }});

  add_op_or_die(r, OpDef{
      .name = "broadcast",
      .summary = "every rank of the group gets the tensor of group rank root",
      .traits = kTraitSideEffects,
      .inputs = {"x"},
      .outputs = {"y"},
      .result_rule = "same as x",
      .attrs = {axis_attr(), attr_default("root", Attribute(int64_t{0}), "position in the group of the sending rank")},
      .infer = [](InferContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto axis, mesh_axis(ctx));
        const int64_t root = ctx.node.get_int("root");
        if (root < 0 || root >= axis.second)
          return ctx.error("root " + std::to_string(root) + " is outside a group of " + std::to_string(axis.second));
        ctx.results = {ctx.operand(0)};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto got, gather_group(ctx, ctx.input(0)));
        ctx.output() = got.first[static_cast<size_t>(ctx.node.get_int("root"))];
        return ok_status();
      }});

  add_op_or_die(r, OpDef{
      .name = "local_shard",
      .summary = "this rank's block of a replicated x along dim (no communication): block k for group rank k",
      .traits = kTraitNone,
      .inputs = {"x"},
      .outputs = {"y"},
      .result_rule = "x with dim divided by the size of mesh axis `axis`",
      .attrs = {axis_attr(), attr_default("dim", Attribute(int64_t{0}), "dim to split")},
      .infer = [](InferContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(auto axis, mesh_axis(ctx));
        KILN_ASSIGN_OR_RETURN(int64_t d, dim_attr(ctx, "dim"));
        KILN_ASSIGN_OR_RETURN(TensorType t, rescale_dim(ctx, ctx.operand(0), d, axis.second, true));
        ctx.results = {t};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(MeshContext * m, mesh_of(ctx));
        const int a = m->mesh->axis_index(ctx.node.get_string("axis"));
        if (a < 0) return ctx.error("the mesh has no axis '" + ctx.node.get_string("axis") + "'");
        const int64_t k = m->mesh->coords(m->rank)[static_cast<size_t>(a)];
        const int64_t d = ctx.node.get_int("dim") < 0 ? ctx.node.get_int("dim") + ctx.input(0).rank() : ctx.node.get_int("dim");
        const int64_t block = ctx.output().shape()[static_cast<size_t>(d)];
        KILN_ASSIGN_OR_RETURN(ctx.output(), slice_dim(ctx.input(0), d, k * block, (k + 1) * block));
        return ok_status();
      }});

  add_op_or_die(r, OpDef{
      .name = "send",
      .summary = "sends x to rank peer (pipeline stages); matched by the recv with the same tag",
      .traits = kTraitSideEffects,
      .inputs = {"x"},
      .outputs = {},
      .result_rule = "no results",
      .attrs = {attr_required("peer", AttrKind::kInt, "receiving rank (with axis: its position along the axis)"),
                attr_default("tag", Attribute(int64_t{0}), "matches one recv of the peer"), p2p_axis_attr()},
      .infer = [](InferContext& ctx) -> Status {
        KILN_RETURN_IF_ERROR(check_peer(ctx));
        ctx.results = {};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(MeshContext * m, mesh_of(ctx));
        KILN_ASSIGN_OR_RETURN(int64_t peer, peer_rank(ctx, *m));
        return m->exchange->send(m->rank, peer, ctx.node.get_int("tag"), ctx.input(0));
      }});

  add_op_or_die(r, OpDef{
      .name = "recv",
      .summary = "receives the tensor rank peer sent with the same tag",
      .traits = kTraitSideEffects,
      .inputs = {},
      .outputs = {"y"},
      .result_rule = "`dtype`[`shape`]",
      .attrs = {attr_required("peer", AttrKind::kInt, "sending rank (with axis: its position along the axis)"),
                attr_default("tag", Attribute(int64_t{0}), "matches one send of the peer"),
                attr_required("dtype", AttrKind::kDType, "element type"),
                attr_required("shape", AttrKind::kInts, "static shape"), p2p_axis_attr()},
      .infer = [](InferContext& ctx) -> Status {
        KILN_RETURN_IF_ERROR(check_peer(ctx));
        Shape shape;
        for (int64_t d : ctx.node.get_ints("shape")) {
          if (d < 0) return ctx.error("shape dims must be >= 0");
          shape.emplace_back(d);
        }
        ctx.results = {TensorType{ctx.node.attr("dtype")->as_dtype(), shape}};
        return ok_status();
      },
      .reference = [](KernelContext& ctx) -> Status {
        KILN_ASSIGN_OR_RETURN(MeshContext * m, mesh_of(ctx));
        KILN_ASSIGN_OR_RETURN(int64_t peer, peer_rank(ctx, *m));
        KILN_ASSIGN_OR_RETURN(Tensor t, m->exchange->recv(m->rank, peer, ctx.node.get_int("tag")));
        if (t.type() != ctx.output().type())
          return ctx.error("received " + t.type().str() + " from rank " + std::to_string(peer) +
                           ", expected " + ctx.output().type().str());
        ctx.output() = std::move(t);
        return ok_status();
      }});
}

}  // namespace kiln
