// The verifier: structure, SSA order, use lists, schemas and types, recursively into regions.
#include "kiln/ir/verifier.h"

#include <algorithm>
#include <unordered_set>

#include "kiln/ir/op.h"
#include "ops/ops.h"

namespace kiln {
namespace {

/// Declared types may be more specific than inferred ones where inference gave "?".
bool type_matches(const TensorType& declared, const TensorType& inferred) {
  if (declared.dtype != inferred.dtype || declared.shape.size() != inferred.shape.size())
    return false;
  for (size_t i = 0; i < declared.shape.size(); ++i)
    if (!(declared.shape[i] == inferred.shape[i]) && !inferred.shape[i].is_unknown()) return false;
  return true;
}

std::string value_ref(const Value* v) {
  return v->name().empty() ? "<unnamed>" : "%" + v->name();
}

/// A value's placement fits the mesh; in a per-rank program types are local, so only the
/// global view's dims must divide evenly.
Status check_value_sharding(const Graph& g, const Value* v) {
  if (v->sharding().empty()) return ok_status();
  const Graph* top = &g;
  while (top->parent_node()) top = top->parent_node()->graph();
  Status s = check_sharding(v->sharding(), g.mesh(), v->type(), !top->is_per_rank());
  return s.ok() ? s : invalid_argument(value_ref(v) + ": " + s.message());
}

Status verify_graph(const Graph& g, int depth) {
  if (depth > 64) return invalid_argument("regions nested deeper than 64 levels");
  if (Status s = g.mesh().validate(); !s.ok()) return invalid_argument("graph @" + g.name() + ": " + s.message());
  std::unordered_set<const Value*> defined;
  for (int i = 0; i < g.num_inputs(); ++i) {
    const Value* in = g.input(i);
    if (in->graph() != &g || in->index() != i)
      return internal_error("graph @" + g.name() + ": input " + std::to_string(i) + " is misplaced");
    if (Status s = check_value_sharding(g, in); !s.ok()) return invalid_argument("graph @" + g.name() + ": " + s.message());
    defined.insert(in);
  }
  for (const auto& node_ptr : g.nodes()) {
    const Node& n = *node_ptr;
    auto fail = [&](const std::string& m) {
      return error_at(n.loc(), StatusCode::kInvalidArgument, n.op_name() + ": " + m);
    };
    if (!n.op()) return fail("unknown op");
    std::vector<TensorType> operand_types;
    for (int i = 0; i < n.num_operands(); ++i) {
      const Value* v = n.operand(i);
      if (!v) return fail("operand " + std::to_string(i) + " is missing");
      if (v->graph() != &g)
        return fail("operand " + std::to_string(i) + " (" + value_ref(v) +
                    ") is defined outside this graph; regions are isolated");
      if (!defined.count(v))
        return fail("operand " + std::to_string(i) + " (" + value_ref(v) +
                    ") is used before it is defined");
      const auto& uses = v->uses();
      if (std::find(uses.begin(), uses.end(), Use{const_cast<Node*>(&n), i}) == uses.end())
        return internal_error(n.op_name() + ": use list of operand " + std::to_string(i) +
                              " is out of date");
      operand_types.push_back(v->type());
    }
    for (int r = 0; r < n.num_regions(); ++r) {
      Status s = verify_graph(n.region(r), depth + 1);
      if (!s.ok()) return s;
    }
    KILN_ASSIGN_OR_RETURN(auto inferred, infer_node_types(n, std::move(operand_types)));
    for (int i = 0; i < n.num_results(); ++i) {
      const Value* res = n.result(i);
      if (!type_matches(res->type(), inferred[static_cast<size_t>(i)]))
        return fail("result " + std::to_string(i) + " is declared " + res->type().str() +
                    " but the op produces " + inferred[static_cast<size_t>(i)].str());
      if (Status s = check_value_sharding(g, res); !s.ok()) return fail(s.message());
      defined.insert(res);
    }
  }
  if (g.num_outputs() == 0 && g.parent_node() == nullptr && g.num_nodes() > 0)
    return invalid_argument("graph @" + g.name() + " has no outputs");
  for (int i = 0; i < g.num_outputs(); ++i) {
    const Value* v = g.output(i);
    if (!v) return invalid_argument("graph @" + g.name() + ": output " + std::to_string(i) + " is not set");
    if (v->graph() != &g || !defined.count(v))
      return invalid_argument("graph @" + g.name() + ": output " + std::to_string(i) + " (" +
                              value_ref(v) + ") is not defined in this graph");
  }
  return ok_status();
}

}  // namespace

Status verify(const Graph& g) {
  KILN_RETURN_IF_ERROR(verify_graph(g, 0));
  return g.parent_node() == nullptr ? verify_state(g) : ok_status();
}

}  // namespace kiln
