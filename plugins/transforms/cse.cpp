// The cse pass: merges nodes that compute the same thing from the same operands.
#include <algorithm>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "transforms.h"

namespace kiln::transforms {
namespace {

void mix(size_t& h, size_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); }

/// A hash consistent with Attribute::operator==: equal attributes hash equally.
size_t attr_hash(const Attribute& a) {
  size_t h = static_cast<size_t>(a.kind());
  switch (a.kind()) {
    case AttrKind::kInt: mix(h, std::hash<int64_t>{}(a.as_int())); break;
    case AttrKind::kFloat: break;  // 0.0 == -0.0 but their bits differ: leave to operator==
    case AttrKind::kString: mix(h, std::hash<std::string>{}(a.as_string())); break;
    case AttrKind::kInts:
      for (int64_t v : a.as_ints()) mix(h, std::hash<int64_t>{}(v));
      break;
    case AttrKind::kFloats: mix(h, a.as_floats().size()); break;
    case AttrKind::kStrings:
      for (const std::string& s : a.as_strings()) mix(h, std::hash<std::string>{}(s));
      break;
    case AttrKind::kTensor: {
      // Dtype, shape and a prefix of the bytes: enough to keep unrelated constants apart
      // without hashing whole weight tensors.
      const Tensor& t = a.as_tensor();
      mix(h, static_cast<size_t>(t.dtype()));
      for (int64_t d : t.shape()) mix(h, std::hash<int64_t>{}(d));
      const size_t n = std::min<size_t>(t.nbytes(), 256);
      if (n > 0)
        mix(h, std::hash<std::string_view>{}(
                   std::string_view(reinterpret_cast<const char*>(t.data()), n)));
      break;
    }
    case AttrKind::kDType: mix(h, static_cast<size_t>(a.as_dtype())); break;
  }
  return h;
}

size_t node_hash(const Node& n) {
  size_t h = std::hash<std::string>{}(n.op_name());
  for (const Value* v : n.operands()) mix(h, std::hash<const Value*>{}(v));
  for (int i = 0; i < n.num_results(); ++i) mix(h, static_cast<size_t>(n.result(i)->dtype()));
  for (const auto& [name, a] : n.attrs()) {
    mix(h, std::hash<std::string>{}(name));
    mix(h, attr_hash(a));
  }
  return h;
}

bool same_computation(const Node& a, const Node& b) {
  if (a.op_name() != b.op_name() || a.operands() != b.operands() ||
      a.num_results() != b.num_results() || a.attrs() != b.attrs())
    return false;
  for (int i = 0; i < a.num_results(); ++i)
    if (a.result(i)->type() != b.result(i)->type()) return false;
  return true;
}

class Cse final : public Pass {
 public:
  StatusOr<bool> run(Graph& g) override {
    bool changed = false;
    // Regions are isolated graphs: each is deduplicated on its own.
    KILN_RETURN_IF_ERROR(walk_graphs(g, [&](Graph& sub) -> Status {
      KILN_ASSIGN_OR_RETURN(bool c, dedupe(sub));
      changed |= c;
      return ok_status();
    }));
    return changed;
  }

 private:
  /// Merges the duplicate nodes of `g` itself (not those nested in its regions).
  static StatusOr<bool> dedupe(Graph& g) {
    bool changed = false;
    // Nodes are visited in order and uses are redirected as we go, so a chain of duplicates
    // (two equal matmuls feeding two equal relus) collapses in a single walk.
    std::unordered_map<size_t, std::vector<Node*>> seen;
    for (Node* n : g.node_list()) {
      // Nodes holding regions are not merged with each other (that would need structural
      // comparison of bodies).
      if (n->num_regions() > 0 || has_side_effects(*n)) continue;
      std::vector<Node*>& bucket = seen[node_hash(*n)];
      Node* earlier = nullptr;
      for (Node* m : bucket)
        if (same_computation(*m, *n)) {
          earlier = m;
          break;
        }
      if (!earlier) {
        bucket.push_back(n);
        continue;
      }
      for (int i = 0; i < n->num_results(); ++i)
        n->result(i)->replace_all_uses_with(earlier->result(i));
      KILN_RETURN_IF_ERROR(g.erase_node(n));
      changed = true;
    }
    return changed;
  }
};

}  // namespace

PassInfo cse_pass_info() {
  PassInfo info;
  info.name = "cse";
  info.version = "0.1.0";
  info.summary = "merge nodes with the same op, operands, attributes and result types";
  info.create = [](const Options&) -> StatusOr<std::unique_ptr<Pass>> {
    return std::unique_ptr<Pass>(std::make_unique<Cse>());
  };
  return info;
}

}  // namespace kiln::transforms
