// The data- and tensor-parallel policies: which inputs split along the batch, which weights
// split column- or row-wise; the partitioner does the rest.
#include "strategies.h"

#include <algorithm>
#include <map>
#include <optional>

#include "kiln/ir/op.h"
#include "partition.h"

namespace kiln::parallel {
namespace {

/// Column parallel for a replicated activation, row parallel for one already split along its
/// features: the choice Megatron makes for each projection pair.
std::optional<Sharding> megatron_layout(const WeightChoice& c, size_t axis, const TensorParallelConfig& cfg) {
  const Value* w = c.node.operand(c.weight_operand);
  const Value* x = c.node.operand(c.weight_operand == 1 ? 0 : 1);
  const bool is_weight = w->is_graph_input() || (w->producer() && w->producer()->op_name() == "constant");
  const bool conv = c.node.op_name() == "conv";
  if (!is_weight || (conv ? w->type().rank() < 3 : w->type().rank() != 2) ||
      num_elements(w->shape()) < std::max<int64_t>(cfg.min_size, 1))
    return std::nullopt;
  Sharding s(static_cast<size_t>(cfg.mesh.rank()), Placement::replicate());
  if (c.node.op_name() == "gather") {  // an embedding table: split its vocabulary rows
    if (!cfg.vocab_parallel) return std::nullopt;
    s[axis] = Placement::shard(0);  // the partitioner pads a vocabulary the ranks do not divide
    return s;
  }
  // linear's and conv's weights are [out, in, ...]; matmul's is [in, out].
  const bool out_first = c.node.op_name() == "linear" || conv;
  const int64_t out_dim = out_first ? 0 : 1, in_dim = out_first ? 1 : 0;
  const Placement act = c.activation[axis];
  const int64_t feature_dim = conv ? 1 : x->type().rank() - 1;  // where the activation's features are
  const bool split_features = act.is_shard() && act.dim == feature_dim;
  s[axis] = Placement::shard(split_features ? in_dim : out_dim);
  if (!check_sharding(s, cfg.mesh, w->type()).ok()) return std::nullopt;
  return s;
}

/// The output layouts of ZeRO-1: every gradient output ('<weight>.grad' of a weight, as the
/// autodiff pass names them) split over mesh axis `axis` along its first dim the axis divides;
/// others as partition leaves them (a gradient no dim of which divides stays whole).
StatusOr<std::vector<Sharding>> gradient_blocks(const Graph& g, int axis, const std::string& who) {
  static const std::string kSuffix = ".grad";
  std::vector<Sharding> layouts(static_cast<size_t>(g.num_outputs()));
  bool any = false;
  for (int i = 0; i < g.num_outputs(); ++i) {
    const std::string& name = g.output_name(i);
    if (name.size() <= kSuffix.size() || !name.ends_with(kSuffix)) continue;
    const std::string weight = name.substr(0, name.size() - kSuffix.size());
    bool known = false;
    for (const auto& n : g.nodes())
      for (const Value* v : n->results()) known |= v->name() == weight;
    if (!known) continue;
    any = true;
    const TensorType& t = g.output(i)->type();
    for (int64_t d = 0; d < t.rank(); ++d) {
      Sharding s(static_cast<size_t>(g.mesh().rank()), Placement::replicate());
      s[static_cast<size_t>(axis)] = Placement::shard(d);
      if (check_sharding(s, g.mesh(), t).ok()) {
        layouts[static_cast<size_t>(i)] = s;
        break;
      }
    }
  }
  if (!any)
    return failed_precondition(who + ": shard-optimizer-state needs a training step's gradients ('<weight>.grad' "
                               "outputs): run the strategy after autodiff and before the optimizer");
  return layouts;
}

/// Adds a node typed by its op's shape rule on its operands, laid out as `layout`.
StatusOr<Node*> append(Graph& g, const std::string& op, std::vector<Value*> operands, AttrMap attrs, int results,
                       const Sharding& layout) {
  KILN_ASSIGN_OR_RETURN(Node * n, g.create_node(op, std::move(operands), std::vector<TensorType>(static_cast<size_t>(results)),
                                                std::move(attrs)));
  std::vector<TensorType> in;
  for (const Value* v : n->operands()) in.push_back(v->type());
  KILN_ASSIGN_OR_RETURN(std::vector<TensorType> types, infer_node_types(*n, in));
  for (int i = 0; i < results; ++i) {
    n->result(i)->set_type(types[static_cast<size_t>(i)]);
    n->result(i)->set_sharding(layout);
  }
  return n;
}

/// PyTorch DDP's gradient buckets: the all-reduces partition put on gradient outputs ('.grad')
/// over mesh axis `axis`, grouped by dtype into buckets of up to `bucket_bytes`, each one
/// all-reduce of the flattened gradients concatenated, split back after. Fewer, larger
/// collectives: each has a fixed latency. The sums are elementwise, so the values are the same.
Status bucket_gradient_all_reduces(Graph& g, int axis, int64_t bucket_bytes) {
  const std::string axis_name = g.mesh().axes[static_cast<size_t>(axis)].name;
  struct Member {
    int output;
    Node* reduce;
  };
  std::vector<std::vector<Member>> buckets;
  std::map<DType, size_t> open;  // the bucket still filling, per dtype
  std::map<size_t, int64_t> filled;
  for (int i = 0; i < g.num_outputs(); ++i) {
    Value* v = g.output(i);
    Node* n = v->producer();
    if (!g.output_name(i).ends_with(".grad") || n == nullptr || n->op_name() != "all_reduce" ||
        n->get_string("axis") != axis_name || n->get_string("reduce", "sum") != "sum" || v->uses().size() != 1 ||
        !is_static(v->shape()))
      continue;
    const int64_t bytes = dtype_storage_bytes(v->dtype(), num_elements(v->shape()));
    auto it = open.find(v->dtype());
    if (it == open.end() || filled[it->second] + bytes > bucket_bytes) {
      buckets.emplace_back();
      it = open.insert_or_assign(v->dtype(), buckets.size() - 1).first;
    }
    buckets[it->second].push_back({i, n});
    filled[it->second] += bytes;
  }
  Sharding partial(static_cast<size_t>(g.mesh().rank()), Placement::replicate()), whole = partial;
  partial[static_cast<size_t>(axis)] = Placement::partial();
  for (const std::vector<Member>& bucket : buckets) {
    if (bucket.size() < 2) continue;
    std::vector<Value*> flat;
    std::vector<int64_t> sizes;
    for (const Member& m : bucket) {
      Value* x = m.reduce->operand(0);
      sizes.push_back(num_elements(x->shape()));
      KILN_ASSIGN_OR_RETURN(Node * r, append(g, "reshape", {x}, {{"shape", Attribute(std::vector<int64_t>{sizes.back()})}}, 1, partial));
      flat.push_back(r->result());
    }
    KILN_ASSIGN_OR_RETURN(Node * cat, append(g, "concat", flat, {{"axis", Attribute(int64_t{0})}}, 1, partial));
    KILN_ASSIGN_OR_RETURN(Node * sum, append(g, "all_reduce", {cat->result()},
                                             {{"axis", Attribute(axis_name)}, {"reduce", Attribute(std::string("sum"))}}, 1, whole));
    sum->result()->set_name("grad_bucket");
    KILN_ASSIGN_OR_RETURN(Node * parts, append(g, "split", {sum->result()},
                                               {{"axis", Attribute(int64_t{0})}, {"sizes", Attribute(sizes)}},
                                               static_cast<int>(bucket.size()), whole));
    for (size_t k = 0; k < bucket.size(); ++k) {
      Value* old = bucket[k].reduce->result();
      KILN_ASSIGN_OR_RETURN(Node * r, append(g, "reshape", {parts->result(static_cast<int>(k))},
                                             {{"shape", Attribute(static_sizes(old->shape()))}}, 1, whole));
      r->result()->set_name(old->name());
      g.set_output(bucket[k].output, r->result());
      KILN_RETURN_IF_ERROR(g.erase_node(bucket[k].reduce));
    }
  }
  return ok_status();
}

/// Splits the batch inputs over each of `axes` too (after the split already on them).
Status shard_batch_over(Graph& g, const std::vector<std::string>& axes, int64_t batch_dim,
                        const std::vector<std::string>& inputs, const std::string& who) {
  for (const std::string& name : axes) {
    KILN_ASSIGN_OR_RETURN(int a, strategy_axis(g.mesh(), name, 0, who));
    KILN_RETURN_IF_ERROR(shard_batch_inputs(g, a, batch_dim, inputs, who));
  }
  return ok_status();
}

}  // namespace

Status apply_data_parallel(Graph& g, const DataParallelConfig& cfg, const std::string& who) {
  KILN_RETURN_IF_ERROR(start_strategy(g, cfg.mesh, who));
  KILN_ASSIGN_OR_RETURN(int axis, strategy_axis(cfg.mesh, cfg.axis, 0, who));
  KILN_RETURN_IF_ERROR(shard_batch_inputs(g, axis, cfg.batch_dim, cfg.inputs, who));
  KILN_RETURN_IF_ERROR(shard_batch_over(g, cfg.extra_batch_axes, cfg.batch_dim, cfg.inputs, who));
  PartitionOptions opt;
  if (cfg.shard_optimizer_state) {
    KILN_ASSIGN_OR_RETURN(opt.output_layouts, gradient_blocks(g, axis, who));
  }
  KILN_RETURN_IF_ERROR(partition(g, opt).status());
  if (cfg.bucket_bytes > 0) KILN_RETURN_IF_ERROR(bucket_gradient_all_reduces(g, axis, cfg.bucket_bytes));
  return ok_status();
}

Status apply_tensor_parallel(Graph& g, const TensorParallelConfig& cfg, const std::string& who) {
  KILN_RETURN_IF_ERROR(start_strategy(g, cfg.mesh, who));
  KILN_ASSIGN_OR_RETURN(int axis, strategy_axis(cfg.mesh, cfg.axis, -1, who));
  int dp = -1;
  if (!cfg.data_axis.empty()) {
    KILN_ASSIGN_OR_RETURN(dp, strategy_axis(cfg.mesh, cfg.data_axis, 0, who));
    if (dp == axis) return invalid_argument(who + ": data-axis and axis are both '" + cfg.data_axis + "'");
    KILN_RETURN_IF_ERROR(shard_batch_inputs(g, dp, cfg.batch_dim, cfg.inputs, who));
  }
  KILN_RETURN_IF_ERROR(shard_batch_over(g, cfg.extra_batch_axes, cfg.batch_dim, cfg.inputs, who));
  PartitionOptions opt;
  opt.policy.weight_layout = [cfg, axis](const WeightChoice& c) {
    return megatron_layout(c, static_cast<size_t>(axis), cfg);
  };
  if (cfg.sequence_parallel) opt.policy.shard_partial_sums_along = cfg.sequence_dim;
  if (cfg.replicate_outputs)
    for (int i = 0; i < g.num_outputs(); ++i) {
      Sharding s(static_cast<size_t>(cfg.mesh.rank()), Placement::replicate());
      if (dp >= 0 && g.output(i)->type().rank() > cfg.batch_dim) {
        s[static_cast<size_t>(dp)] = Placement::shard(cfg.batch_dim);
        if (!check_sharding(s, cfg.mesh, g.output(i)->type()).ok()) s[static_cast<size_t>(dp)] = Placement::replicate();
      }
      opt.output_layouts.push_back(s);
    }
  return partition(g, opt).status();
}

}  // namespace kiln::parallel
