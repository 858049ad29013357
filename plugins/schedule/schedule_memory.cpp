// The schedule-memory pass (plugin kiln-schedule): reorders a graph's nodes, keeping a
// topological order, to lower the peak of live activation bytes (kiln/core/memory_estimate.h).
#include <algorithm>
#include <limits>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kiln/core/memory_estimate.h"
#include "kiln/ir/op.h"
#include "kiln/ir/walk.h"
#include "kiln/plugin.h"

namespace kiln::schedule {
namespace {

/// The graph as the scheduler sees it: nodes by original index, storage roots by index.
struct Problem {
  std::vector<Node*> nodes;
  std::vector<std::vector<int>> succ;  // dependants, by node index
  std::vector<int> preds;              // number of distinct predecessors
  std::vector<std::vector<int>> reads;  // distinct non-free roots a node reads
  std::vector<std::vector<int>> makes;  // roots a node allocates
  std::vector<int64_t> bytes;          // per root
  std::vector<bool> pinned;            // graph outputs: never freed
  std::vector<int> readers;            // per root: nodes reading it
  std::vector<int> inputs;             // roots live at the start
};

/// Values a node reads, including those its regions take from the enclosing graph.
void collect_reads(const Node& n, const Graph& g, std::vector<const Value*>& out) {
  walk(n, [&](const Node& m) {
    for (const Value* v : m.operands())
      if (v->graph() == &g || (v->producer() && v->producer()->graph() == &g)) out.push_back(v);
  });
}

Problem build(const Graph& g) {
  const StorageMap s(g);
  Problem p;
  std::unordered_map<const Node*, int> index;
  std::unordered_map<const Value*, int> root_id;
  auto rid = [&](const Value* r) {
    auto [it, fresh] = root_id.try_emplace(r, static_cast<int>(p.bytes.size()));
    if (fresh) {
      p.bytes.push_back(value_bytes(*r));
      p.pinned.push_back(false);
      p.readers.push_back(0);
    }
    return it->second;
  };
  for (const Value* v : g.inputs()) p.inputs.push_back(rid(v));
  int last_effect = -1;
  for (const auto& n : g.nodes()) {
    const int i = static_cast<int>(p.nodes.size());
    index[n.get()] = i;
    p.nodes.push_back(n.get());
    p.succ.emplace_back();
    p.preds.push_back(0);
    std::vector<const Value*> vals;
    collect_reads(*n, g, vals);
    std::unordered_set<int> from, roots;
    for (const Value* v : vals) {
      if (v->producer() && index.count(v->producer())) from.insert(index.at(v->producer()));
      if (s.root.count(v) && !s.is_free(v)) roots.insert(rid(s.root_of(v)));
    }
    // Nodes with side effects keep their relative order.
    if (n->op() && n->op()->has(kTraitSideEffects)) {
      if (last_effect >= 0) from.insert(last_effect);
      last_effect = i;
    }
    for (int f : from) p.succ[static_cast<size_t>(f)].push_back(i);
    p.preds.back() = static_cast<int>(from.size());
    p.reads.emplace_back(roots.begin(), roots.end());
    std::sort(p.reads.back().begin(), p.reads.back().end());
    for (int r : p.reads.back()) ++p.readers[static_cast<size_t>(r)];
    p.makes.emplace_back();
    for (const Value* r : n->results())
      if (s.root_of(r) == r && !s.is_free(r)) p.makes.back().push_back(rid(r));
  }
  for (const Value* o : g.outputs())
    if (!s.is_free(o)) p.pinned[static_cast<size_t>(rid(s.root_of(o)))] = true;
  return p;
}

/// The running schedule: readers left per root, live bytes, the ready nodes.
struct State {
  std::vector<int> left;
  std::vector<int> preds;
  std::vector<int> ready;  // node indices, kept sorted (original order breaks ties)
  int64_t live = 0;
};

/// Bytes live while `n` runs and bytes it leaves freed afterwards (its last reads, and
/// results nobody reads).
std::pair<int64_t, int64_t> cost(const Problem& p, const State& s, int n) {
  int64_t alloc = 0, freed = 0;
  for (int r : p.makes[static_cast<size_t>(n)]) {
    alloc += p.bytes[static_cast<size_t>(r)];
    if (p.readers[static_cast<size_t>(r)] == 0 && !p.pinned[static_cast<size_t>(r)]) freed += p.bytes[static_cast<size_t>(r)];
  }
  for (int r : p.reads[static_cast<size_t>(n)])
    if (s.left[static_cast<size_t>(r)] == 1 && !p.pinned[static_cast<size_t>(r)]) freed += p.bytes[static_cast<size_t>(r)];
  return {s.live + alloc, s.live + alloc - freed};
}

/// Cells a trial step changed, to put back afterwards.
using Undo = std::vector<std::pair<int*, int>>;

/// Runs `n`; returns the bytes live while it ran. Records changed counters in `undo`.
int64_t step(const Problem& p, State& s, int n, Undo* undo = nullptr) {
  const auto [during, after] = cost(p, s, n);
  s.live = after;
  auto dec = [&](int& cell) {
    if (undo) undo->push_back({&cell, cell});
    return --cell;
  };
  for (int r : p.reads[static_cast<size_t>(n)]) dec(s.left[static_cast<size_t>(r)]);
  s.ready.erase(std::find(s.ready.begin(), s.ready.end(), n));
  for (int m : p.succ[static_cast<size_t>(n)])
    if (dec(s.preds[static_cast<size_t>(m)]) == 0) s.ready.insert(std::upper_bound(s.ready.begin(), s.ready.end(), m), m);
  return during;
}

/// The ready node that leaves the fewest live bytes, then needs the fewest while it runs,
/// then comes first.
int best_net(const Problem& p, const State& s) {
  int best = s.ready.front();
  std::pair<int64_t, int64_t> best_cost{std::numeric_limits<int64_t>::max(), 0};
  for (int n : s.ready) {
    const auto [during, after] = cost(p, s, n);
    if (std::pair{after, during} < best_cost) best = n, best_cost = {after, during};
  }
  return best;
}

/// Runs every ready node that allocates nothing (constants, views, all-constant nodes): it can
/// only free memory, so it never needs a decision. Appends them to `order` when given.
void drain(const Problem& p, State& s, Undo* undo, std::vector<int>* order) {
  for (size_t i = 0; i < s.ready.size();) {
    const int n = s.ready[i];
    if (!p.makes[static_cast<size_t>(n)].empty()) {
      ++i;
      continue;
    }
    step(p, s, n, undo);
    if (order) order->push_back(n);
    i = 0;
  }
}

/// Greedy list scheduling: each ready candidate is tried with `lookahead` - 1 net-greedy
/// steps after it; the one whose window stays lowest above the running peak wins, then the
/// one leaving the fewest live bytes, then the earliest.
std::vector<int> greedy(const Problem& p, int lookahead) {
  State s;
  s.left = p.readers;
  s.preds = p.preds;
  for (int r : p.inputs)
    if (p.readers[static_cast<size_t>(r)] > 0 || p.pinned[static_cast<size_t>(r)]) s.live += p.bytes[static_cast<size_t>(r)];
  for (size_t i = 0; i < p.nodes.size(); ++i)
    if (s.preds[i] == 0) s.ready.push_back(static_cast<int>(i));
  int64_t peak = s.live;
  std::vector<int> order;
  Undo undo;
  while (true) {
    drain(p, s, nullptr, &order);
    if (s.ready.empty()) break;
    int choice = s.ready.front();
    if (s.ready.size() > 1) {
      std::pair<int64_t, int64_t> best{std::numeric_limits<int64_t>::max(), 0};
      const std::vector<int> ready = s.ready;
      const int64_t live = s.live;
      for (int c : ready) {
        undo.clear();
        int64_t window = step(p, s, c, &undo);
        for (int k = 1; k < lookahead; ++k) {
          drain(p, s, &undo, nullptr);
          if (s.ready.empty()) break;
          window = std::max(window, step(p, s, best_net(p, s), &undo));
        }
        const std::pair<int64_t, int64_t> score{std::max(window, peak), s.live};
        if (score < best) best = score, choice = c;
        for (auto it = undo.rbegin(); it != undo.rend(); ++it) *it->first = it->second;
        s.ready = ready;
        s.live = live;
      }
    }
    peak = std::max(peak, step(p, s, choice));
    order.push_back(choice);
  }
  return order;
}

/// Emits nodes in a given order of requests and, after each, completes values early: when every
/// node still to read a live value could run now and, together, they free more bytes than they
/// allocate, they run at once. A depth-first order alone leaves a value alive until its last
/// reader's turn comes, however cheap that reader is: a weight gradient's GEMM waits for the
/// whole input-gradient chain, a loss chunk's logits gradient for the other chunks.
class EagerEmitter {
 public:
  /// kFreeing: a group runs early when it frees more bytes than it allocates. kWithinPeak: also
  /// when it frees some and the live bytes stay within the peak so far (a loss chunk's logits
  /// gradient then goes at once, though its reader first makes the one bf16 copy of the head's
  /// weight that every chunk reads).
  enum class Eager { kOff, kFreeing, kWithinPeak };

  explicit EagerEmitter(const Problem& p) : p_(p), preds_(p.preds), left_(p.readers), done_(p.nodes.size(), 0) {
    for (int r : p.inputs)
      if (p.readers[static_cast<size_t>(r)] > 0 || p.pinned[static_cast<size_t>(r)]) live_ += p.bytes[static_cast<size_t>(r)];
    peak_ = live_;
    readers_.resize(p.bytes.size());
    pred_.resize(p.nodes.size());
    for (size_t n = 0; n < p.nodes.size(); ++n) {
      for (int r : p.reads[n]) readers_[static_cast<size_t>(r)].push_back(static_cast<int>(n));
      for (int m : p.succ[n]) pred_[static_cast<size_t>(m)].push_back(static_cast<int>(n));
    }
  }

  bool done(int n) const { return done_[static_cast<size_t>(n)] != 0; }

  /// Runs `n` (its predecessors must have run), then whatever completes values early.
  void emit(int n, Eager eager) {
    run(n);
    if (eager == Eager::kOff) return;
    std::vector<int> values(p_.reads[static_cast<size_t>(n)]);
    values.insert(values.end(), p_.makes[static_cast<size_t>(n)].begin(), p_.makes[static_cast<size_t>(n)].end());
    while (!values.empty()) {
      const int r = values.back();
      values.pop_back();
      std::vector<int> group;
      if (!completes(r, eager, group)) continue;
      for (int m : group) {
        run(m);
        const auto& reads = p_.reads[static_cast<size_t>(m)];
        const auto& makes = p_.makes[static_cast<size_t>(m)];
        values.insert(values.end(), reads.begin(), reads.end());
        values.insert(values.end(), makes.begin(), makes.end());
      }
    }
  }

  std::vector<int> order;

 private:
  static constexpr size_t kMaxGroup = 8;

  void run(int n) {
    done_[static_cast<size_t>(n)] = 1;
    order.push_back(n);
    for (int r : p_.makes[static_cast<size_t>(n)]) live_ += p_.bytes[static_cast<size_t>(r)];
    peak_ = std::max(peak_, live_);
    for (int r : p_.makes[static_cast<size_t>(n)])
      if (p_.readers[static_cast<size_t>(r)] == 0 && !p_.pinned[static_cast<size_t>(r)]) live_ -= p_.bytes[static_cast<size_t>(r)];
    for (int r : p_.reads[static_cast<size_t>(n)])
      if (--left_[static_cast<size_t>(r)] == 0 && !p_.pinned[static_cast<size_t>(r)]) live_ -= p_.bytes[static_cast<size_t>(r)];
    for (int m : p_.succ[static_cast<size_t>(n)]) --preds_[static_cast<size_t>(m)];
  }

  /// Whether the readers of root `r` still to run, with those of their predecessors that have
  /// yet to run (each ready itself), can run now and free more than they allocate; they go to
  /// `group` in an order that runs.
  bool completes(int r, Eager eager, std::vector<int>& group) const {
    if (left_[static_cast<size_t>(r)] == 0 || p_.pinned[static_cast<size_t>(r)]) return false;
    std::unordered_set<int> in;
    auto add = [&](int m) {
      if (in.insert(m).second) group.push_back(m);
    };
    for (int m : readers_[static_cast<size_t>(r)]) {
      if (done(m) || in.count(m)) continue;
      if (preds_[static_cast<size_t>(m)] != 0) {
        for (int q : pred_[static_cast<size_t>(m)]) {
          if (done(q) || in.count(q)) continue;
          if (preds_[static_cast<size_t>(q)] != 0) return false;
          add(q);
        }
      }
      add(m);
      if (group.size() > kMaxGroup) return false;
    }
    int64_t alloc = 0, freed = 0;
    std::unordered_map<int, int> reads;  // root -> readers of it in the group
    for (int m : group)
      for (int x : p_.reads[static_cast<size_t>(m)]) ++reads[x];
    for (int m : group)
      for (int x : p_.makes[static_cast<size_t>(m)]) {
        // A value readers outside the group wait for too (one bf16 copy of a weight that every
        // loss chunk reads) is made for them all: it does not count against this group.
        const auto at = reads.find(x);
        const int inside = at == reads.end() ? 0 : at->second;
        if (inside == 0 || inside == p_.readers[static_cast<size_t>(x)]) alloc += p_.bytes[static_cast<size_t>(x)];
      }
    for (const auto& [x, k] : reads)
      if (k == left_[static_cast<size_t>(x)] && !p_.pinned[static_cast<size_t>(x)]) freed += p_.bytes[static_cast<size_t>(x)];
    return freed > alloc || (eager == Eager::kWithinPeak && freed > 0 && live_ + alloc <= peak_);
  }

  const Problem& p_;
  std::vector<int> preds_, left_;
  std::vector<std::vector<int>> readers_, pred_;
  std::vector<char> done_;
  int64_t live_ = 0, peak_ = 0;
};

/// Depth-first from the outputs: each node right after the operands it needs, so a value is
/// consumed soon after it is made; predecessors are visited in their original order, or the
/// latest first with `latest_first` (in a backward, the last layer's weight gradients first).
/// With `eager`, values are completed early as EagerEmitter says. Nodes no output needs follow
/// in their original order.
std::vector<int> depth_first(const Problem& p, bool latest_first, EagerEmitter::Eager eager) {
  std::vector<std::vector<int>> pred(p.nodes.size());
  for (size_t i = 0; i < p.nodes.size(); ++i)
    for (int m : p.succ[i]) pred[static_cast<size_t>(m)].push_back(static_cast<int>(i));
  if (latest_first)
    for (auto& ps : pred) std::reverse(ps.begin(), ps.end());
  EagerEmitter out(p);
  std::unordered_map<const Node*, int> index;
  for (size_t i = 0; i < p.nodes.size(); ++i) index[p.nodes[i]] = static_cast<int>(i);
  auto visit = [&](int root) {
    if (out.done(root)) return;
    std::vector<std::pair<int, size_t>> stack{{root, 0}};
    while (!stack.empty()) {
      auto& [n, next] = stack.back();
      const auto& ps = pred[static_cast<size_t>(n)];
      if (next < ps.size()) {
        const int m = ps[next++];
        if (!out.done(m)) stack.push_back({m, 0});
        continue;
      }
      const int done = n;
      stack.pop_back();
      if (!out.done(done)) out.emit(done, eager);
    }
  };
  const Graph& g = *p.nodes.front()->graph();
  for (const Value* o : g.outputs())
    if (o->producer() && index.count(o->producer())) visit(index.at(o->producer()));
  for (size_t i = 0; i < p.nodes.size(); ++i) visit(static_cast<int>(i));
  return out.order;
}

class ScheduleMemory final : public Pass {
 public:
  ScheduleMemory(std::string algorithm, int lookahead) : algorithm_(std::move(algorithm)), lookahead_(lookahead) {}

  StatusOr<bool> run(Graph& g) override {
    if (g.num_nodes() < 2) return false;
    const Problem p = build(g);
    auto peak_of = [&](const std::vector<int>& order) {
      std::vector<const Node*> nodes;
      for (int i : order) nodes.push_back(p.nodes[static_cast<size_t>(i)]);
      return peak_activation_bytes(g, nodes);
    };
    std::vector<int> best(p.nodes.size());
    for (size_t i = 0; i < best.size(); ++i) best[i] = static_cast<int>(i);
    const std::vector<int> original = best;
    int64_t best_peak = peak_of(best);
    auto consider = [&](const std::vector<int>& order) {
      if (const int64_t peak = peak_of(order); peak < best_peak) best_peak = peak, best = order;
    };
    if (algorithm_ != "dfs") consider(greedy(p, lookahead_));
    if (algorithm_ != "greedy")
      for (bool latest_first : {false, true})
        for (auto eager : {EagerEmitter::Eager::kOff, EagerEmitter::Eager::kFreeing, EagerEmitter::Eager::kWithinPeak})
          consider(depth_first(p, latest_first, eager));
    if (best == original) return false;
    for (int i : best) g.move_node_before(p.nodes[static_cast<size_t>(i)], nullptr);
    return true;
  }

 private:
  std::string algorithm_;
  int lookahead_;
};

PassInfo schedule_memory_pass_info() {
  PassInfo info;
  info.name = "schedule-memory";
  info.version = "0.1.0";
  info.summary = "reorder nodes (topologically) to lower the peak of live activation memory";
  info.options = {
      {"algorithm", OptionType::kString, std::string("best"),
       "greedy (list scheduling with lookahead), dfs (depth-first from the outputs) or best (both); "
       "the original order stays unless one is strictly better"},
      {"lookahead", OptionType::kInt, int64_t{4}, "nodes the greedy scheduler simulates per candidate (>= 1)"},
  };
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    const std::string& algorithm = o.get_string("algorithm");
    if (algorithm != "greedy" && algorithm != "dfs" && algorithm != "best")
      return invalid_argument("schedule-memory: algorithm must be greedy, dfs or best, got '" + algorithm + "'");
    const int64_t lookahead = o.get_int("lookahead");
    if (lookahead < 1 || lookahead > 64)
      return invalid_argument("schedule-memory: lookahead must be in [1, 64], got " + std::to_string(lookahead));
    return std::unique_ptr<Pass>(std::make_unique<ScheduleMemory>(algorithm, static_cast<int>(lookahead)));
  };
  return info;
}

Status register_schedule(Registry& r) { return r.add_pass(schedule_memory_pass_info()); }

}  // namespace
}  // namespace kiln::schedule

KILN_PLUGIN("kiln-schedule", "0.1.0", kiln::schedule::register_schedule)
