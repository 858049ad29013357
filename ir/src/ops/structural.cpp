// Core structural ops: fused, a node that runs a nested graph (a group made by fusion), and
// pipeline_stage, the work of one rank of a pipeline-parallel program.
#include <unordered_map>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/mesh_run.h"
#include "ops/op_helpers.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// Result types of `body` when its inputs have `inputs` types: every node's shape rule is
/// re-run in order. The region itself was verified separately, so this only narrows types.
StatusOr<std::vector<TensorType>> propagate_types(const Graph& body,
                                                  const std::vector<TensorType>& inputs) {
  std::unordered_map<const Value*, TensorType> types;
  for (int i = 0; i < body.num_inputs(); ++i) types[body.input(i)] = inputs[static_cast<size_t>(i)];
  auto type_of = [&](const Value* v) -> StatusOr<TensorType> {
    auto it = types.find(v);
    if (it == types.end())
      return invalid_argument("region @" + body.name() + " uses %" + v->name() +
                              " before defining it");
    return it->second;
  };
  for (const auto& n : body.nodes()) {
    std::vector<TensorType> operands;
    for (const Value* v : n->operands()) {
      KILN_ASSIGN_OR_RETURN(TensorType t, type_of(v));
      operands.push_back(std::move(t));
    }
    KILN_ASSIGN_OR_RETURN(auto results, infer_node_types(*n, std::move(operands)));
    for (int r = 0; r < n->num_results(); ++r)
      types[n->result(r)] = std::move(results[static_cast<size_t>(r)]);
  }
  std::vector<TensorType> out;
  for (const Value* v : body.outputs()) {
    KILN_ASSIGN_OR_RETURN(TensorType t, type_of(v));
    out.push_back(std::move(t));
  }
  return out;
}

/// Result types are the region's output types. When the operands are more concrete than
/// the region's declared inputs (the interpreter passes static shapes; a fused group may
/// declare symbolic ones), the concrete types are propagated through the region so the
/// results are concrete too. Per dim the static size wins; otherwise the outer name does.
Status infer_fused(InferContext& ctx) {
  const Graph& body = ctx.node.region(0);
  if (body.num_inputs() != ctx.num_operands())
    return ctx.error("region @" + body.name() + " takes " + std::to_string(body.num_inputs()) +
                     " inputs but the node has " + std::to_string(ctx.num_operands()) +
                     " operands");
  if (body.num_outputs() != ctx.num_results())
    return ctx.error("region @" + body.name() + " returns " + std::to_string(body.num_outputs()) +
                     " values but the node has " + std::to_string(ctx.num_results()) + " results");
  std::vector<TensorType> inputs;
  bool as_declared = true;
  for (int i = 0; i < ctx.num_operands(); ++i) {
    const TensorType& got = ctx.operand(i);
    const TensorType& want = body.input(i)->type();
    bool ok = got.dtype == want.dtype && got.rank() == want.rank();
    TensorType merged = got;
    for (size_t d = 0; ok && d < got.shape.size(); ++d) {
      const Dim& g = got.shape[d];
      const Dim& w = want.shape[d];
      ok = !(g.is_static() && w.is_static() && g.value() != w.value());
      if (!g.is_static() && w.is_static()) merged.shape[d] = w;
    }
    if (!ok)
      return ctx.error("operand " + std::to_string(i) + " " + got.str() +
                       " does not match region input %" + body.input(i)->name() + " " + want.str());
    as_declared &= merged == want;
    inputs.push_back(std::move(merged));
  }
  if (as_declared) {
    ctx.results.clear();
    for (const Value* v : body.outputs()) ctx.results.push_back(v->type());
    return ok_status();
  }
  StatusOr<std::vector<TensorType>> results = propagate_types(body, inputs);
  if (!results.ok())
    return ctx.error("in region @" + body.name() + ": " + results.status().message());
  ctx.results = std::move(results).value();
  return ok_status();
}

Status fused_kernel(KernelContext& ctx) {
  const Graph& body = ctx.node.region(0);
  StatusOr<std::vector<Tensor>> outs = ctx.interpreter.run(body, ctx.inputs);
  if (!outs.ok())
    return error_at(
        ctx.node.loc(), outs.status().code(),
        ctx.node.op_name() + ": in region @" + body.name() + ": " + outs.status().message());
  if (outs->size() != ctx.outputs.size())
    return ctx.error("region @" + body.name() + " returned " + std::to_string(outs->size()) +
                     " values for " + std::to_string(ctx.outputs.size()) + " results");
  for (size_t i = 0; i < outs->size(); ++i) ctx.outputs[i] = std::move((*outs)[i]);
  return ok_status();
}

/// Runs the region on the rank named by `rank` (with `axis`, on the ranks at that position along
/// it); every other rank skips it, its results zeros
/// (the last stage's outputs are P(sum) over the stages: one rank holds the value).
Status pipeline_stage_kernel(KernelContext& ctx) {
  const MeshContext* m = ctx.interpreter.mesh_context();
  if (m == nullptr) return ctx.error("a pipeline stage runs only as part of a mesh run (run_mesh, or a parallel backend)");
  const std::string axis = ctx.node.get_string("axis", "");
  const int a = axis.empty() ? -1 : m->mesh->axis_index(axis);
  if (!axis.empty() && a < 0) return ctx.error("the mesh has no axis '" + axis + "'");
  const int64_t mine = a < 0 ? m->rank : m->mesh->coords(m->rank)[static_cast<size_t>(a)];
  if (mine != ctx.node.get_int("rank")) {
    for (size_t i = 0; i < ctx.outputs.size(); ++i) {
      const TensorType& t = ctx.node.result(static_cast<int>(i))->type();
      ctx.outputs[i] = Tensor(t.dtype, static_sizes(t.shape));
    }
    return ok_status();
  }
  return fused_kernel(ctx);
}

Status infer_pipeline_stage(InferContext& ctx) {
  const DeviceMesh& mesh = ctx.node.graph()->mesh();
  const int64_t rank = ctx.node.get_int("rank");
  if (const std::string axis = ctx.node.get_string("axis", ""); !axis.empty()) {
    const int a = mesh.axis_index(axis);
    if (a < 0) return ctx.error("mesh " + mesh.str() + " has no axis '" + axis + "'");
    if (rank < 0 || rank >= mesh.axes[static_cast<size_t>(a)].size)
      return ctx.error("rank " + std::to_string(rank) + " is not a position along mesh axis '" + axis + "' of " +
                       std::to_string(mesh.axes[static_cast<size_t>(a)].size));
    return infer_fused(ctx);
  }
  if (mesh.empty() || rank < 0 || rank >= mesh.num_ranks())
    return ctx.error("rank " + std::to_string(rank) + " is not a rank of mesh " + mesh.str());
  return infer_fused(ctx);
}

}  // namespace

void register_structural_ops(OpRegistry& r) {
  add_op_or_die(r, {.name = "fused",
                    .summary = "runs its region on its operands (a group fusion made one kernel)",
                    .traits = kTraitHasRegions,
                    .inputs = {"xs..."},
                    .outputs = {"ys..."},
                    .result_rule = "the types of the region's outputs, given the operands' types",
                    .attrs = {},
                    .num_regions = 1,
                    .infer = infer_fused,
                    .reference = fused_kernel});
  add_op_or_die(r, {.name = "pipeline_stage",
                    .summary = "one rank's part of a pipeline-parallel program: rank `rank` runs the region, "
                               "the others skip it (zeros)",
                    .traits = kTraitHasRegions | kTraitSideEffects,
                    .inputs = {"xs..."},
                    .outputs = {"ys..."},
                    .result_rule = "the types of the region's outputs",
                    .attrs = {attr_required("rank", AttrKind::kInt,
                                            "the rank that runs the region (with axis: every rank at this position along it)"),
                              attr_optional("axis", AttrKind::kString,
                                            "the mesh axis of the stages, when other axes split each stage's work"),
                              attr_default("microbatches", Attribute(int64_t{1}),
                                           "microbatches the region runs one after another (for reports)")},
                    .num_regions = 1,
                    .infer = infer_pipeline_stage,
                    .reference = pipeline_stage_kernel});
}

}  // namespace kiln
