// The one walker over a graph and the graphs nested in its nodes' regions, for every pass.
//
//   walk(g, [](Node& n) { ... });                               every node, pre-order
//   walk(g, fn, {.order = WalkOrder::kPostOrder});              regions' nodes before their node
//   bool found = walk(n, [](const Node& m) { return is_x(m) ? WalkAction::kInterrupt
//                                                           : WalkAction::kAdvance; });
//   KILN_RETURN_IF_ERROR(walk_graphs(g, [&](Graph& sub) -> Status { return rewrite(sub); }));
//
// What a callback may return, and what the walk then returns:
//   void or WalkAction                the walk returns bool: true when a callback interrupted it
//   Status or StatusOr<WalkAction>    the walk returns Status: the first error a callback
//                                     returned (nothing is visited after it), else ok
//
// Mutation during a node walk. The walk reads each graph's node list into a snapshot when it
// enters that graph and visits the snapshot in order. In the callback for node `n` you may:
//   - change `n` (attributes, operands, result types and names), redirect uses
//     (replace_all_uses_with), set graph outputs;
//   - erase `n` itself; in pre-order then return kSkip, since its regions went with it;
//   - erase nodes the walk is done with: those visited before `n` together with their regions
//     (in post-order also the nodes nested in `n`);
//   - create or move nodes anywhere. A created node is visited only when it lands in a graph the
//     walk enters later (in pre-order, a region of `n`); moving a node does not change the order
//     of a snapshot already taken.
// You must not erase a node the walk has still to visit (a later node of `n`'s graph or of any
// enclosing graph), nor a node whose region is being walked (an ancestor of `n`).
//
// Mutation during a graph walk (walk_graphs). The callback for graph `sub` may rewrite `sub`
// freely (erase, create, fuse). In pre-order the regions of `sub`'s nodes are read after the
// callback returns, so regions it erased are not walked and regions it created are; in
// post-order every graph nested in `sub` has already been walked. The callback must not change
// an enclosing graph or a sibling graph.
#pragma once

#include <functional>
#include <type_traits>
#include <utility>

#include "kiln/ir/graph.h"
#include "kiln/ir/status.h"

namespace kiln {

/// What a walk callback asks of the walker next.
enum class WalkAction {
  kAdvance,  ///< go on: in pre-order into this node's (graph's) regions, then onwards
  kSkip,     ///< pre-order: leave out what is nested in this node (graph); post-order: as kAdvance
  kInterrupt,  ///< stop the walk; nothing else is visited
};

/// When a node (graph) is visited relative to what is nested in it.
enum class WalkOrder {
  kPreOrder,   ///< a node, then the nodes of its regions
  kPostOrder,  ///< the nodes of a node's regions, then the node
};

/// How a node walk proceeds.
struct WalkOptions {
  WalkOrder order = WalkOrder::kPreOrder;
  /// Each graph's nodes last to first (a node's regions are still taken first to last). With
  /// pre-order, every user of a value in the same graph is seen before its producer.
  bool reverse = false;
};

namespace walk_detail {

using NodeVisitor = std::function<StatusOr<WalkAction>(Node&)>;
using GraphVisitor = std::function<StatusOr<WalkAction>(Graph&)>;

/// The walks themselves: true when interrupted, or the first error a callback returned.
StatusOr<bool> walk_graph(Graph& g, const NodeVisitor& fn, WalkOptions options);
StatusOr<bool> walk_node(Node& n, const NodeVisitor& fn, WalkOptions options);
StatusOr<bool> walk_graphs(Graph& g, const GraphVisitor& fn, WalkOrder order);

/// Runs `impl` on `root` with `fn` as its visitor of `Arg` (passed as `const Arg&` when
/// `kConst`). `fn` returns void, WalkAction, Status or StatusOr<WalkAction>; the result is a
/// Status when `fn` can fail, else whether the walk was interrupted.
template <typename Arg, bool kConst, typename Root, typename F, typename How>
auto run(StatusOr<bool> (*impl)(Root&, const std::function<StatusOr<WalkAction>(Arg&)>&, How),
         Root& root, F& fn, How how) {
  using Passed = std::conditional_t<kConst, const Arg&, Arg&>;
  using R = std::invoke_result_t<F&, Passed>;
  constexpr bool kCanFail = std::is_same_v<R, Status> || std::is_same_v<R, StatusOr<WalkAction>>;
  static_assert(std::is_void_v<R> || std::is_same_v<R, WalkAction> || kCanFail,
                "a walk callback returns void, WalkAction, Status or StatusOr<WalkAction>");
  auto visit = [&fn](Arg& x) -> StatusOr<WalkAction> {
    Passed arg = x;
    if constexpr (std::is_void_v<R>) {
      fn(arg);
      return WalkAction::kAdvance;
    } else if constexpr (std::is_same_v<R, Status>) {
      Status s = fn(arg);
      if (!s.ok()) return s;
      return WalkAction::kAdvance;
    } else {
      return fn(arg);
    }
  };
  StatusOr<bool> interrupted = impl(root, visit, how);
  if constexpr (kCanFail) {
    return interrupted.status();
  } else {
    return interrupted.ok() && *interrupted;  // such callbacks cannot fail
  }
}

}  // namespace walk_detail

/// Visits every node of `g` and of the graphs nested in its nodes' regions, at any depth.
template <typename F>
auto walk(Graph& g, F&& fn, WalkOptions options = {}) {
  return walk_detail::run<Node, false>(walk_detail::walk_graph, g, fn, options);
}

/// As above, for a graph that is only read; the callback takes `const Node&`.
template <typename F>
auto walk(const Graph& g, F&& fn, WalkOptions options = {}) {
  return walk_detail::run<Node, true>(walk_detail::walk_graph, const_cast<Graph&>(g), fn, options);
}

/// Visits `n` and every node nested in its regions, at any depth.
template <typename F>
auto walk(Node& n, F&& fn, WalkOptions options = {}) {
  return walk_detail::run<Node, false>(walk_detail::walk_node, n, fn, options);
}

/// As above, for a node that is only read; the callback takes `const Node&`.
template <typename F>
auto walk(const Node& n, F&& fn, WalkOptions options = {}) {
  return walk_detail::run<Node, true>(walk_detail::walk_node, const_cast<Node&>(n), fn, options);
}

/// Calls `fn` on `g` and on every graph nested in it (the regions of its nodes, at any depth):
/// for passes that rewrite one graph at a time. Pre-order: a graph before the graphs nested in
/// it (kSkip leaves those out); post-order: after them. Regions of one node and the nodes of
/// one graph are taken in order.
template <typename F>
auto walk_graphs(Graph& g, F&& fn, WalkOrder order = WalkOrder::kPreOrder) {
  return walk_detail::run<Graph, false>(walk_detail::walk_graphs, g, fn, order);
}

/// As above, for a graph that is only read; the callback takes `const Graph&`.
template <typename F>
auto walk_graphs(const Graph& g, F&& fn, WalkOrder order = WalkOrder::kPreOrder) {
  return walk_detail::run<Graph, true>(walk_detail::walk_graphs, const_cast<Graph&>(g), fn, order);
}

}  // namespace kiln
