// Sharding propagation and SPMD partitioning: per-op layout rules, redistribution through
// collectives, and the rewrite of types and shape attributes to per-rank sizes.
#include "partition.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "kiln/ir/op.h"
#include "kiln/ir/zeros.h"

namespace kiln::parallel {
namespace {

using P = Placement;

/// What a rule decides for one node: the layout each operand must arrive in, the layout of
/// each result, and the node's attributes in per-rank terms.
struct Decision {
  std::vector<Sharding> operands;
  std::vector<Sharding> results;
  AttrMap attrs;
  bool bias_after_reduce = false;  ///< row-parallel linear: add the bias once the sum is reduced
  bool fallback = false;
  int vocab_axis = -1;  ///< gather: the mesh axis its table is split over by rows (vocab parallel)
};

bool is_pointwise(const Node& n) { return n.op() && n.op()->has(kTraitElementwise); }

bool side_effects(const Node& n) { return n.op() && n.op()->has(kTraitSideEffects); }

int64_t rank_of(const Value* v) { return v->type().rank(); }

const Dim& dim_of(const Value* v, int64_t d) { return v->shape()[static_cast<size_t>(d)]; }

class Partitioner {
 public:
  Partitioner(const Graph& src, const PartitionOptions& opt)
      : src_(src), mesh_(src.mesh()), opt_(opt), out_(src.name()) {
    out_.set_mesh(mesh_);
    out_.set_per_rank(true);
  }

  StatusOr<PartitionReport> run(Graph& g) {
    if (mesh_.empty()) return failed_precondition("partition: graph @" + src_.name() + " has no device mesh");
    KILN_RETURN_IF_ERROR(mesh_.validate());
    for (int i = 0; i < src_.num_inputs(); ++i) {
      const Value* in = src_.input(i);
      const Sharding s = full(in->sharding());
      for (const P& p : s)
        if (p.is_partial()) return invalid_argument("graph input %" + in->name() + " cannot be partial: " + sharding_str(s));
      KILN_RETURN_IF_ERROR(check(s, in->type(), "graph input %" + in->name()));
      Value* v = out_.add_input(in->name(), TensorType{in->dtype(), local_shape(in->shape(), s, mesh_)});
      v->set_sharding(s);
      local_[in] = v;
    }
    for (const auto& n : src_.nodes()) KILN_RETURN_IF_ERROR(lower(*n));
    std::vector<Value*> outs;
    for (int i = 0; i < src_.num_outputs(); ++i) {
      Value* v = local_.at(src_.output(i));
      Sharding want = i < static_cast<int>(opt_.output_layouts.size()) && !opt_.output_layouts[static_cast<size_t>(i)].empty()
                          ? full(opt_.output_layouts[static_cast<size_t>(i)])
                          : without_partials(v->sharding());
      KILN_RETURN_IF_ERROR(check(want, src_.output(i)->type(), "graph output '" + src_.output_name(i) + "'"));
      KILN_ASSIGN_OR_RETURN(v, redistribute(v, want));
      outs.push_back(v);
    }
    out_.set_outputs(std::move(outs), src_.output_names());
    g.take_contents(out_);
    return report_;
  }

 private:
  // ---- layouts ---------------------------------------------------------------------------

  Sharding replicated() const { return Sharding(static_cast<size_t>(mesh_.rank()), P::replicate()); }
  Sharding full(const Sharding& s) const { return s.empty() ? replicated() : s; }
  static Sharding without_partials(Sharding s) {
    for (P& p : s)
      if (p.is_partial()) p = P::replicate();
    return s;
  }
  Status check(const Sharding& s, const TensorType& global, const std::string& what) const {
    Status st = check_sharding(s, mesh_, global);
    return st.ok() ? st : invalid_argument(what + ": " + st.message());
  }
  bool fits(const Sharding& s, const TensorType& global) const { return check_sharding(s, mesh_, global).ok(); }
  /// Whether any axis other than `a` shards dim `d` in `s`.
  static bool dim_shared(const Sharding& s, size_t a, int64_t d) {
    for (size_t b = 0; b < s.size(); ++b)
      if (b != a && s[b].is_shard() && s[b].dim == d) return true;
    return false;
  }

  // ---- emitting ----------------------------------------------------------------------------

  /// Adds a node to the per-rank graph; its result types come from the op's own shape rule on
  /// per-rank operand types, so collectives and local shards size themselves.
  StatusOr<Node*> emit(const std::string& op, std::vector<Value*> operands, AttrMap attrs,
                       const std::string& name, Location loc) {
    const OpDef* def = OpRegistry::global().find(op);
    if (!def) return internal_error("partition: op '" + op + "' is not registered");
    std::vector<TensorType> types(static_cast<size_t>(std::max(def->fixed_outputs(), 0)));
    KILN_ASSIGN_OR_RETURN(Node * n, out_.create_node(op, std::move(operands), types, std::move(attrs), nullptr, {name}));
    n->set_loc(loc);
    std::vector<TensorType> in;
    for (Value* v : n->operands()) in.push_back(v->type());
    auto inferred = infer_node_types(*n, in);
    if (!inferred.ok()) return inferred.status().with_context("partition: " + op);
    for (int i = 0; i < n->num_results(); ++i) n->result(i)->set_type((*inferred)[static_cast<size_t>(i)]);
    return n;
  }

  StatusOr<Value*> collective(const std::string& op, Value* v, size_t axis, AttrMap attrs, const Sharding& after) {
    attrs["axis"] = Attribute(mesh_.axes[axis].name);
    KILN_ASSIGN_OR_RETURN(Node * n, emit(op, {v}, std::move(attrs), v->name().empty() ? "" : v->name() + "." + op,
                                         v->producer() ? v->producer()->loc() : Location{}));
    n->result()->set_sharding(after);
    if (op == "all_reduce") ++report_.all_reduce;
    else if (op == "all_gather") ++report_.all_gather;
    else if (op == "reduce_scatter") ++report_.reduce_scatter;
    else if (op == "all_to_all") ++report_.all_to_all;
    else if (op == "local_shard") ++report_.local_shard;
    return n->result();
  }

  /// Moves `v` into layout `target` with the fewest collectives this simple scheme knows:
  /// first every axis leaves its current state (partial sums reduced or reduce-scattered,
  /// shards gathered or exchanged), innermost axis first; then replicated axes take their
  /// blocks locally, outermost first (several axes splitting one dim nest outer-first).
  StatusOr<Value*> redistribute(Value* v, const Sharding& target) {
    Sharding cur = full(v->sharding());
    if (cur == target) return v;
    const auto key = std::make_pair(v, sharding_str(target));
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    Value* x = v;
    // Along an axis of one rank every layout holds the whole value: nothing moves.
    for (size_t a = 0; a < cur.size(); ++a)
      if (mesh_.axes[a].size == 1) cur[a] = target[a];
    for (int ai = mesh_.rank() - 1; ai >= 0; --ai) {
      const auto a = static_cast<size_t>(ai);
      if (cur[a] == target[a] || cur[a].is_replicate()) continue;
      // An inner axis sharding the same dim must be gathered first, or the blocks interleave.
      for (size_t b = a + 1; b < cur.size(); ++b)
        if (cur[b].is_shard() && ((cur[a].is_shard() && cur[b].dim == cur[a].dim) ||
                                  (target[a].is_shard() && cur[b].dim == target[a].dim))) {
          Sharding next = cur;
          next[b] = P::replicate();
          KILN_ASSIGN_OR_RETURN(x, collective("all_gather", x, b, {{"dim", Attribute(cur[b].dim)}}, next));
          cur = next;
        }
      Sharding next = cur;
      if (cur[a].is_partial()) {
        if (target[a].is_shard() && !dim_shared(cur, a, target[a].dim)) {
          next[a] = target[a];
          KILN_ASSIGN_OR_RETURN(x, collective("reduce_scatter", x, a,
                                              {{"dim", Attribute(target[a].dim)},
                                               {"reduce", Attribute(std::string(reduce_op_name(cur[a].reduce)))}},
                                              next));
        } else {
          next[a] = P::replicate();
          KILN_ASSIGN_OR_RETURN(x, collective("all_reduce", x, a,
                                              {{"reduce", Attribute(std::string(reduce_op_name(cur[a].reduce)))}}, next));
        }
      } else if (target[a].is_shard() && !dim_shared(cur, a, cur[a].dim) && !dim_shared(cur, a, target[a].dim)) {
        next[a] = target[a];
        KILN_ASSIGN_OR_RETURN(x, collective("all_to_all", x, a,
                                            {{"split_dim", Attribute(target[a].dim)}, {"concat_dim", Attribute(cur[a].dim)}},
                                            next));
      } else {
        next[a] = P::replicate();
        KILN_ASSIGN_OR_RETURN(x, collective("all_gather", x, a, {{"dim", Attribute(cur[a].dim)}}, next));
      }
      cur = next;
    }
    for (size_t a = 0; a < cur.size(); ++a) {
      if (cur[a] == target[a]) continue;
      if (!target[a].is_shard())
        return internal_error("partition: cannot make a value " + sharding_str(target) + " from " + sharding_str(cur));
      Sharding next = cur;
      next[a] = target[a];
      KILN_ASSIGN_OR_RETURN(Value * block, iota_block(x, a, target[a].dim, 0));
      if (block) {
        ++report_.iota_blocks;
        x = block;
      } else {
        KILN_ASSIGN_OR_RETURN(x, collective("local_shard", x, a, {{"dim", Attribute(target[a].dim)}}, next));
      }
      cur = next;
    }
    cache_[key] = x;
    return x;
  }

  /// Rank k's block along dim `d` (split over mesh axis `a`) of a value built elementwise from
  /// an iota along `d` (`range`) and values that broadcast along it, such as a one-hot mask
  /// `equal(ids[.., 1], range(V))`: each rank builds its block from its block of the iota, where
  /// cutting it from the whole would cost every rank the whole [.., V] value. nullptr when `v` is
  /// not built that way.
  StatusOr<Value*> iota_block(Value* v, size_t a, int64_t d, int depth) {
    Node* p = v->producer();
    if (!p || depth > 8 || d < 0 || d >= rank_of(v) || !dim_of(v, d).is_static()) return nullptr;
    const int64_t ranks = mesh_.axes[a].size, n = dim_of(v, d).value();
    if (ranks <= 1 || n % ranks) return nullptr;
    Sharding s = full(v->sharding());
    if (!s[a].is_replicate() || dim_shared(s, a, d)) return nullptr;
    s[a] = P::shard(d);
    const std::string name = (v->name().empty() ? p->op_name() : v->name()) + ".block";
    if (p->op_name() == "range") {
      const double start = p->get_float("start"), delta = p->get_float("delta");
      const int64_t rows = n / ranks;
      // Block k counts on from start + k * rows * delta: an offset the rank takes from a [ranks] table.
      std::vector<double> offsets;
      for (int64_t k = 0; k < ranks; ++k) offsets.push_back(static_cast<double>(k * rows) * delta);
      AttrMap attrs = p->attrs();
      attrs["limit"] = Attribute(start + static_cast<double>(rows) * delta);
      KILN_ASSIGN_OR_RETURN(Node * local, emit("range", {}, attrs, name + "_local", p->loc()));
      if (local->result()->shape() != Shape{Dim(rows)}) return nullptr;  // a fractional step counts otherwise
      local->result()->set_sharding(replicated());
      Tensor table(v->dtype(), {ranks});
      for (int64_t k = 0; k < ranks; ++k) table.set_f64(k, offsets[static_cast<size_t>(k)]);
      KILN_ASSIGN_OR_RETURN(Value * all, constant(std::move(table), name + "_offsets", p->loc()));
      Sharding one = replicated();
      one[a] = P::shard(0);
      KILN_ASSIGN_OR_RETURN(Value * offset, collective("local_shard", all, a, {{"dim", Attribute(int64_t{0})}}, one));
      KILN_ASSIGN_OR_RETURN(Node * add, emit("add", {local->result(), offset}, {}, name, p->loc()));
      add->result()->set_sharding(s);
      return add->result();
    }
    if (!is_pointwise(*p) || side_effects(*p) || p->num_regions() > 0 || p->num_results() != 1) return nullptr;
    std::vector<Value*> operands;
    for (Value* o : p->operands()) {
      const int64_t od = d - (rank_of(v) - rank_of(o));  // numpy broadcasting aligns trailing dims
      if (od < 0 || (dim_of(o, od).is_static() && dim_of(o, od).value() == 1)) {
        operands.push_back(o);  // the same on every rank
        continue;
      }
      KILN_ASSIGN_OR_RETURN(Value * b, iota_block(o, a, od, depth + 1));
      if (!b) return nullptr;
      operands.push_back(b);
    }
    KILN_ASSIGN_OR_RETURN(Node * m, emit(p->op_name(), std::move(operands), p->attrs(), name, p->loc()));
    m->result()->set_sharding(s);
    return m->result();
  }

  // ---- rules -------------------------------------------------------------------------------

  /// Every operand replicated (partial sums reduced), results replicated, attributes as given.
  Decision fallback(const Node& n) const {
    Decision d;
    for (int i = 0; i < n.num_operands(); ++i) d.operands.push_back(replicated());
    for (int i = 0; i < n.num_results(); ++i) d.results.push_back(replicated());
    d.attrs = n.attrs();
    d.fallback = true;
    return d;
  }

  /// Layout of operand `v` (per-rank view) as the rules see it: partial sums as they are.
  Sharding layout(const Node& n, int i) const { return full(local_.at(n.operand(i))->sharding()); }

  /// Elementwise ops with numpy broadcasting: a shard survives where the operand's dim is the
  /// output's (not broadcast); partial sums pass only through ops linear in them.
  Decision pointwise(const Node& n) const {
    Decision d;
    const Value* y = n.result();
    const int64_t ry = rank_of(y);
    const std::string& op = n.op_name();
    Sharding t = replicated();
    for (size_t a = 0; a < t.size(); ++a) {
      int partials = 0, others = 0;
      std::optional<int64_t> shard_dim;
      for (int i = 0; i < n.num_operands(); ++i) {
        const P p = layout(n, i)[a];
        const Value* x = n.operand(i);
        if (p.is_partial()) ++partials;
        else if (num_elements(x->shape()) != 1) ++others;
        if (p.is_shard() && !shard_dim) {
          const int64_t e = p.dim + (ry - rank_of(x));
          if (dim_of(x, p.dim) == dim_of(y, e)) shard_dim = e;
        }
      }
      if (shard_dim) {
        t[a] = P::shard(*shard_dim);
      } else if (partials > 0) {
        const bool sum = [&] {
          for (int i = 0; i < n.num_operands(); ++i)
            if (layout(n, i)[a].is_partial() && layout(n, i)[a].reduce != ReduceOp::kSum) return false;
          return true;
        }();
        // Linear in the partial operands: a replicated term (even a scalar) added on every
        // rank would be counted once per rank.
        const bool linear = sum && ((op == "neg" || op == "identity") ||
                                    ((op == "add" || op == "sub") && partials == n.num_operands()) ||
                                    (op == "mul" && partials == 1) ||
                                    (op == "div" && partials == 1 && layout(n, 0)[a].is_partial()));
        if (linear) t[a] = P::partial();
        else if (opt_.policy.shard_partial_sums_along >= 0 && opt_.policy.shard_partial_sums_along < ry)
          t[a] = P::shard(opt_.policy.shard_partial_sums_along);
      }
    }
    for (size_t a = 0; a < t.size(); ++a)
      if (t[a].is_shard() && !fits(Sharding{t}, y->type())) t[a] = P::replicate();
    if (!fits(t, y->type())) t = replicated();
    for (int i = 0; i < n.num_operands(); ++i) {
      const Value* x = n.operand(i);
      Sharding s = replicated();
      for (size_t a = 0; a < t.size(); ++a) {
        if (t[a].is_partial()) {
          s[a] = layout(n, i)[a].is_partial() ? layout(n, i)[a] : P::replicate();
        } else if (t[a].is_shard()) {
          const int64_t dx = t[a].dim - (ry - rank_of(x));
          if (dx >= 0 && dim_of(x, dx) == dim_of(y, t[a].dim)) s[a] = P::shard(dx);
        }
      }
      d.operands.push_back(s);
    }
    d.results = {t};
    d.attrs = n.attrs();
    return d;
  }

  std::optional<Sharding> ask_policy(const Node& n, int weight, const Sharding& act) const {
    if (!opt_.policy.weight_layout) return std::nullopt;
    auto s = opt_.policy.weight_layout(WeightChoice{n, weight, act});
    if (!s || static_cast<int>(s->size()) != mesh_.rank()) return std::nullopt;
    return s;
  }

  /// Contractions whose weight is [out, in, ...] and whose activation and result hold their
  /// features at `features` (linear: the last dim; conv: dim 1): column parallel (w split on
  /// out, the result on its features), row parallel (w on in and the activation on its
  /// features, partial sums; a bias is added once they are reduced), or batch dims carried
  /// through (`batch(d)`). A weight's layout wins over the activation's: a column-parallel
  /// weight gathers a sequence-sharded activation rather than being gathered itself.
  Decision weight_contraction(const Node& n, int64_t features, bool split_features,
                              const std::function<bool(int64_t)>& batch) const {
    const Value* x = n.operand(0);
    const Value* w = n.operand(1);
    Sharding sx = without_partials(layout(n, 0)), sw = without_partials(layout(n, 1));
    if (is_replicated(sw) && split_features)
      if (auto pick = ask_policy(n, 1, layout(n, 0))) sw = *pick;
    Decision d;
    Sharding tx = replicated(), tw = replicated(), ty = replicated(), tb = replicated();
    for (size_t a = 0; a < tx.size(); ++a) {
      if (split_features && sw[a].is_shard() && sw[a].dim == 0) {  // column parallel
        tw[a] = P::shard(0), ty[a] = P::shard(features), tb[a] = P::shard(0);
      } else if (split_features && ((sw[a].is_shard() && sw[a].dim == 1) || (sx[a].is_shard() && sx[a].dim == features))) {
        tx[a] = P::shard(features), tw[a] = P::shard(1), ty[a] = P::partial();  // row parallel
        d.bias_after_reduce = n.num_operands() > 2;
      } else if (sx[a].is_shard() && batch(sx[a].dim)) {
        tx[a] = sx[a], ty[a] = sx[a];
      }
    }
    if (!fits(tx, x->type()) || !fits(tw, w->type()) || !fits(ty, n.result()->type())) return fallback(n);
    d.operands = {tx, tw};
    if (n.num_operands() > 2) d.operands.push_back(d.bias_after_reduce ? replicated() : tb);
    d.results = {ty};
    d.attrs = n.attrs();
    return d;
  }

  /// linear(x [..., K], w [N, K], bias? [N]) -> [..., N].
  Decision linear(const Node& n) const {
    const int64_t last = rank_of(n.operand(0)) - 1;
    if (rank_of(n.operand(1)) != 2 || last < 0) return fallback(n);
    return weight_contraction(n, last, true, [last](int64_t d) { return d < last; });
  }

  /// conv(x [N, C, ...], w [Cout, C, k...], bias? [Cout]): channels split like features (one
  /// group only: Megatron for convolutions), or the batch carried through.
  Decision conv(const Node& n) const {
    // The rule reads channels at dim 1; a channels-last conv is computed whole.
    if (n.get_string("layout", "nchw") != "nchw") return fallback(n);
    return weight_contraction(n, 1, n.get_int("groups", 1) == 1, [](int64_t d) { return d == 0; });
  }

  /// matmul(a [..., M, K], b [..., K, N]) with numpy batch broadcasting (rank >= 2 each).
  Decision matmul(const Node& n) const {
    const Value* A = n.operand(0);
    const Value* B = n.operand(1);
    const Value* y = n.result();
    const int64_t ra = rank_of(A), rb = rank_of(B), ry = rank_of(y);
    if (ra < 2 || rb < 2) return fallback(n);
    Sharding sa = without_partials(layout(n, 0)), sb = without_partials(layout(n, 1));
    if (is_replicated(sb) && B->producer() && B->producer()->op_name() == "constant")
      if (auto pick = ask_policy(n, 1, layout(n, 0))) sb = *pick;
    Sharding ta = replicated(), tb = replicated(), ty = replicated();
    for (size_t a = 0; a < ta.size(); ++a) {
      const P pa = sa[a], pb = sb[a];
      const bool a_k = pa.is_shard() && pa.dim == ra - 1, b_k = pb.is_shard() && pb.dim == rb - 2;
      const bool b_n = pb.is_shard() && pb.dim == rb - 1, a_m = pa.is_shard() && pa.dim == ra - 2;
      if (a_k || b_k) {
        ta[a] = P::shard(ra - 1), tb[a] = P::shard(rb - 2), ty[a] = P::partial();
      } else if (b_n) {
        tb[a] = pb, ty[a] = P::shard(ry - 1);
      } else if (a_m) {
        ta[a] = pa, ty[a] = P::shard(ry - 2);
      } else if (pa.is_shard() || pb.is_shard()) {  // a batch dim
        const bool from_a = pa.is_shard();
        const int64_t e = from_a ? pa.dim + (ry - ra) : pb.dim + (ry - rb);
        const int64_t da = e - (ry - ra), db = e - (ry - rb);
        const bool a_has = da >= 0 && da < ra - 2 && dim_of(A, da) == dim_of(y, e);
        const bool b_has = db >= 0 && db < rb - 2 && dim_of(B, db) == dim_of(y, e);
        if (a_has) ta[a] = P::shard(da);
        if (b_has) tb[a] = P::shard(db);
        ty[a] = P::shard(e);
      }
    }
    if (!fits(ta, A->type()) || !fits(tb, B->type()) || !fits(ty, y->type())) return fallback(n);
    Decision d;
    d.operands = {ta, tb};
    d.results = {ty};
    d.attrs = n.attrs();
    return d;
  }

  /// scaled_matmul(a [.., K], b [N, K], scales, bias?): a split of the contracted K (an FP8
  /// weight gradient over a split batch) gives partial sums, unless a bias would be added on
  /// every rank; otherwise a's batch dims keep their split and b is whole.
  Decision scaled_matmul(const Node& n) const {
    const int64_t ra = rank_of(n.operand(0));
    Sharding sa = without_partials(layout(n, 0)), sb = without_partials(layout(n, 1));
    Sharding ta = replicated(), tb = replicated(), ty = replicated();
    bool contracted = false;
    for (size_t a = 0; a < ta.size(); ++a)
      if ((sa[a].is_shard() && sa[a].dim == ra - 1) || (sb[a].is_shard() && sb[a].dim == 1)) {
        ta[a] = P::shard(ra - 1), tb[a] = P::shard(1), ty[a] = P::partial();
        contracted = true;
      }
    if (!contracted || n.num_operands() > 4 || rank_of(n.operand(1)) != 2 || !fits(ta, n.operand(0)->type()) ||
        !fits(tb, n.operand(1)->type()))
      return keep_dims_except(n, {ra - 1}, 1);
    Decision d;
    d.operands = {ta, tb, replicated(), replicated()};
    d.results = {ty};
    d.attrs = n.attrs();
    return d;
  }

  /// Ops that only rename dims (transpose, squeeze, unsqueeze, identity): shards follow the
  /// dim map, partial sums pass.
  Decision remap(const Node& n, const std::function<int64_t(int64_t)>& to_out) const {
    Sharding s = layout(n, 0), t = s;
    for (size_t a = 0; a < t.size(); ++a)
      if (s[a].is_shard()) {
        const int64_t e = to_out(s[a].dim);
        if (e < 0) return fallback(n);
        t[a] = P::shard(e);
      }
    if (!fits(without_partials(t), n.result()->type())) return fallback(n);
    Decision d;
    d.operands = {s};
    d.results = {t};
    d.attrs = n.attrs();
    return d;
  }

  /// reshape: a shard on input dim d moves to output dim e when the dims before them hold the
  /// same number of elements (so blocks stay contiguous) and e divides evenly; the target shape
  /// attribute is rewritten to per-rank sizes.
  Decision reshape(const Node& n) const {
    const Value* x = n.operand(0);
    const Value* y = n.result();
    // The elements before a dim, as a static product and the symbols multiplied in.
    auto prefix = [](const Shape& s, size_t upto) {
      int64_t p = 1;
      std::multiset<std::string> syms;
      for (size_t i = 0; i < upto; ++i) {
        if (s[i].is_static()) p *= s[i].value();
        else syms.insert(s[i].str());
      }
      return std::make_pair(p, syms);
    };
    Sharding s = layout(n, 0), t = s;
    for (size_t a = 0; a < s.size(); ++a) {
      if (!s[a].is_shard()) continue;
      const auto dx = static_cast<size_t>(s[a].dim);
      const Dim& xd = x->shape()[dx];
      std::optional<int64_t> e;
      for (size_t k = 0; k < y->shape().size() && !e; ++k) {
        const Dim& yd = y->shape()[k];
        if (prefix(y->shape(), k) != prefix(x->shape(), dx)) continue;
        // A static dim may split or merge with its neighbours (blocks stay contiguous); a
        // symbolic one must come through whole.
        if (xd.is_static() ? (yd.is_static() && yd.value() > 1) : yd == xd) e = static_cast<int64_t>(k);
      }
      if (!e) return fallback(n);
      t[a] = P::shard(*e);
    }
    if (!fits(without_partials(t), y->type())) return fallback(n);
    Decision d;
    d.operands = {s};
    d.results = {t};
    d.attrs = n.attrs();
    const Shape local = local_shape(y->shape(), t, mesh_);
    std::vector<int64_t> shape = n.get_ints("shape");
    if (shape.size() == y->shape().size())
      for (size_t k = 0; k < shape.size(); ++k)
        if (shape[k] > 0 && local[k].is_static()) shape[k] = local[k].value();
    d.attrs["shape"] = Attribute(shape);
    return d;
  }

  /// expand: shards on dims the op does not broadcast stay; the target shape is made per-rank.
  Decision expand(const Node& n) const {
    const Value* x = n.operand(0);
    const Value* y = n.result();
    const int64_t off = rank_of(y) - rank_of(x);
    Sharding s = without_partials(layout(n, 0)), t = s;
    for (size_t a = 0; a < s.size(); ++a)
      if (s[a].is_shard()) {
        if (!(dim_of(x, s[a].dim) == dim_of(y, s[a].dim + off))) return fallback(n);
        t[a] = P::shard(s[a].dim + off);
      }
    if (!fits(t, y->type())) return fallback(n);
    Decision d;
    d.operands = {s};
    d.results = {t};
    d.attrs = n.attrs();
    std::vector<int64_t> shape = n.get_ints("shape");
    const Shape local = local_shape(y->shape(), t, mesh_);
    const int64_t so = rank_of(y) - static_cast<int64_t>(shape.size());
    for (size_t k = 0; k < shape.size(); ++k) {
      const Dim& l = local[static_cast<size_t>(static_cast<int64_t>(k) + so)];
      if (shape[k] > 1 && l.is_static()) shape[k] = l.value();
    }
    d.attrs["shape"] = Attribute(shape);
    return d;
  }

  /// Reductions over `axes` (reduce_*, softmax and norms over their axes, argmax): shards on
  /// kept dims stay (renumbered when dims are dropped); a shard on a reduced dim makes a
  /// partial sum/max where the op is one, else the operand is gathered first.
  Decision reduction(const Node& n, std::vector<int64_t> axes, bool keepdims, std::optional<ReduceOp> partial_kind,
                     bool partial_passes) const {
    const int64_t r = rank_of(n.operand(0));
    for (int64_t& ax : axes) ax = ax < 0 ? ax + r : ax;
    auto reduced = [&](int64_t d) { return std::find(axes.begin(), axes.end(), d) != axes.end(); };
    Sharding s = layout(n, 0), tx = s, t = s;
    for (size_t a = 0; a < s.size(); ++a) {
      if (s[a].is_partial()) {
        if (!(partial_passes && partial_kind && s[a].reduce == *partial_kind)) tx[a] = t[a] = P::replicate();
      } else if (s[a].is_shard()) {
        if (reduced(s[a].dim)) {
          if (partial_kind) t[a] = P::partial(*partial_kind);
          else tx[a] = t[a] = P::replicate();
        } else {
          int64_t e = s[a].dim;
          if (!keepdims)
            for (int64_t ax : axes) e -= ax < s[a].dim ? 1 : 0;
          t[a] = P::shard(e);
        }
      }
    }
    if (!fits(without_partials(t), n.result()->type())) return fallback(n);
    Decision d;
    d.operands = {tx};
    for (int i = 1; i < n.num_operands(); ++i) d.operands.push_back(replicated());  // scale, bias
    for (int i = 0; i < n.num_results(); ++i) d.results.push_back(t);
    d.attrs = n.attrs();
    return d;
  }

  /// attention(q, k, v, mask?) [B, H, S, D]: batch or heads sharded alike on q, k and v.
  Decision attention(const Node& n) const {
    Sharding sq = without_partials(layout(n, 0));
    Sharding tq = replicated(), tkv = replicated(), tm = replicated();
    for (size_t a = 0; a < sq.size(); ++a)
      if (sq[a].is_shard() && (sq[a].dim == 0 || sq[a].dim == 1)) {
        tq[a] = tkv[a] = sq[a];
        if (n.num_operands() > 3) {
          const Value* m = n.operand(3);
          const int64_t dm = sq[a].dim - (4 - rank_of(m));
          if (dm >= 0 && !(dim_of(m, dm) == Dim(1))) tm[a] = P::shard(dm);
        }
      }
    for (int i = 0; i < 3; ++i)
      if (!fits(i == 0 ? tq : tkv, n.operand(i)->type())) return fallback(n);
    if (n.num_operands() > 3 && !fits(tm, n.operand(3)->type())) return fallback(n);
    Decision d;
    d.operands = {tq, tkv, tkv};
    if (n.num_operands() > 3) d.operands.push_back(tm);
    d.results = {tq};
    d.attrs = n.attrs();
    return d;
  }

  /// gather(data, indices, axis): indices' shards become the output's (an embedding lookup of
  /// batch-sharded token ids). A table the policy splits by rows (`axis` 0, rank 2: the
  /// vocabulary) is vocab parallel on that mesh axis: each rank looks up the ids in its rows,
  /// zeros elsewhere, and the result is a partial sum (Megatron's VocabParallelEmbedding).
  Decision gather(const Node& n) const {
    const int64_t axis = n.get_int("axis") < 0 ? n.get_int("axis") + rank_of(n.operand(0)) : n.get_int("axis");
    Sharding si = without_partials(layout(n, 1)), t = replicated(), sd = replicated();
    for (size_t a = 0; a < si.size(); ++a)
      if (si[a].is_shard()) t[a] = P::shard(axis + si[a].dim);
    Decision d;
    if (axis == 0 && rank_of(n.operand(0)) == 2 && is_replicated(without_partials(layout(n, 0))))
      if (auto pick = ask_policy(n, 0, si))
        for (size_t a = 0; a < pick->size() && d.vocab_axis < 0; ++a)
          if ((*pick)[a].is_shard() && (*pick)[a].dim == 0 && !si[a].is_shard() && mesh_.axes[a].size > 1 &&
              dim_of(n.operand(0), 0).is_static())
            d.vocab_axis = static_cast<int>(a), t[a] = P::partial();
    if (!fits(without_partials(t), n.result()->type())) return fallback(n);
    d.operands = {sd, si};
    d.results = {t};
    d.attrs = n.attrs();
    return d;
  }

  /// scatter_add(zeros, ids, updates), an embedding's gradient: ids (and the updates' matching
  /// dims) split over an axis make each rank's sum over its own ids, so the result is a partial
  /// sum there. Data other than zeros would be counted once per rank: everything else falls back.
  Decision scatter_add(const Node& n) const {
    const int64_t axis = n.get_int("axis") < 0 ? n.get_int("axis") + rank_of(n.operand(0)) : n.get_int("axis");
    Sharding si = without_partials(layout(n, 1)), su = replicated(), t = replicated();
    bool split = false;
    for (size_t a = 0; a < si.size(); ++a)
      if (si[a].is_shard()) su[a] = P::shard(axis + si[a].dim), t[a] = P::partial(), split = true;
    if (split && !is_all_zeros(n.operand(0))) return fallback(n);
    Decision d;
    d.operands = {replicated(), si, su};
    d.results = {t};
    d.attrs = n.attrs();
    return d;
  }

  /// Ops that keep every dim but `axis` (or the spatial dims) as they are: shards elsewhere
  /// stay, the named dims must be whole.
  Decision keep_dims_except(const Node& n, const std::set<int64_t>& whole, int extra_replicated_operands) const {
    Sharding s = without_partials(layout(n, 0));
    for (P& p : s)
      if (p.is_shard() && whole.count(p.dim)) p = P::replicate();
    for (int i = 0; i < n.num_results(); ++i)
      if (!fits(s, n.result(i)->type())) return fallback(n);
    Decision d;
    d.operands = {s};
    for (int i = 1; i < n.num_operands(); ++i) d.operands.push_back(extra_replicated_operands ? replicated() : s);
    for (int i = 0; i < n.num_results(); ++i) d.results.push_back(s);
    d.attrs = n.attrs();
    return d;
  }

  Decision decide(const Node& n) const {
    const std::string& op = n.op_name();
    if (n.num_regions() > 0 || side_effects(n) || n.num_operands() == 0) return fallback(n);
    if (is_pointwise(n) || op == "where") return pointwise(n);
    const int64_t r = rank_of(n.operand(0));
    auto norm_axis = [&](int64_t ax) { return ax < 0 ? ax + r : ax; };
    if (op == "linear") return linear(n);
    if (op == "matmul") return matmul(n);
    if (op == "reshape") return reshape(n);
    if (op == "expand") return expand(n);
    if (op == "identity") return remap(n, [](int64_t d) { return d; });
    if (op == "transpose") {
      std::vector<int64_t> perm = n.get_ints("perm");
      if (perm.empty())
        for (int64_t i = r - 1; i >= 0; --i) perm.push_back(i);
      return remap(n, [perm](int64_t d) {
        for (size_t i = 0; i < perm.size(); ++i)
          if (perm[i] == d) return static_cast<int64_t>(i);
        return int64_t{-1};
      });
    }
    if (op == "flatten") {  // [x0..x(a-1)] and [xa..]: the outermost dim of each group keeps its blocks
      const int64_t axis = norm_axis(n.get_int("axis", 1));
      return remap(n, [axis](int64_t d) { return d == 0 ? 0 : d == axis ? 1 : -1; });
    }
    if (op == "unsqueeze" || op == "squeeze") {
      std::vector<int64_t> axes = n.get_ints("axes");
      const int64_t ry = rank_of(n.result());
      for (int64_t& ax : axes) ax = ax < 0 ? ax + (op == "unsqueeze" ? ry : r) : ax;
      return remap(n, [axes, op](int64_t d) {
        int64_t e = d;
        if (op == "squeeze") {
          for (int64_t ax : axes) e -= ax < d ? 1 : 0;
        } else {
          std::vector<int64_t> sorted = axes;
          std::sort(sorted.begin(), sorted.end());
          for (int64_t ax : sorted) e += ax <= e ? 1 : 0;
        }
        return e;
      });
    }
    if (op.rfind("reduce_", 0) == 0) {
      std::vector<int64_t> axes = n.get_ints("axes");
      if (axes.empty())  // over every dim
        for (int64_t d = 0; d < r; ++d) axes.push_back(d);
      const bool keep = n.get_int("keepdims", 1) != 0;
      if (op == "reduce_sum") return reduction(n, axes, keep, ReduceOp::kSum, true);
      if (op == "reduce_max") return reduction(n, axes, keep, ReduceOp::kMax, true);
      return reduction(n, axes, keep, std::nullopt, false);
    }
    if (op == "amax") {  // max |x| over every dim: a split operand gives a partial max
      std::vector<int64_t> every;
      for (int64_t d = 0; d < r; ++d) every.push_back(d);
      return reduction(n, every, false, ReduceOp::kMax, false);
    }
    // FP8 casts by a per-tensor scale: elementwise in x.
    if ((op == "quantize" || op == "dequantize") && num_elements(n.operand(1)->shape()) == 1) return pointwise(n);
    if (op == "requantize") return pointwise(n);  // x and its quantized q alike; the scales one element
    if (op == "softmax" || op == "log_softmax") return reduction(n, {norm_axis(n.get_int("axis"))}, true, std::nullopt, false);
    if (op == "cross_entropy_grad") {  // row-local: rows split as the logits', the classes whole
      Decision d = reduction(n, {r - 1}, true, std::nullopt, false);
      if (d.fallback) return d;
      d.operands[1] = d.operands[0];  // the targets' dims are the logits' leading dims
      return d;
    }
    if (op == "argmax" || op == "argmin")
      return reduction(n, {norm_axis(n.get_int("axis"))}, n.get_int("keepdims", 1) != 0, std::nullopt, false);
    if (op == "layer_norm" || op == "rms_norm") {
      std::vector<int64_t> axes;
      for (int64_t d = norm_axis(n.get_int("axis", -1)); d < r; ++d) axes.push_back(d);
      return reduction(n, axes, true, std::nullopt, false);
    }
    if (op == "attention") return attention(n);
    if (op == "gather") return gather(n);
    if (op == "scatter_add") return scatter_add(n);
    if (op == "split" || op == "concat") {
      for (int i = 1; i < n.num_operands(); ++i)
        if (layout(n, i) != layout(n, 0)) return fallback(n);
      return keep_dims_except(n, {norm_axis(n.get_int("axis"))}, 0);
    }
    if (op == "slice") {
      std::vector<int64_t> axes = n.get_ints("axes");
      if (axes.empty())
        for (size_t i = 0; i < n.get_ints("starts").size(); ++i) axes.push_back(static_cast<int64_t>(i));
      std::set<int64_t> whole;
      for (int64_t ax : axes) whole.insert(norm_axis(ax));
      return keep_dims_except(n, whole, 0);
    }
    if (op == "conv") return conv(n);
    if (op == "max_pool" || op == "avg_pool") {
      std::set<int64_t> whole;
      for (int64_t d = 2; d < r; ++d) whole.insert(d);  // batch and channels may stay split
      return keep_dims_except(n, whole, 0);
    }
    if (op == "batch_norm") {  // per channel: its parameters follow a channel split
      Decision d = keep_dims_except(n, [&] {
        std::set<int64_t> whole;
        for (int64_t k = 2; k < r; ++k) whole.insert(k);
        return whole;
      }(), 1);
      if (d.fallback) return d;
      Sharding params = replicated();
      for (size_t a = 0; a < params.size(); ++a)
        if (d.operands[0][a].is_shard() && d.operands[0][a].dim == 1) params[a] = P::shard(0);
      for (size_t i = 1; i < d.operands.size(); ++i) d.operands[i] = params;
      return d;
    }
    if (op == "scaled_matmul") return scaled_matmul(n);
    if (op == "matmul_int4") {
      std::set<int64_t> whole = {r - 1};
      return keep_dims_except(n, whole, 1);
    }
    return fallback(n);
  }

  /// A constant node in the per-rank graph, replicated.
  StatusOr<Value*> constant(Tensor t, const std::string& name, Location loc) {
    KILN_ASSIGN_OR_RETURN(Node * c, emit("constant", {}, {{"value", Attribute(std::move(t))}}, name, loc));
    c->result()->set_sharding(replicated());
    return c->result();
  }

  /// Vocab-parallel gather(table [V, D], ids) on mesh axis `a` of p ranks: the table is split
  /// into p blocks of ceil(V/p) rows (zero rows pad the last when p does not divide V, as
  /// Megatron pads its vocabulary); rank k looks up ids - k*rows clamped into its block and
  /// zeroes the rows of ids outside it, so the ranks' results sum to the lookup. Negative ids
  /// wrap first, as gather's do.
  StatusOr<Value*> lower_vocab_gather(const Node& n, const Decision& d) {
    const auto a = static_cast<size_t>(d.vocab_axis);
    const int64_t p = mesh_.axes[a].size, vocab = dim_of(n.operand(0), 0).value();
    const int64_t rows = (vocab + p - 1) / p;
    const std::string base = n.result()->name().empty() ? "gather" : n.result()->name();
    Value* table = local_.at(n.operand(0));
    KILN_ASSIGN_OR_RETURN(table, redistribute(table, replicated()));
    if (rows * p != vocab) {
      std::vector<int64_t> pad_shape = static_sizes(table->shape());
      pad_shape[0] = rows * p - vocab;
      if (const Tensor* whole = constant_tensor(table)) {  // pad the weight itself: it stays a weight
        std::vector<int64_t> shape = static_sizes(table->shape());
        shape[0] = rows * p;
        Tensor padded(whole->dtype(), shape);
        std::memcpy(padded.mutable_data(), whole->data(), whole->nbytes());
        std::memset(padded.mutable_data() + whole->nbytes(), 0, padded.nbytes() - whole->nbytes());
        KILN_ASSIGN_OR_RETURN(table, constant(std::move(padded), base + ".vocab_padded", n.loc()));
      } else {
        Tensor zeros(table->dtype(), pad_shape);
        std::memset(zeros.mutable_data(), 0, zeros.nbytes());
        KILN_ASSIGN_OR_RETURN(Value * z, constant(std::move(zeros), base + ".vocab_pad", n.loc()));
        KILN_ASSIGN_OR_RETURN(Node * cat, emit("concat", {table, z}, {{"axis", Attribute(int64_t{0})}}, base + ".vocab_padded", n.loc()));
        cat->result()->set_sharding(replicated());
        table = cat->result();
      }
    }
    Sharding split = replicated();
    split[a] = P::shard(0);
    KILN_ASSIGN_OR_RETURN(table, redistribute(table, split));
    KILN_ASSIGN_OR_RETURN(Value * ids, redistribute(local_.at(n.operand(1)), d.operands[1]));
    const Sharding ids_layout = ids->sharding().empty() ? replicated() : ids->sharding();
    std::vector<int64_t> starts;
    for (int64_t k = 0; k < p; ++k) starts.push_back(k * rows);
    KILN_ASSIGN_OR_RETURN(Value * all_starts,
                          constant(Tensor::from_i64(ids->dtype(), {p}, starts), base + ".vocab_start", n.loc()));
    KILN_ASSIGN_OR_RETURN(Value * start, collective("local_shard", all_starts, a, {{"dim", Attribute(int64_t{0})}}, split));
    auto step = [&](const std::string& op, std::vector<Value*> operands, AttrMap attrs, const std::string& suffix,
                    const Sharding& s) -> StatusOr<Value*> {
      KILN_ASSIGN_OR_RETURN(Node * m, emit(op, std::move(operands), std::move(attrs), base + suffix, n.loc()));
      m->result()->set_sharding(s);
      return m->result();
    };
    // gather wraps negative ids (numpy, ONNX): make them positive before comparing with the rows.
    KILN_ASSIGN_OR_RETURN(Value * no_id, constant(Tensor::scalar_i64(ids->dtype(), 0), base + ".id_zero", n.loc()));
    KILN_ASSIGN_OR_RETURN(Value * vocab_size, constant(Tensor::scalar_i64(ids->dtype(), vocab), base + ".vocab_size", n.loc()));
    KILN_ASSIGN_OR_RETURN(Value * negative, step("less", {ids, no_id}, {}, ".id_negative", ids_layout));
    KILN_ASSIGN_OR_RETURN(Value * wrapped, step("add", {ids, vocab_size}, {}, ".id_wrapped", ids_layout));
    KILN_ASSIGN_OR_RETURN(ids, step("where", {negative, wrapped, ids}, {}, ".id", ids_layout));
    KILN_ASSIGN_OR_RETURN(Value * local, step("sub", {ids, start}, {}, ".vocab_local", ids_layout));
    KILN_ASSIGN_OR_RETURN(Value * clamped, step("clip", {local}, {{"min", Attribute(0.0)}, {"max", Attribute(static_cast<double>(rows - 1))}},
                                                ".vocab_clamped", ids_layout));
    KILN_ASSIGN_OR_RETURN(Value * mine, step("equal", {local, clamped}, {}, ".vocab_mine", ids_layout));
    KILN_ASSIGN_OR_RETURN(Value * rows_of, step("gather", {table, clamped}, d.attrs, ".vocab_rows", d.results[0]));
    KILN_ASSIGN_OR_RETURN(Value * mask, step("unsqueeze", {mine}, {{"axes", Attribute(std::vector<int64_t>{rank_of(n.operand(1))})}},
                                             ".vocab_mask", ids_layout));
    KILN_ASSIGN_OR_RETURN(Value * zero, constant(Tensor::scalar_f64(table->dtype(), 0.0), base + ".zero", n.loc()));
    KILN_ASSIGN_OR_RETURN(Value * partial, step("where", {mask, rows_of, zero}, {}, "", d.results[0]));
    // Reduce at once, as Megatron does (all-reduce, or reduce-scatter into the sequence-parallel
    // residual stream): a partial embedding would otherwise keep the whole residual stream
    // partial, each norm all-reducing it.
    Sharding reduced = d.results[0];
    reduced[a] = P::replicate();
    const int64_t seq = opt_.policy.shard_partial_sums_along;
    if (seq >= 0 && seq < rank_of(n.result()) && !dim_shared(reduced, a, seq)) {
      reduced[a] = P::shard(seq);
      if (!fits(reduced, n.result()->type())) reduced[a] = P::replicate();
    }
    return redistribute(partial, reduced);
  }

  /// cross_entropy with its rows split (a batch or sequence dim of logits and targets): each
  /// rank sums its rows' losses (a partial sum); a mean divides by the count of counted targets
  /// over every rank, so ignored targets weigh as in the unsplit op. Declines (false) when
  /// nothing but the class dim is split.
  StatusOr<bool> lower_cross_entropy(const Node& n) {
    const int64_t classes = rank_of(n.operand(0)) - 1;
    Sharding tl = without_partials(layout(n, 0)), loss = replicated();
    bool split = false;
    for (size_t a = 0; a < tl.size(); ++a) {
      if (tl[a].is_shard() && tl[a].dim < classes) {
        loss[a] = P::partial();
        split = true;
      } else {
        tl[a] = P::replicate();
      }
    }
    if (!split || !fits(tl, n.operand(0)->type()) || !fits(tl, n.operand(1)->type())) return false;
    KILN_ASSIGN_OR_RETURN(Value * logits, redistribute(local_.at(n.operand(0)), tl));
    KILN_ASSIGN_OR_RETURN(Value * targets, redistribute(local_.at(n.operand(1)), tl));
    const std::string name = n.result()->name();
    AttrMap attrs = n.attrs();
    attrs["reduction"] = Attribute(std::string("sum"));
    const bool mean = n.get_string("reduction") == "mean";
    KILN_ASSIGN_OR_RETURN(Node * sum, emit("cross_entropy", {logits, targets}, attrs, mean ? name + ".local_sum" : name, n.loc()));
    sum->result()->set_sharding(loss);
    Value* out = sum->result();
    if (mean) {
      const DType t = targets->dtype();
      KILN_ASSIGN_OR_RETURN(Value * ignore, constant(Tensor::scalar_i64(t, n.get_int("ignore_index")), "", n.loc()));
      KILN_ASSIGN_OR_RETURN(Node * kept, emit("not_equal", {targets, ignore}, {}, "", n.loc()));
      kept->result()->set_sharding(tl);
      KILN_ASSIGN_OR_RETURN(Node * as_float, emit("cast", {kept->result()}, {{"to", Attribute(out->dtype())}}, "", n.loc()));
      as_float->result()->set_sharding(tl);
      KILN_ASSIGN_OR_RETURN(Node * count, emit("reduce_sum", {as_float->result()},
                                               {{"axes", Attribute(std::vector<int64_t>{})}, {"keepdims", Attribute(int64_t{0})}},
                                               name + ".count", n.loc()));
      count->result()->set_sharding(loss);
      KILN_ASSIGN_OR_RETURN(Value * total, redistribute(count->result(), replicated()));
      KILN_ASSIGN_OR_RETURN(Node * mean, emit("div", {out, total}, {}, name, n.loc()));
      mean->result()->set_sharding(loss);
      out = mean->result();
    }
    KILN_RETURN_IF_ERROR(finish(n, 0, out));
    return true;
  }

  /// The mesh axis that alone splits dim `d` in `s`, or -1.
  static int sole_axis_splitting(const Sharding& s, int64_t d) {
    int found = -1;
    for (size_t a = 0; a < s.size(); ++a)
      if (s[a].is_shard() && s[a].dim == d) {
        if (found >= 0) return -1;
        found = static_cast<int>(a);
      }
    return found;
  }

  /// A value of the per-rank graph laid out as `s`.
  StatusOr<Value*> step(const std::string& op, std::vector<Value*> operands, AttrMap attrs, const std::string& name,
                        const Sharding& s, Location loc) {
    KILN_ASSIGN_OR_RETURN(Node * m, emit(op, std::move(operands), std::move(attrs), name, loc));
    m->result()->set_sharding(s);
    return m->result();
  }

  /// x - max, exp(x - max) and the sum of exp(x - max) along dim `d` of `x` (laid out `s`, dim
  /// d split over mesh axis `a`): the max and the sum are reduced locally and all-reduced over
  /// `a` (keepdims, [.., 1]), what a softmax or a cross-entropy over split classes needs from
  /// the other ranks.
  struct SplitSoftmax {
    Value *shifted, *exp, *sum;
  };
  StatusOr<SplitSoftmax> split_max_and_sum(Value* x, int64_t d, size_t a, const Sharding& s, const std::string& base,
                                           Location loc) {
    const AttrMap over = {{"axes", Attribute(std::vector<int64_t>{d})}, {"keepdims", Attribute(int64_t{1})}};
    Sharding one = s, partial = s;
    one[a] = P::replicate();
    partial[a] = P::partial(ReduceOp::kMax);
    KILN_ASSIGN_OR_RETURN(Value * local_max, step("reduce_max", {x}, over, base + ".local_max", partial, loc));
    KILN_ASSIGN_OR_RETURN(Value * max, redistribute(local_max, one));
    KILN_ASSIGN_OR_RETURN(Value * shifted, step("sub", {x, max}, {}, base + ".shifted", s, loc));
    KILN_ASSIGN_OR_RETURN(Value * e, step("exp", {shifted}, {}, base + ".exp", s, loc));
    partial[a] = P::partial(ReduceOp::kSum);
    KILN_ASSIGN_OR_RETURN(Value * local_sum, step("reduce_sum", {e}, over, base + ".local_sum", partial, loc));
    KILN_ASSIGN_OR_RETURN(Value * sum, redistribute(local_sum, one));
    return SplitSoftmax{shifted, e, sum};
  }

  /// softmax / log_softmax along a dim split over one mesh axis: the max and the sum of
  /// exponentials are all-reduced, each rank normalises its own block (Megatron's vocab-parallel
  /// softmax), instead of gathering the operand. Declines (false) unless exactly one axis
  /// splits the dim.
  StatusOr<bool> lower_split_softmax(const Node& n) {
    const int64_t r = rank_of(n.operand(0));
    const int64_t d = n.get_int("axis") < 0 ? n.get_int("axis") + r : n.get_int("axis");
    const Sharding s = without_partials(layout(n, 0));
    const int a = sole_axis_splitting(s, d);
    if (a < 0 || !fits(s, n.operand(0)->type())) return false;
    KILN_ASSIGN_OR_RETURN(Value * x, redistribute(local_.at(n.operand(0)), s));
    const std::string base = n.result()->name().empty() ? n.op_name() : n.result()->name();
    KILN_ASSIGN_OR_RETURN(auto ms, split_max_and_sum(x, d, static_cast<size_t>(a), s, base, n.loc()));
    Value* y = nullptr;
    if (n.op_name() == "softmax") {
      KILN_ASSIGN_OR_RETURN(y, step("div", {ms.exp, ms.sum}, {}, n.result()->name(), s, n.loc()));
    } else {
      KILN_ASSIGN_OR_RETURN(Value * lse, step("log", {ms.sum}, {}, base + ".log_sum", ms.sum->sharding(), n.loc()));
      KILN_ASSIGN_OR_RETURN(y, step("sub", {ms.shifted, lse}, {}, n.result()->name(), s, n.loc()));
    }
    ++report_.split_softmaxes;
    KILN_RETURN_IF_ERROR(finish(n, 0, y));
    return true;
  }

  /// Targets `t` (laid out `tt`) against this rank's block of `block` classes (the last dim of
  /// logits laid out `tl`, split over mesh axis `a`): true where a row's target class is the
  /// column, [.., block] bool.
  StatusOr<Value*> target_in_block(Value* t, size_t a, int64_t block, const Sharding& tl, const Sharding& tt,
                                   const std::string& name, Location loc) {
    const int64_t ranks = mesh_.axes[a].size, classes = rank_of(t);
    std::vector<int64_t> starts;
    for (int64_t k = 0; k < ranks; ++k) starts.push_back(k * block);
    KILN_ASSIGN_OR_RETURN(Value * all_starts, constant(Tensor::from_i64(t->dtype(), {ranks}, starts), name + ".vocab_start", loc));
    Sharding one = replicated();
    one[a] = P::shard(0);
    KILN_ASSIGN_OR_RETURN(Value * start, collective("local_shard", all_starts, a, {{"dim", Attribute(int64_t{0})}}, one));
    KILN_ASSIGN_OR_RETURN(Value * local, step("sub", {t, start}, {}, name + ".vocab_local", tt, loc));
    KILN_ASSIGN_OR_RETURN(Value * column, step("unsqueeze", {local}, {{"axes", Attribute(std::vector<int64_t>{classes})}},
                                               name + ".vocab_column", tt, loc));
    KILN_ASSIGN_OR_RETURN(Value * iota, step("range", {}, {{"start", Attribute(0.0)}, {"limit", Attribute(static_cast<double>(block))},
                                                          {"delta", Attribute(1.0)}, {"dtype", Attribute(t->dtype())}},
                                             name + ".vocab_iota", replicated(), loc));
    return step("equal", {column, iota}, {}, name + ".vocab_mine", tl, loc);
  }

  /// The layouts of a vocab-parallel loss's logits and targets: the classes split over one mesh
  /// axis (returned), the rows as the logits' other shards; nullopt unless that fits.
  std::optional<size_t> vocab_layouts(const Node& n, Sharding& tl, Sharding& tt) const {
    const int64_t classes = rank_of(n.operand(0)) - 1;
    tl = without_partials(layout(n, 0));
    const int va = sole_axis_splitting(tl, classes);
    if (va < 0 || !dim_of(n.operand(0), classes).is_static()) return std::nullopt;
    tt = replicated();
    for (size_t b = 0; b < tl.size(); ++b) {
      if (b == static_cast<size_t>(va)) continue;
      if (tl[b].is_shard()) tt[b] = tl[b];
      else tl[b] = P::replicate();
    }
    if (!fits(tl, n.operand(0)->type()) || !fits(tt, n.operand(1)->type())) return std::nullopt;
    return static_cast<size_t>(va);
  }

  /// cross_entropy_grad over classes split over one mesh axis: softmax as lower_split_softmax
  /// computes it (the max and the sum all-reduced), minus the target's one-hot column on the rank
  /// holding it, so the logits are never gathered.
  StatusOr<bool> lower_vocab_parallel_cross_entropy_grad(const Node& n) {
    Sharding tl, tt;
    const std::optional<size_t> va = vocab_layouts(n, tl, tt);
    if (!va) return false;
    const size_t a = *va;
    const int64_t classes = rank_of(n.operand(0)) - 1;
    KILN_ASSIGN_OR_RETURN(Value * x, redistribute(local_.at(n.operand(0)), tl));
    KILN_ASSIGN_OR_RETURN(Value * t, redistribute(local_.at(n.operand(1)), tt));
    KILN_ASSIGN_OR_RETURN(Value * dloss, redistribute(local_.at(n.operand(2)), replicated()));
    const std::string name = n.result()->name().empty() ? "cross_entropy_grad" : n.result()->name();
    const Location loc = n.loc();
    const int64_t block = dim_of(n.operand(0), classes).value() / mesh_.axes[a].size;
    KILN_ASSIGN_OR_RETURN(auto ms, split_max_and_sum(x, classes, a, tl, name + ".vocab", loc));
    KILN_ASSIGN_OR_RETURN(Value * p, step("div", {ms.exp, ms.sum}, {}, name + ".vocab_softmax", tl, loc));
    KILN_ASSIGN_OR_RETURN(Value * mine, target_in_block(t, a, block, tl, tt, name, loc));
    KILN_ASSIGN_OR_RETURN(Value * onehot, step("cast", {mine}, {{"to", Attribute(x->dtype())}}, name + ".vocab_onehot", tl, loc));
    KILN_ASSIGN_OR_RETURN(Value * diff, step("sub", {p, onehot}, {}, name + ".vocab_diff", tl, loc));
    KILN_ASSIGN_OR_RETURN(Value * ignore, constant(Tensor::scalar_i64(t->dtype(), n.get_int("ignore_index")), name + ".ignore", loc));
    KILN_ASSIGN_OR_RETURN(Value * kept, step("not_equal", {t, ignore}, {}, name + ".kept", tt, loc));
    KILN_ASSIGN_OR_RETURN(Value * weight, step("cast", {kept}, {{"to", Attribute(x->dtype())}}, name + ".weight", tt, loc));
    KILN_ASSIGN_OR_RETURN(weight, step("unsqueeze", {weight}, {{"axes", Attribute(std::vector<int64_t>{classes})}},
                                       name + ".weight_column", tt, loc));
    KILN_ASSIGN_OR_RETURN(Value * scale, step("cast", {dloss}, {{"to", Attribute(x->dtype())}}, name + ".dloss", replicated(), loc));
    KILN_ASSIGN_OR_RETURN(weight, step("mul", {weight, scale}, {}, name + ".row_scale", tt, loc));
    KILN_ASSIGN_OR_RETURN(Value * g, step("mul", {diff, weight}, {}, name, tl, loc));
    if (g->dtype() != n.result()->dtype()) {
      KILN_ASSIGN_OR_RETURN(g, step("cast", {g}, {{"to", Attribute(n.result()->dtype())}}, name + ".cast", tl, loc));
    }
    ++report_.vocab_parallel_losses;
    KILN_RETURN_IF_ERROR(finish(n, 0, g));
    return true;
  }

  /// cross_entropy over logits whose classes are split over one mesh axis (a column-parallel
  /// output head), Megatron's vocab-parallel cross-entropy: the max and the sum of exponentials
  /// are all-reduced, the rank holding a row's target class picks its logit (the others add
  /// zero to an all-reduce), so the logits are never gathered. Rows split over other axes stay
  /// split (partial sums, the mean's count all-reduced as in lower_cross_entropy). Declines
  /// (false) unless exactly one axis splits the classes.
  StatusOr<bool> lower_vocab_parallel_cross_entropy(const Node& n) {
    const int64_t classes = rank_of(n.operand(0)) - 1;
    Sharding tl, tt;  // the targets' layout: the logits' rows
    const std::optional<size_t> va = vocab_layouts(n, tl, tt);
    if (!va) return false;
    const size_t a = *va;
    Sharding loss = replicated();
    for (size_t b = 0; b < tt.size(); ++b)
      if (tt[b].is_shard()) loss[b] = P::partial();
    KILN_ASSIGN_OR_RETURN(Value * x, redistribute(local_.at(n.operand(0)), tl));
    KILN_ASSIGN_OR_RETURN(Value * t, redistribute(local_.at(n.operand(1)), tt));
    const std::string name = n.result()->name().empty() ? "cross_entropy" : n.result()->name();
    const Location loc = n.loc();
    const int64_t ranks = mesh_.axes[a].size, block = dim_of(n.operand(0), classes).value() / ranks;
    KILN_ASSIGN_OR_RETURN(auto ms, split_max_and_sum(x, classes, a, tl, name + ".vocab", loc));
    const Sharding rows = tt;  // [.., 1] values: the targets' rows
    KILN_ASSIGN_OR_RETURN(Value * lse, step("log", {ms.sum}, {}, name + ".vocab_lse", rows, loc));
    // The target's logit (minus the max) from the rank whose block holds its class.
    KILN_ASSIGN_OR_RETURN(Value * mine, target_in_block(t, a, block, tl, tt, name, loc));
    KILN_ASSIGN_OR_RETURN(Value * zero, constant(Tensor::scalar_f64(x->dtype(), 0.0), name + ".zero", loc));
    KILN_ASSIGN_OR_RETURN(Value * hit, step("where", {mine, ms.shifted, zero}, {}, name + ".vocab_hit", tl, loc));
    Sharding partial = rows;
    partial[a] = P::partial();
    KILN_ASSIGN_OR_RETURN(Value * picked_local, step("reduce_sum", {hit}, {{"axes", Attribute(std::vector<int64_t>{classes})}, {"keepdims", Attribute(int64_t{1})}},
                                                     name + ".vocab_picked_local", partial, loc));
    KILN_ASSIGN_OR_RETURN(Value * picked, redistribute(picked_local, rows));
    KILN_ASSIGN_OR_RETURN(Value * per_row, step("sub", {lse, picked}, {}, name + ".vocab_row_loss", rows, loc));
    KILN_ASSIGN_OR_RETURN(per_row, step("squeeze", {per_row}, {{"axes", Attribute(std::vector<int64_t>{classes})}},
                                        name + ".vocab_row_losses", tt, loc));
    // Ignored targets count neither in the sum nor in the mean.
    KILN_ASSIGN_OR_RETURN(Value * ignore, constant(Tensor::scalar_i64(t->dtype(), n.get_int("ignore_index")), name + ".ignore", loc));
    KILN_ASSIGN_OR_RETURN(Value * kept, step("not_equal", {t, ignore}, {}, name + ".kept", tt, loc));
    KILN_ASSIGN_OR_RETURN(Value * weight, step("cast", {kept}, {{"to", Attribute(x->dtype())}}, name + ".weight", tt, loc));
    KILN_ASSIGN_OR_RETURN(per_row, step("mul", {per_row, weight}, {}, name + ".vocab_counted", tt, loc));
    const AttrMap every = {{"axes", Attribute(std::vector<int64_t>{})}, {"keepdims", Attribute(int64_t{0})}};
    const bool mean = n.get_string("reduction") == "mean";
    KILN_ASSIGN_OR_RETURN(Value * out, step("reduce_sum", {per_row}, every, mean ? name + ".sum" : name, loss, loc));
    if (mean) {
      KILN_ASSIGN_OR_RETURN(Value * count, step("reduce_sum", {weight}, every, name + ".count", loss, loc));
      KILN_ASSIGN_OR_RETURN(Value * total, redistribute(count, replicated()));
      KILN_ASSIGN_OR_RETURN(out, step("div", {out, total}, {}, name, loss, loc));
    }
    ++report_.vocab_parallel_losses;
    KILN_RETURN_IF_ERROR(finish(n, 0, out));
    return true;
  }

  /// mse_loss(input, target) split alike along any dims: each rank sums its squared errors (a
  /// partial sum); a mean divides by the whole input's element count. Declines (false) when
  /// nothing is split.
  StatusOr<bool> lower_mse_loss(const Node& n) {
    Sharding t = without_partials(layout(n, 0)), loss = replicated();
    bool split = false;
    for (size_t a = 0; a < t.size(); ++a) {
      if (t[a].is_shard()) {
        loss[a] = P::partial();
        split = true;
      }
    }
    if (!split || n.operand(0)->shape() != n.operand(1)->shape() || !fits(t, n.operand(0)->type())) return false;
    KILN_ASSIGN_OR_RETURN(Value * input, redistribute(local_.at(n.operand(0)), t));
    KILN_ASSIGN_OR_RETURN(Value * target, redistribute(local_.at(n.operand(1)), t));
    const std::string name = n.result()->name();
    const bool mean = n.get_string("reduction") == "mean";
    AttrMap attrs = n.attrs();
    attrs["reduction"] = Attribute(std::string("sum"));
    KILN_ASSIGN_OR_RETURN(Node * sum, emit("mse_loss", {input, target}, attrs, mean ? name + ".local_sum" : name, n.loc()));
    sum->result()->set_sharding(loss);
    Value* out = sum->result();
    if (mean) {
      const auto count = static_cast<double>(num_elements(n.operand(0)->shape()));
      KILN_ASSIGN_OR_RETURN(Value * total, constant(Tensor::scalar_f64(out->dtype(), count), name + ".count", n.loc()));
      KILN_ASSIGN_OR_RETURN(Node * div, emit("div", {out, total}, {}, name, n.loc()));
      div->result()->set_sharding(loss);
      out = div->result();
    }
    KILN_RETURN_IF_ERROR(finish(n, 0, out));
    return true;
  }

  /// Partitions one node of the global graph into the per-rank graph.
  Status lower(const Node& n) {
    if (n.op_name() == "cross_entropy") {
      KILN_ASSIGN_OR_RETURN(bool done, lower_vocab_parallel_cross_entropy(n));
      if (done) return ok_status();
    }
    if (n.op_name() == "cross_entropy_grad") {
      KILN_ASSIGN_OR_RETURN(bool done, lower_vocab_parallel_cross_entropy_grad(n));
      if (done) return ok_status();
    }
    if (n.op_name() == "cross_entropy" || (n.op_name() == "mse_loss" && is_static(n.operand(0)->shape()))) {
      KILN_ASSIGN_OR_RETURN(bool done, n.op_name() == "mse_loss" ? lower_mse_loss(n) : lower_cross_entropy(n));
      if (done) return ok_status();
    }
    if (n.op_name() == "softmax" || n.op_name() == "log_softmax") {
      KILN_ASSIGN_OR_RETURN(bool done, lower_split_softmax(n));
      if (done) return ok_status();
    }
    Decision d = decide(n);
    if (d.fallback) ++report_.replicated_fallbacks;
    if (d.vocab_axis >= 0) {
      KILN_ASSIGN_OR_RETURN(Value * v, lower_vocab_gather(n, d));
      ++report_.vocab_parallel;
      return finish(n, 0, v);
    }
    std::vector<Value*> operands;
    for (int i = 0; i < n.num_operands(); ++i) {
      KILN_ASSIGN_OR_RETURN(Value * v, redistribute(local_.at(n.operand(i)), d.operands[static_cast<size_t>(i)]));
      operands.push_back(v);
    }
    if (d.bias_after_reduce) operands.pop_back();
    std::vector<TensorType> types;
    std::vector<std::string> names;
    for (int i = 0; i < n.num_results(); ++i) {
      const Value* r = n.result(i);
      types.push_back(TensorType{r->dtype(), local_shape(r->shape(), without_partials(d.results[static_cast<size_t>(i)]), mesh_)});
      names.push_back(r->name());
    }
    KILN_ASSIGN_OR_RETURN(Node * m, out_.create_node(n.op_name(), operands, types, d.attrs, nullptr, names));
    m->set_loc(n.loc());
    for (int k = 0; k < n.num_regions(); ++k) m->add_region(n.region(k).clone());
    std::vector<TensorType> in;
    for (Value* v : operands) in.push_back(v->type());
    auto inferred = infer_node_types(*m, in);
    if (!inferred.ok()) return inferred.status().with_context("partition");
    for (int i = 0; i < m->num_results(); ++i) {
      if ((*inferred)[static_cast<size_t>(i)] != types[static_cast<size_t>(i)])
        return internal_error("partition: '" + n.op_name() + "' laid out " + sharding_str(d.results[static_cast<size_t>(i)]) +
                              " should compute " + types[static_cast<size_t>(i)].str() + " per rank, its shape rule gives " +
                              (*inferred)[static_cast<size_t>(i)].str());
      m->result(i)->set_sharding(d.results[static_cast<size_t>(i)]);
    }
    for (int i = 0; i < n.num_results(); ++i) {
      Value* v = m->result(i);
      if (d.bias_after_reduce) {
        KILN_ASSIGN_OR_RETURN(v, redistribute(v, without_partials(v->sharding())));
        KILN_ASSIGN_OR_RETURN(Value * bias, redistribute(local_.at(n.operand(2)), replicated()));
        if (n.op_name() == "conv") {  // [Cout] against [N, Cout, spatial...]
          std::vector<int64_t> shape(static_cast<size_t>(rank_of(n.result())) - 1, 1);
          shape[0] = -1;
          KILN_ASSIGN_OR_RETURN(Node * r, emit("reshape", {bias}, {{"shape", Attribute(shape)}}, bias->name() + ".channels", n.loc()));
          r->result()->set_sharding(replicated());
          bias = r->result();
        }
        KILN_ASSIGN_OR_RETURN(Node * add, emit("add", {v, bias}, {}, n.result(i)->name() + ".biased", n.loc()));
        add->result()->set_sharding(v->sharding());
        v = add->result();
      }
      KILN_RETURN_IF_ERROR(finish(n, i, v));
    }
    return ok_status();
  }

  /// Records `v` as result `i` of global node `n`; a placement written on the global value is
  /// a request, honoured once the value is computed.
  Status finish(const Node& n, int i, Value* v) {
    if (!n.result(i)->sharding().empty()) {
      KILN_RETURN_IF_ERROR(check(n.result(i)->sharding(), n.result(i)->type(), "%" + n.result(i)->name()));
      KILN_ASSIGN_OR_RETURN(v, redistribute(v, n.result(i)->sharding()));
    }
    local_[n.result(i)] = v;
    return ok_status();
  }

  const Graph& src_;
  const DeviceMesh mesh_;
  const PartitionOptions& opt_;
  Graph out_;
  PartitionReport report_;
  std::unordered_map<const Value*, Value*> local_;
  std::map<std::pair<Value*, std::string>, Value*> cache_;
};

}  // namespace

StatusOr<PartitionReport> partition(Graph& g, const PartitionOptions& options) {
  if (g.is_per_rank()) return failed_precondition("partition: graph @" + g.name() + " is already a per-rank program");
  Partitioner p(g, options);
  return p.run(g);
}

StatusOr<DeviceMesh> parse_mesh_option(const std::string& text) {
  DeviceMesh mesh;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto eq = item.find('=');
    auto trim = [](std::string s) {
      const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
      return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
    };
    if (eq == std::string::npos) return invalid_argument("mesh '" + text + "': expected NAME=SIZE, got '" + trim(item) + "'");
    DeviceMesh::Axis axis{trim(item.substr(0, eq)), 0};
    const std::string size = trim(item.substr(eq + 1));
    try {
      size_t used = 0;
      axis.size = std::stoll(size, &used);
      if (used != size.size()) throw std::invalid_argument(size);
    } catch (const std::exception&) {
      return invalid_argument("mesh '" + text + "': size of axis '" + axis.name + "' must be an integer, got '" + size + "'");
    }
    mesh.axes.push_back(std::move(axis));
  }
  if (mesh.empty()) return invalid_argument("mesh '" + text + "' names no axes");
  Status s = mesh.validate();
  if (!s.ok()) return invalid_argument("mesh '" + text + "': " + s.message());
  return mesh;
}

StatusOr<int> strategy_axis(const DeviceMesh& mesh, const std::string& name, int fallback_index, const std::string& who) {
  if (name.empty()) return fallback_index < 0 ? mesh.rank() + fallback_index : fallback_index;
  const int a = mesh.axis_index(name);
  if (a < 0) return invalid_argument(who + ": mesh " + mesh.str() + " has no axis '" + name + "'");
  return a;
}

std::vector<std::string> batch_input_names(const Graph& g, int64_t batch_dim, const std::vector<std::string>& names) {
  if (!names.empty()) return names;
  std::vector<std::string> chosen;
  for (const Value* in : g.inputs())
    if (in->type().rank() > batch_dim && !in->shape()[static_cast<size_t>(batch_dim)].is_static())
      chosen.push_back(in->name());
  // Static shapes: the first input's batch size picks out the batch inputs (a training
  // step's tokens and targets split alike).
  if (chosen.empty() && g.num_inputs() > 0 && g.input(0)->type().rank() > batch_dim) {
    const Dim& batch = g.input(0)->shape()[static_cast<size_t>(batch_dim)];
    for (const Value* in : g.inputs())
      if (in->type().rank() > batch_dim && in->shape()[static_cast<size_t>(batch_dim)] == batch) chosen.push_back(in->name());
  }
  if (chosen.empty() && g.num_inputs() > 0) chosen.push_back(g.input(0)->name());
  return chosen;
}

Status shard_batch_inputs(Graph& g, int axis, int64_t batch_dim, const std::vector<std::string>& names,
                          const std::string& who) {
  const DeviceMesh& mesh = g.mesh();
  std::vector<Value*> chosen;
  for (const std::string& name : batch_input_names(g, batch_dim, names)) {
    Value* found = nullptr;
    for (Value* in : g.inputs())
      if (in->name() == name) found = in;
    if (!found) return not_found(who + ": graph @" + g.name() + " has no input '" + name + "'");
    chosen.push_back(found);
  }
  for (Value* in : chosen) {
    if (in->type().rank() <= batch_dim)
      return invalid_argument(who + ": input %" + in->name() + " " + in->type().str() + " has no dim " + std::to_string(batch_dim));
    Sharding s = in->sharding().empty() ? Sharding(static_cast<size_t>(mesh.rank()), Placement::replicate()) : in->sharding();
    s[static_cast<size_t>(axis)] = Placement::shard(batch_dim);
    const Dim& batch = in->shape()[static_cast<size_t>(batch_dim)];
    int64_t ways = 1;
    for (size_t a = 0; a < s.size(); ++a)
      if (s[a].is_shard() && s[a].dim == batch_dim) ways *= mesh.axes[a].size;
    if (batch.is_static() && batch.value() % ways != 0)
      return invalid_argument(who + ": the batch of input %" + in->name() + " " + in->type().str() + " (dim " +
                              std::to_string(batch_dim) + ", " + std::to_string(batch.value()) + ") does not split evenly over " +
                              std::to_string(ways) + " ranks (mesh " + mesh.str() + "): use a batch size that is a multiple of " +
                              std::to_string(ways));
    if (Status st = check_sharding(s, mesh, in->type()); !st.ok())
      return invalid_argument(who + ": input %" + in->name() + ": " + st.message());
    in->set_sharding(std::move(s));
  }
  return ok_status();
}

Status start_strategy(Graph& g, const DeviceMesh& mesh, const std::string& who) {
  if (g.is_per_rank()) return failed_precondition(who + ": graph @" + g.name() + " is already a per-rank program");
  if (!g.mesh().empty() && g.mesh() != mesh)
    return invalid_argument(who + ": graph @" + g.name() + " is laid out on mesh " + g.mesh().str() + ", the strategy on " +
                            mesh.str());
  g.set_mesh(mesh);
  return ok_status();
}

}  // namespace kiln::parallel
