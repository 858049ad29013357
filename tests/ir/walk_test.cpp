// The shared walker: visit orders, skipping, stopping, errors, and the mutations it allows.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"
#include "kiln/ir/walk.h"

using namespace kiln;

namespace {

const TensorType kT{DType::kF32, {2}};

Node* must(StatusOr<Node*> n) {
  REQUIRE_MESSAGE(n.ok(), n.status().message());
  return *n;
}

/// Adds a fused node over `x` to `g` whose region computes `ops` in a chain; the region's
/// values are named `<prefix>` + op so that a walk's visits can be told apart.
Node* add_fused(Graph& g, Value* x, const std::string& prefix, const std::vector<std::string>& ops,
                Node* before = nullptr) {
  Node* f = must(g.create_node("fused", {x}, {kT}, {}, before, {prefix + "fused"}));
  Graph& body = f->add_region(prefix + "body");
  Value* v = body.add_input("p", kT);
  for (const std::string& op : ops)
    v = must(body.create_node(op, {v}, {kT}, {}, nullptr, {prefix + op}))->result();
  body.set_outputs({v});
  return f;
}

/// relu(x); fused { neg, exp }; add(fused, relu): the graph most tests walk.
struct Sample {
  Graph g{"main"};
  Node *relu, *fused, *add;
  Sample() {
    Value* x = g.add_input("x", kT);
    relu = must(g.create_node("relu", {x}, {kT}, {}, nullptr, {"relu"}));
    fused = add_fused(g, relu->result(), "", {"neg", "exp"});
    add = must(g.create_node("add", {fused->result(), relu->result()}, {kT}, {}, nullptr, {"add"}));
    g.set_outputs({add->result()});
  }
};

std::string name_of(const Node& n) { return n.num_results() ? n.result()->name() : n.op_name(); }

/// The names of the nodes a walk with `options` visits.
std::string visits(const Graph& g, WalkOptions options = {}) {
  std::string out;
  walk(
      g, [&](const Node& n) { out += (out.empty() ? "" : " ") + name_of(n); }, options);
  return out;
}

}  // namespace

TEST_CASE("walk visits nested regions in pre-order, post-order and reverse") {
  Sample s;
  REQUIRE(verify(s.g).ok());
  CHECK(visits(s.g) == "relu fused neg exp add");
  CHECK(visits(s.g, {.order = WalkOrder::kPostOrder}) == "relu neg exp fused add");
  CHECK(visits(s.g, {.reverse = true}) == "add fused exp neg relu");
  CHECK(visits(s.g, {.order = WalkOrder::kPostOrder, .reverse = true}) == "add exp neg fused relu");
}

TEST_CASE("walk goes to any depth, and from a node covers the node and what it holds") {
  Sample s;
  // A second level: a fused node inside the first one's region.
  Graph& body = s.fused->region(0);
  Node* neg = body.nodes().front().get();
  Node* inner = add_fused(body, body.input(0), "in_", {"tanh"}, neg);
  neg->set_operand(0, inner->result());
  REQUIRE(verify(s.g).ok());
  CHECK(visits(s.g) == "relu fused in_fused in_tanh neg exp add");
  std::string from_node;
  walk(*s.fused, [&](Node& n) { from_node += name_of(n) + " "; }, {.order = WalkOrder::kPostOrder});
  CHECK(from_node == "in_tanh in_fused neg exp fused ");
}

TEST_CASE("kSkip leaves a node's regions out in pre-order and means nothing in post-order") {
  Sample s;
  std::string seen;
  auto skip_fused = [&](const Node& n) {
    seen += name_of(n) + " ";
    return n.op_name() == "fused" ? WalkAction::kSkip : WalkAction::kAdvance;
  };
  CHECK_FALSE(walk(s.g, skip_fused));
  CHECK(seen == "relu fused add ");
  seen.clear();
  CHECK_FALSE(walk(s.g, skip_fused, {.order = WalkOrder::kPostOrder}));
  CHECK(seen == "relu neg exp fused add ");
}

TEST_CASE("kInterrupt stops the whole walk, from any depth, and the walk says so") {
  Sample s;
  std::string seen;
  const bool interrupted = walk(s.g, [&](const Node& n) {
    seen += name_of(n) + " ";
    return n.op_name() == "neg" ? WalkAction::kInterrupt : WalkAction::kAdvance;
  });
  CHECK(interrupted);
  CHECK(seen == "relu fused neg ");
  CHECK_FALSE(walk(s.g, [](const Node&) { return WalkAction::kAdvance; }));
  // The typical query: is there a node of some kind anywhere in a node?
  auto has_exp = [](const Node& n) {
    return walk(n, [](const Node& m) {
      return m.op_name() == "exp" ? WalkAction::kInterrupt : WalkAction::kAdvance;
    });
  };
  CHECK(has_exp(*s.fused));
  CHECK_FALSE(has_exp(*s.relu));
}

TEST_CASE("a callback's error ends the walk and is returned") {
  Sample s;
  std::string seen;
  Status st = walk(s.g, [&](Node& n) -> Status {
    seen += name_of(n) + " ";
    if (n.op_name() == "exp") return invalid_argument("no exp here");
    return ok_status();
  });
  CHECK(st.message() == "no exp here");
  CHECK(seen == "relu fused neg exp ");
  // StatusOr<WalkAction> callbacks can fail and steer at once.
  seen.clear();
  st = walk(s.g, [&](Node& n) -> StatusOr<WalkAction> {
    seen += name_of(n) + " ";
    if (n.op_name() == "fused") return WalkAction::kSkip;
    return WalkAction::kAdvance;
  });
  CHECK(st.ok());
  CHECK(seen == "relu fused add ");
  // An interrupted fallible walk is not an error.
  CHECK(walk(s.g, [](Node&) -> StatusOr<WalkAction> { return WalkAction::kInterrupt; }).ok());
}

TEST_CASE("erasing the visited node is safe: reverse pre-order removes a dead chain in one walk") {
  Sample s;
  // Cut the fused node and relu loose: add now reads the graph input only.
  s.add->set_operands({s.g.input(0), s.g.input(0)});
  int erased = 0;
  std::string seen;
  Status st = walk(s.g,
                   [&](Node& n) -> StatusOr<WalkAction> {
                     seen += name_of(n) + " ";
                     for (Value* r : n.results())
                       if (r->has_uses()) return WalkAction::kAdvance;
                     KILN_RETURN_IF_ERROR(n.graph()->erase_node(&n));
                     ++erased;
                     return WalkAction::kSkip;  // its regions are gone with it
                   },
                   {.reverse = true});
  REQUIRE_MESSAGE(st.ok(), st.message());
  CHECK(seen == "add fused relu ");
  CHECK(erased == 2);
  CHECK(s.g.num_nodes() == 1);
  CHECK(verify(s.g).ok());
}

TEST_CASE("post-order callbacks may erase the visited node and nodes already visited") {
  Sample s;
  // Replace every relu by its input, then drop nodes left without users, in one post-order walk.
  Status st = walk(s.g,
                   [&](Node& n) -> Status {
                     if (n.op_name() == "add") {
                       // Visited last: fused and relu, visited before, are erased here once unused.
                       n.set_operands({s.g.input(0), s.g.input(0)});
                       KILN_RETURN_IF_ERROR(s.g.erase_node(s.fused));
                       return s.g.erase_node(s.relu);
                     }
                     if (n.op_name() == "exp") {
                       // The region's last node: replace it by its operand and erase it.
                       n.result()->replace_all_uses_with(n.operand(0));
                       return n.graph()->erase_node(&n);
                     }
                     return ok_status();
                   },
                   {.order = WalkOrder::kPostOrder});
  REQUIRE_MESSAGE(st.ok(), st.message());
  CHECK(visits(s.g) == "add");
  CHECK(verify(s.g).ok());
}

TEST_CASE("nodes created during a walk are visited only in graphs it enters later") {
  Sample s;
  std::string seen;
  Status st = walk(s.g, [&](Node& n) -> Status {
    seen += name_of(n) + " ";
    if (n.op_name() == "relu") {
      // In the graph being walked: after relu, but not in the snapshot.
      KILN_ASSIGN_OR_RETURN(Node * m,
                            s.g.create_node("neg", {n.result()}, {kT}, {}, s.add, {"late"}));
      (void)m;
    }
    if (n.op_name() == "fused") {
      // In the region the walk enters next: visited.
      Graph& body = n.region(0);
      Node* last = body.output(0)->producer();
      KILN_ASSIGN_OR_RETURN(
          Node * m, body.create_node("abs", {last->result()}, {kT}, {}, nullptr, {"early"}));
      body.set_outputs({m->result()});
    }
    return ok_status();
  });
  REQUIRE_MESSAGE(st.ok(), st.message());
  CHECK(seen == "relu fused neg exp early add ");
  CHECK(visits(s.g) == "relu fused neg exp early late add");
}

TEST_CASE("walk_graphs visits each graph once, before or after those nested in it") {
  Sample s;
  Graph& body = s.fused->region(0);
  Node* neg = body.nodes().front().get();
  Node* inner = add_fused(body, body.input(0), "in_", {"tanh"}, neg);
  neg->set_operand(0, inner->result());
  add_fused(s.g, s.g.input(0), "two_", {"sin"});
  auto names = [&](WalkOrder order, const std::string& skip) {
    std::string out;
    walk_graphs(
        static_cast<const Graph&>(s.g),
        [&](const Graph& g) {
          out += g.name() + " ";
          return g.name() == skip ? WalkAction::kSkip : WalkAction::kAdvance;
        },
        order);
    return out;
  };
  CHECK(names(WalkOrder::kPreOrder, "") == "main body in_body two_body ");
  CHECK(names(WalkOrder::kPostOrder, "") == "in_body body two_body main ");
  CHECK(names(WalkOrder::kPreOrder, "body") == "main body two_body ");
  // A pre-order callback may rewrite its graph: regions it erased are not walked.
  std::string seen;
  Status st = walk_graphs(s.g, [&](Graph& g) -> Status {
    seen += g.name() + " ";
    if (g.name() != "main") return ok_status();
    Node* two = nullptr;
    for (Node* n : g.node_list())
      if (n->num_results() && n->result()->name() == "two_fused") two = n;
    return g.erase_node(two);
  });
  REQUIRE_MESSAGE(st.ok(), st.message());
  CHECK(seen == "main body in_body ");
  CHECK(walk_graphs(s.g, [](Graph&) { return WalkAction::kInterrupt; }));
}
