// Pipeline parallelism: cut points (places in the layer sequence where at most one activation
// crosses), stages balanced by the cost model, microbatches from the data-parallel partitioner,
// and the per-rank program: one pipeline_stage node per rank, passing activations with send/recv.
#include "pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "kiln/core/memory_estimate.h"
#include "kiln/ir/op.h"
#include "partition.h"
#include "strategies.h"

namespace kiln::parallel {
namespace {

bool is_collective_op(const std::string& op) {
  return op == "all_reduce" || op == "all_gather" || op == "reduce_scatter" || op == "all_to_all" ||
         op == "broadcast" || op == "send" || op == "recv";
}

/// The mesh axis a stage's microbatches are cut over while the strategy builds them (never part
/// of the per-rank program's mesh).
constexpr const char* kMicroAxis = "mb";

/// What each axis of the pipeline's mesh does: one carries the stages; the others (optional)
/// split each stage's batch (data parallelism) or its weights (tensor parallelism).
struct PipelineAxes {
  int stage = 0, data = -1, tensor = -1;
};

StatusOr<PipelineAxes> pipeline_axes(const PipelineConfig& cfg, const std::string& who) {
  const DeviceMesh& mesh = cfg.mesh;
  if (mesh.empty()) return invalid_argument(who + ": the mesh has no axes; give the stages' axis, e.g. \"pp=4\"");
  auto find = [&](const std::string& given, const char* fallback, const char* option) -> StatusOr<int> {
    if (given.empty()) return mesh.axis_index(fallback);  // -1: no such axis
    const int a = mesh.axis_index(given);
    if (a < 0) return invalid_argument(who + ": " + option + " '" + given + "' is not an axis of mesh " + mesh.str());
    return a;
  };
  PipelineAxes ax;
  KILN_ASSIGN_OR_RETURN(ax.stage, find(cfg.stage_axis, "pp", "stage-axis"));
  if (ax.stage < 0) ax.stage = 0;
  KILN_ASSIGN_OR_RETURN(ax.data, find(cfg.data_axis, "dp", "data-axis"));
  KILN_ASSIGN_OR_RETURN(ax.tensor, find(cfg.tensor_axis, "tp", "tensor-axis"));
  const std::string stage_name = mesh.axes[static_cast<size_t>(ax.stage)].name;
  if (ax.data == ax.stage || ax.tensor == ax.stage)
    return invalid_argument(who + ": axis '" + stage_name + "' of mesh " + mesh.str() +
                            " carries the stages; it cannot also split each stage's " +
                            (ax.data == ax.stage ? "batch (data-axis)" : "weights (tensor-axis)"));
  if (ax.data >= 0 && ax.data == ax.tensor)
    return invalid_argument(who + ": data-axis and tensor-axis are both '" + mesh.axes[static_cast<size_t>(ax.data)].name + "'");
  for (int a = 0; a < mesh.rank(); ++a) {
    const std::string& name = mesh.axes[static_cast<size_t>(a)].name;
    if (name == kMicroAxis)
      return invalid_argument(who + ": mesh axis name '" + name + "' is taken by the microbatches; name the axis otherwise");
    if (a != ax.stage && a != ax.data && a != ax.tensor)
      return invalid_argument(who + ": axis '" + name + "' of mesh " + mesh.str() + " has no role: the stages run along '" +
                              stage_name + "'; another axis splits each stage's batch (data-axis, by default the axis "
                              "named dp) or its weights (tensor-axis, by default tp)");
  }
  return ax;
}

/// The model for one microbatch as one rank of a stage runs it: the batch inputs' batch dim cut
/// into `m` microbatches on a mesh axis `mb` (inside the data axis' split, if any) and the
/// stage's own axes applied by their strategies (data- or tensor-parallel). A rank-dependent
/// `local_shard` over `mb` is a microbatch's slice (the stage builder turns it into one); a
/// collective over `mb` means the rows of the batch do not stay apart, and microbatching would
/// change the result. Collectives over the stage's own axes stay.
StatusOr<std::unique_ptr<Graph>> microbatch_program(const Graph& g, int64_t m, const PipelineConfig& cfg,
                                                    const PipelineAxes& ax, const std::vector<std::string>& inputs,
                                                    const std::string& who) {
  std::unique_ptr<Graph> p = g.clone();
  DeviceMesh inner;  // the axes that split a stage, then the microbatches'
  for (int a = 0; a < cfg.mesh.rank(); ++a)
    if (a != ax.stage) inner.axes.push_back(cfg.mesh.axes[static_cast<size_t>(a)]);
  if (m > 1) inner.axes.push_back({kMicroAxis, m});
  if (inner.empty()) return p;
  auto name = [&](int a) { return a < 0 ? std::string() : cfg.mesh.axes[static_cast<size_t>(a)].name; };
  const std::vector<std::string> micro_axes = m > 1 ? std::vector<std::string>{kMicroAxis} : std::vector<std::string>{};
  Status st;
  if (ax.tensor >= 0) {
    TensorParallelConfig t;
    t.mesh = inner;
    t.axis = name(ax.tensor);
    t.data_axis = name(ax.data);
    t.sequence_parallel = cfg.sequence_parallel;
    t.sequence_dim = cfg.sequence_dim;
    t.batch_dim = cfg.batch_dim;
    t.inputs = inputs;
    t.extra_batch_axes = micro_axes;
    st = apply_tensor_parallel(*p, t, who);
  } else {
    DataParallelConfig d;
    d.mesh = inner;
    d.axis = ax.data >= 0 ? name(ax.data) : kMicroAxis;
    if (ax.data >= 0) d.extra_batch_axes = micro_axes;
    d.batch_dim = cfg.batch_dim;
    d.inputs = inputs;
    st = apply_data_parallel(*p, d, who);
  }
  if (!st.ok()) {
    if (m == 1) return st;
    return invalid_argument(who + ": cannot cut the batch into " + std::to_string(m) + " microbatches: " + st.message() +
                            " (set microbatches to one that divides it, or 1)");
  }
  for (const auto& n : p->nodes())
    if (is_collective_op(n->op_name()) && n->get_string("axis", "") == kMicroAxis)
      return invalid_argument(who + ": @" + g.name() + " mixes the rows of its batch (" + n->op_name() + " of %" +
                              n->operand(0)->name() + " across microbatches), so it cannot run in " +
                              std::to_string(m) + " microbatches; set microbatches = 1");
  return p;
}

/// The microbatch program split into stages: which top-level nodes each stage runs, and what
/// crosses between them.
struct Cut {
  std::vector<const Node*> work;                        ///< nodes that belong to one stage, in order
  std::unordered_set<const Value*> free;                ///< recomputed where used: constants and what
                                                        ///< depends only on them and inputs (no contraction)
  std::unordered_set<const Value*> weights;             ///< of those, what depends on constants alone
  std::vector<int> stage_of;                            ///< per work node
  std::unordered_map<const Node*, size_t> index;        ///< work node -> position
};

/// Values of the work nodes used at a later position: for each, its first and last use.
struct Crossing {
  std::vector<int> count;       ///< values crossing the cut before position c (c = 1..|work|-1)
  std::vector<int64_t> bytes;
};

Crossing crossings(const Graph& p, const Cut& cut) {
  const size_t n = cut.work.size();
  Crossing c;
  c.count.assign(n + 1, 0);
  c.bytes.assign(n + 1, 0);
  std::unordered_set<const Value*> outputs(p.outputs().begin(), p.outputs().end());
  for (size_t i = 0; i < n; ++i)
    for (int r = 0; r < cut.work[i]->num_results(); ++r) {
      const Value* v = cut.work[i]->result(r);
      size_t last = i;
      for (const Use& u : v->uses())
        if (u.user == nullptr) last = n;
        else if (auto it = cut.index.find(u.user); it != cut.index.end()) last = std::max(last, it->second);
      if (outputs.count(v)) last = n;
      for (size_t k = i + 1; k <= std::min(last, n - 1); ++k) {  // cuts i+1 .. last
        ++c.count[k];
        c.bytes[k] += value_bytes(*v);
      }
    }
  return c;
}

/// Chooses stages-1 cut positions among `points` minimising the slowest stage's compute; among
/// equally slow splits, the one sending the fewest bytes. Sends are left out of the balance: they
/// overlap the next microbatch's compute, and counting a link's latency against stages of small
/// layers would pile every layer onto the last stage (the only one that sends nothing).
std::vector<size_t> balance(const std::vector<double>& prefix, const std::vector<size_t>& points,
                            const Crossing& cross, int64_t stages) {
  // Candidate boundaries: 0, the points, the end.
  std::vector<size_t> b = {0};
  b.insert(b.end(), points.begin(), points.end());
  const size_t end = prefix.size() - 1;
  b.push_back(end);
  const double inf = std::numeric_limits<double>::infinity();
  const size_t k = b.size();
  // best[s][j]: the slowest of s stages covering [0, b[j]) and the bytes they send;
  // from[s][j]: where the last of them began.
  using Score = std::pair<double, int64_t>;
  std::vector<std::vector<Score>> best(static_cast<size_t>(stages) + 1, std::vector<Score>(k, {inf, 0}));
  std::vector<std::vector<size_t>> from(static_cast<size_t>(stages) + 1, std::vector<size_t>(k, 0));
  best[0][0] = {0, 0};
  auto better = [inf](const Score& a, const Score& b) {
    if (b.first == inf) return a.first < inf;
    if (std::abs(a.first - b.first) > 1e-9 * std::max(a.first, b.first)) return a.first < b.first;
    return a.second < b.second;
  };
  for (size_t s = 1; s <= static_cast<size_t>(stages); ++s)
    for (size_t j = 1; j < k; ++j)
      for (size_t i = s - 1; i < j; ++i) {
        if (best[s - 1][i].first == inf) continue;
        const Score c = {std::max(best[s - 1][i].first, prefix[b[j]] - prefix[b[i]]),
                         best[s - 1][i].second + (b[j] != end ? cross.bytes[b[j]] : 0)};
        if (better(c, best[s][j])) best[s][j] = c, from[s][j] = i;
      }
  std::vector<size_t> cuts;
  size_t j = k - 1;
  for (size_t s = static_cast<size_t>(stages); s > 1; --s) {
    j = from[s][j];
    cuts.push_back(b[j]);
  }
  std::reverse(cuts.begin(), cuts.end());
  return cuts;
}

/// Builds the pipeline_stage regions of the per-rank program.
class StageBuilder {
 public:
  StageBuilder(const Graph& p, const Cut& cut, const PipelineConfig& cfg, const PipelineAxes& ax, int64_t stages,
               int64_t micro)
      : p_(p), cut_(cut), cfg_(cfg), ax_(ax), stages_(stages), micro_(micro), mb_(p.mesh().axis_index(kMicroAxis)) {
    // A mesh of one axis names peers and stages by rank; with other axes, by position along
    // the stages' axis (the ranks of a stage share one program).
    if (cfg.mesh.rank() > 1) stage_axis_ = cfg.mesh.axes[static_cast<size_t>(ax.stage)].name;
  }

  Status build(Graph& out) {
    // Every value a later stage needs gets one tag number; tag = number * microbatches + m.
    for (size_t i = 0; i < cut_.work.size(); ++i)
      for (int r = 0; r < cut_.work[i]->num_results(); ++r) {
        const Value* v = cut_.work[i]->result(r);
        std::set<int> to;
        for (const Use& u : v->uses())
          if (u.user == nullptr) to.insert(static_cast<int>(stages_ - 1));
          else if (auto it = cut_.index.find(u.user); it != cut_.index.end()) to.insert(cut_.stage_of[it->second]);
        for (const Value* o : p_.outputs())
          if (o == v) to.insert(static_cast<int>(stages_ - 1));
        to.erase(cut_.stage_of[i]);
        if (!to.empty()) sends_[v] = {next_tag_++, {to.begin(), to.end()}};
      }
    for (int i = 0; i < p_.num_inputs(); ++i) {
      Value* in = out.add_input(p_.input(i)->name(), global_type(p_.input(i)));
      in->set_sharding(outer_sharding(p_.input(i), Placement::replicate()));
      outer_inputs_.push_back(in);
    }
    std::vector<TensorType> out_types;
    for (const Value* o : p_.outputs()) out_types.push_back(global_type(o));
    Node* last = nullptr;
    for (int64_t s = 0; s < stages_; ++s) {
      KILN_ASSIGN_OR_RETURN(Node * n, build_stage(out, s, s == stages_ - 1 ? out_types : std::vector<TensorType>{}));
      last = n;
    }
    std::vector<Value*> results;
    for (int i = 0; i < last->num_results(); ++i) {  // zeros on every other stage
      last->result(i)->set_sharding(outer_sharding(p_.output(i), Placement::partial()));
      results.push_back(last->result(i));
    }
    out.set_outputs(std::move(results), p_.output_names());
    return ok_status();
  }

 private:
  /// The type of a microbatch program's input or output with its microbatch split undone: the
  /// whole batch, or with a data axis the rank's rows.
  TensorType global_type(const Value* v) const {
    TensorType t = v->type();
    if (const int64_t d = split_dim(v); d >= 0)
      t.shape[static_cast<size_t>(d)] = Dim(t.shape[static_cast<size_t>(d)].value() * micro_);
    return t;
  }
  int64_t split_dim(const Value* v) const {
    const Sharding& s = v->sharding();
    return mb_ >= 0 && !s.empty() && s[static_cast<size_t>(mb_)].is_shard() ? s[static_cast<size_t>(mb_)].dim : -1;
  }
  /// The placement on the pipeline's mesh of microbatch-program value `v`: `stage` along the
  /// stages' axis, the microbatch program's along the others.
  Sharding outer_sharding(const Value* v, Placement stage) const {
    Sharding out;
    const DeviceMesh& inner = p_.mesh();
    for (int a = 0; a < cfg_.mesh.rank(); ++a) {
      if (a == ax_.stage) {
        out.push_back(stage);
        continue;
      }
      const int k = inner.axis_index(cfg_.mesh.axes[static_cast<size_t>(a)].name);
      out.push_back(k >= 0 && !v->sharding().empty() ? v->sharding()[static_cast<size_t>(k)] : Placement::replicate());
    }
    return out;
  }
  /// send's and recv's attributes for peer stage `peer`.
  AttrMap p2p_attrs(int64_t peer, int64_t tag) const {
    AttrMap a = {{"peer", Attribute(peer)}, {"tag", Attribute(tag)}};
    if (!stage_axis_.empty()) a["axis"] = Attribute(stage_axis_);
    return a;
  }

  std::string suffix(int64_t m) const { return micro_ > 1 ? ".mb" + std::to_string(m) : ""; }

  StatusOr<Node*> emit(Graph& body, const std::string& op, std::vector<Value*> operands, AttrMap attrs,
                       std::vector<std::string> names, const Location& loc) {
    const OpDef* def = OpRegistry::global().find(op);
    if (!def) return internal_error("pipeline: op '" + op + "' is not registered");
    const size_t results = def->fixed_outputs() >= 0 ? static_cast<size_t>(def->fixed_outputs()) : names.size();
    KILN_ASSIGN_OR_RETURN(Node * n, body.create_node(op, std::move(operands), std::vector<TensorType>(results), std::move(attrs),
                                                     nullptr, std::move(names)));
    n->set_loc(loc);
    std::vector<TensorType> in;
    for (Value* v : n->operands()) in.push_back(v->type());
    auto inferred = infer_node_types(*n, in);
    if (!inferred.ok()) return inferred.status().with_context("pipeline: " + op);
    for (int i = 0; i < n->num_results(); ++i) n->result(i)->set_type((*inferred)[static_cast<size_t>(i)]);
    return n;
  }

  /// The stage's value for `v` in microbatch `m`, computing recomputable ones and receiving those
  /// of earlier stages on first use.
  StatusOr<Value*> get(Graph& body, int64_t s, int64_t m, const Value* v) {
    auto& env = env_[static_cast<size_t>(m)];
    if (auto it = env.find(v); it != env.end()) return it->second;
    Value* got = nullptr;
    if (v->is_graph_input()) {
      Value* whole = stage_input(body, v);
      const int64_t d = split_dim(v);
      if (d < 0) {
        got = whole;
      } else {
        const int64_t rows = v->shape()[static_cast<size_t>(d)].value();
        KILN_ASSIGN_OR_RETURN(Node * n, emit(body, "slice", {whole},
                                             {{"starts", Attribute(std::vector<int64_t>{m * rows})},
                                              {"ends", Attribute(std::vector<int64_t>{(m + 1) * rows})},
                                              {"axes", Attribute(std::vector<int64_t>{d})}},
                                             {v->name() + suffix(m)}, {}));
        got = n->result();
      }
    } else if (cut_.free.count(v)) {
      const Node& n = *v->producer();
      if (auto it = constants_.find(v); it != constants_.end()) {
        got = it->second;
      } else if (n.op_name() == "constant") {  // one copy for every microbatch
        KILN_ASSIGN_OR_RETURN(Node * c, emit(body, "constant", {}, n.attrs(), {v->name()}, n.loc()));
        got = constants_[v] = c->result();
      } else {
        KILN_ASSIGN_OR_RETURN(Node * c, clone(body, s, m, n));
        got = c->result(v->index());
        // Weights prepared from constants alone (a tensor-parallel block): one copy too.
        if (cut_.weights.count(v))
          for (int i = 0; i < n.num_results(); ++i) constants_[n.result(i)] = c->result(i);
      }
    } else {
      const auto it = sends_.find(v);
      if (it == sends_.end()) return internal_error("pipeline: %" + v->name() + " reaches stage " + std::to_string(s) + " unsent");
      const auto from = static_cast<int64_t>(cut_.stage_of[cut_.index.at(v->producer())]);
      AttrMap attrs = p2p_attrs(from, it->second.first * micro_ + m);
      attrs["dtype"] = Attribute(v->dtype());
      attrs["shape"] = Attribute(static_sizes(v->shape()));
      KILN_ASSIGN_OR_RETURN(Node * r, emit(body, "recv", {}, std::move(attrs), {v->name() + suffix(m)}, v->producer()->loc()));
      got = r->result();
    }
    env[v] = got;
    return got;
  }

  Value* stage_input(Graph& body, const Value* v) {
    if (auto it = body_inputs_.find(v); it != body_inputs_.end()) return it->second;
    Value* in = body.add_input(v->name(), global_type(v));
    stage_operands_.push_back(outer_inputs_[static_cast<size_t>(v->index())]);
    return body_inputs_[v] = in;
  }

  /// A copy of microbatch-program node `n` for microbatch `m`; a local_shard over the microbatch
  /// mesh becomes microbatch m's slice.
  StatusOr<Node*> clone(Graph& body, int64_t s, int64_t m, const Node& n) {
    std::vector<Value*> operands;
    for (const Value* v : n.operands()) {
      KILN_ASSIGN_OR_RETURN(Value * x, get(body, s, m, v));
      operands.push_back(x);
    }
    std::vector<std::string> names;
    for (int i = 0; i < n.num_results(); ++i) names.push_back(n.result(i)->name().empty() ? "" : n.result(i)->name() + suffix(m));
    Node* c = nullptr;
    if (n.op_name() == "local_shard" && n.get_string("axis") == kMicroAxis) {
      const int64_t d = n.get_int("dim") < 0 ? n.get_int("dim") + n.operand(0)->type().rank() : n.get_int("dim");
      const int64_t rows = n.result()->shape()[static_cast<size_t>(d)].value();
      KILN_ASSIGN_OR_RETURN(c, emit(body, "slice", operands,
                                    {{"starts", Attribute(std::vector<int64_t>{m * rows})},
                                     {"ends", Attribute(std::vector<int64_t>{(m + 1) * rows})},
                                     {"axes", Attribute(std::vector<int64_t>{d})}},
                                    names, n.loc()));
    } else {
      std::vector<TensorType> types;
      for (int i = 0; i < n.num_results(); ++i) types.push_back(n.result(i)->type());
      KILN_ASSIGN_OR_RETURN(c, body.create_node(n.op_name(), operands, types, n.attrs(), nullptr, names));
      c->set_loc(n.loc());
      for (int k = 0; k < n.num_regions(); ++k) c->add_region(n.region(k).clone());
      std::vector<TensorType> in;
      for (Value* v : operands) in.push_back(v->type());
      auto inferred = infer_node_types(*c, in);
      if (!inferred.ok()) return inferred.status().with_context("pipeline");
      if (*inferred != types)
        return internal_error("pipeline: '" + n.op_name() + "' on a stage computes other types than in the microbatch program");
    }
    for (int i = 0; i < n.num_results(); ++i) env_[static_cast<size_t>(m)][n.result(i)] = c->result(i);
    return c;
  }

  StatusOr<Node*> build_stage(Graph& out, int64_t s, const std::vector<TensorType>& result_types) {
    auto body = std::make_unique<Graph>("stage" + std::to_string(s));
    body_inputs_.clear();
    stage_operands_.clear();
    constants_.clear();
    env_.assign(static_cast<size_t>(micro_), {});
    std::vector<std::vector<Value*>> outs(static_cast<size_t>(micro_));
    // A detached region has no mesh of its own to check peers against: lend it the program's.
    body->set_mesh(cfg_.mesh);
    for (int64_t m = 0; m < micro_; ++m) {  // GPipe: every microbatch's forward in order
      for (size_t i = 0; i < cut_.work.size(); ++i) {
        if (cut_.stage_of[i] != s) continue;
        const Node& n = *cut_.work[i];
        KILN_ASSIGN_OR_RETURN(Node * c, clone(*body, s, m, n));
        for (int r = 0; r < n.num_results(); ++r) {
          const auto it = sends_.find(n.result(r));
          if (it == sends_.end()) continue;
          for (int to : it->second.second)
            KILN_RETURN_IF_ERROR(
                emit(*body, "send", {c->result(r)}, p2p_attrs(to, it->second.first * micro_ + m), {}, n.loc()).status());
        }
      }
      if (!result_types.empty())
        for (const Value* o : p_.outputs()) {
          KILN_ASSIGN_OR_RETURN(Value * v, get(*body, s, m, o));
          outs[static_cast<size_t>(m)].push_back(v);
        }
    }
    std::vector<Value*> results;
    for (size_t i = 0; i < result_types.size(); ++i) {
      const Value* o = p_.output(static_cast<int>(i));
      const int64_t d = split_dim(o);
      if (d < 0) {  // the same on every microbatch: the last one's
        results.push_back(outs.back()[i]);
        continue;
      }
      std::vector<Value*> parts;
      for (auto& per_m : outs) parts.push_back(per_m[i]);
      KILN_ASSIGN_OR_RETURN(Node * cat, emit(*body, "concat", parts, {{"axis", Attribute(d)}}, {p_.output_name(static_cast<int>(i))}, {}));
      results.push_back(cat->result());
    }
    body->set_outputs(results);
    body->set_mesh(DeviceMesh{});
    AttrMap attrs = {{"rank", Attribute(s)}, {"microbatches", Attribute(micro_)}};
    if (!stage_axis_.empty()) attrs["axis"] = Attribute(stage_axis_);
    KILN_ASSIGN_OR_RETURN(Node * n, out.create_node("pipeline_stage", stage_operands_, result_types, std::move(attrs), nullptr,
                                                    s == stages_ - 1 ? p_.output_names() : std::vector<std::string>{}));
    n->add_region(std::move(body));
    return n;
  }

  const Graph& p_;
  const Cut& cut_;
  const PipelineConfig& cfg_;
  const PipelineAxes& ax_;
  int64_t stages_, micro_;
  int mb_;                  // the microbatch axis in p_'s mesh (-1: one microbatch)
  std::string stage_axis_;  // "" on a mesh of one axis
  int64_t next_tag_ = 0;
  std::unordered_map<const Value*, std::pair<int64_t, std::vector<int>>> sends_;  // tag number, stages
  std::vector<Value*> outer_inputs_;
  std::unordered_map<const Value*, Value*> body_inputs_, constants_;
  std::vector<Value*> stage_operands_;
  std::vector<std::unordered_map<const Value*, Value*>> env_;  // per microbatch
};

}  // namespace

double PipelineSplit::step_seconds() const {
  const double slowest = stage_seconds.empty() ? 0 : *std::max_element(stage_seconds.begin(), stage_seconds.end());
  return slowest * static_cast<double>(microbatches + stages - 1);
}

std::string PipelineSplit::str() const {
  std::ostringstream o;
  o << stages << " stages, " << microbatches << " microbatch" << (microbatches == 1 ? "" : "es") << " (GPipe), "
    << cut_points << " cut points";
  for (size_t s = 0; s < stage_seconds.size(); ++s) {
    char line[160];
    std::snprintf(line, sizeof line, "\n  stage %zu: %d nodes, %.3g ms a microbatch, weights %s", s, stage_nodes[s],
                  stage_seconds[s] * 1e3, format_bytes(static_cast<double>(stage_weight_bytes[s])).c_str());
    o << line;
    if (s < boundary_bytes.size()) o << ", sends " << format_bytes(static_cast<double>(boundary_bytes[s]));
  }
  char line[96];
  std::snprintf(line, sizeof line, "\n  predicted step %.3g ms (%lld slots of the slowest stage)", step_seconds() * 1e3,
                static_cast<long long>(microbatches + stages - 1));
  return o.str() + line;
}

StatusOr<PipelineSplit> apply_pipeline(Graph& g, const PipelineConfig& cfg, const std::string& who) {
  if (g.is_per_rank()) return failed_precondition(who + ": graph @" + g.name() + " is already a per-rank program");
  if (!g.mesh().empty()) return invalid_argument(who + ": graph @" + g.name() + " already has mesh " + g.mesh().str());
  if (cfg.microbatches < 0) return invalid_argument(who + ": microbatches must be >= 0 (0: as many as stages)");
  KILN_ASSIGN_OR_RETURN(const PipelineAxes ax, pipeline_axes(cfg, who));
  if (cfg.sequence_parallel && ax.tensor < 0)
    return invalid_argument(who + ": sequence-parallel splits a tensor-parallel stage's residual stream; the mesh " +
                            cfg.mesh.str() + " has no tensor axis (tp)");
  const int64_t stages = cfg.mesh.axes[static_cast<size_t>(ax.stage)].size;
  const std::vector<std::string> batch_inputs = batch_input_names(g, cfg.batch_dim, cfg.inputs);

  // send/recv move static shapes: every symbol must be bound.
  std::unique_ptr<Graph> bound = g.clone();
  std::map<std::string, int64_t> used;
  std::set<std::string> unbound;
  bind_symbol_sizes(*bound, cfg.dims, 1, used, unbound);
  if (!unbound.empty())
    return invalid_argument(who + ": stages pass activations of static shape; give the size of symbol '" +
                            *unbound.begin() + "' (dims = [\"" + *unbound.begin() + "=...\"], or --sym at import)");

  // Microbatches: as asked, or as many as stages when the batch divides into them.
  int64_t micro = cfg.microbatches;
  if (micro == 0) {
    int64_t batch = 1;
    for (const Value* in : bound->inputs())
      if (!batch_inputs.empty() && in->name() == batch_inputs.front() && in->type().rank() > cfg.batch_dim)
        batch = in->shape()[static_cast<size_t>(cfg.batch_dim)].value();
    if (ax.data >= 0) batch /= cfg.mesh.axes[static_cast<size_t>(ax.data)].size;  // each rank's rows
    micro = std::max<int64_t>(1, std::min(stages, batch));
    while (batch % micro) --micro;
  }
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> p, microbatch_program(*bound, micro, cfg, ax, batch_inputs, who));

  Cut cut;
  for (const auto& np : p->nodes()) {
    const Node& n = *np;
    bool free = n.op_name() == "constant";
    if (!free && n.num_operands() > 0 && n.num_regions() == 0 && !(n.op() && n.op()->has(kTraitSideEffects)) &&
        !(n.op() && n.op()->has(kTraitContraction))) {
      free = true;
      for (const Value* v : n.operands()) free &= v->is_graph_input() || cut.free.count(v) > 0;
    }
    if (free) {
      bool weights = n.op_name() == "constant";
      if (!weights) {
        weights = true;
        for (const Value* v : n.operands()) weights &= cut.weights.count(v) > 0;
      }
      for (int i = 0; i < n.num_results(); ++i) {
        cut.free.insert(n.result(i));
        if (weights) cut.weights.insert(n.result(i));
      }
    } else {
      cut.index[&n] = cut.work.size();
      cut.work.push_back(&n);
    }
  }
  const size_t n = cut.work.size();
  const Crossing cross = crossings(*p, cut);
  std::vector<size_t> points;
  for (size_t c = 1; c < n; ++c)
    if (cross.count[c] <= 1) points.push_back(c);
  if (static_cast<int64_t>(points.size()) < stages - 1)
    return invalid_argument(who + ": @" + g.name() + " has " + std::to_string(points.size()) +
                            " places to cut between layers (where at most one activation crosses), " +
                            std::to_string(stages) + " stages need " + std::to_string(stages - 1) +
                            "; use fewer stages (mesh \"pp=" + std::to_string(std::max<size_t>(points.size() + 1, 1)) + "\") or a deeper model");

  std::vector<double> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + node_seconds(*cut.work[i], cfg.device);
  const std::vector<size_t> cuts = balance(prefix, points, cross, stages);
  cut.stage_of.assign(n, 0);
  for (size_t i = 0, s = 0; i < n; ++i) {
    while (s < cuts.size() && i >= cuts[s]) ++s;
    cut.stage_of[i] = static_cast<int>(s);
  }

  PipelineSplit split;
  split.stages = stages;
  split.microbatches = micro;
  split.cut_points = static_cast<int>(points.size());
  std::vector<size_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(n);
  for (int64_t s = 0; s < stages; ++s) {
    const size_t a = bounds[static_cast<size_t>(s)], b = bounds[static_cast<size_t>(s) + 1];
    double send = 0, flops = 0;
    if (b < n) {
      send = static_cast<double>(cross.bytes[b]) / cfg.device.link_bytes_per_s + cfg.device.link_latency_s;
      split.boundary_bytes.push_back(cross.bytes[b]);
    }
    for (size_t i = a; i < b; ++i) flops += node_flops(*cut.work[i]);
    split.stage_seconds.push_back(prefix[b] - prefix[a] + send);
    split.stage_send_seconds.push_back(send);
    split.stage_flops.push_back(flops);
    split.stage_nodes.push_back(static_cast<int>(b - a));
    // The constants the stage reads, directly or through what it recomputes (an embedding).
    std::set<const Value*> weights, seen;
    std::vector<const Value*> todo;
    for (size_t i = a; i < b; ++i)
      for (const Value* v : cut.work[i]->operands()) todo.push_back(v);
    for (const Value* o : p->outputs())
      if (s == stages - 1) todo.push_back(o);
    while (!todo.empty()) {
      const Value* v = todo.back();
      todo.pop_back();
      if (!cut.free.count(v) || !seen.insert(v).second) continue;
      const std::string& op = v->producer()->op_name();
      // A tensor-parallel rank keeps its block of a split weight.
      if (op == "constant" || (op == "local_shard" && cut.weights.count(v))) {
        weights.insert(v);
        continue;
      }
      for (const Value* x : v->producer()->operands()) todo.push_back(x);
    }
    int64_t bytes = 0;
    for (const Value* w : weights) bytes += value_bytes(*w);
    split.stage_weight_bytes.push_back(bytes);
  }

  split.activation_bytes = peak_activation_bytes(*p);

  Graph out(g.name());
  out.set_mesh(cfg.mesh);
  out.set_per_rank(true);
  StageBuilder builder(*p, cut, cfg, ax, stages, micro);
  KILN_RETURN_IF_ERROR(builder.build(out));
  if (cfg.print) std::cerr << who << ": @" << g.name() << ": " << split.str() << "\n";
  g.take_contents(out);
  return split;
}

}  // namespace kiln::parallel
