// Private to the kiln-fusion plugin: the factories of the passes it registers.
#pragma once

#include <optional>
#include <vector>

#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"
#include "kiln/ir/walk.h"

namespace kiln::fusion {

/// Registry entry of fuse-pointwise (registered by register.cpp).
PassInfo fuse_pointwise_pass_info();
/// Registry entry of fuse-attention (registered by register.cpp).
PassInfo fuse_attention_pass_info();
/// Registry entry of fuse-rows (fuse_rows.cpp).
PassInfo fuse_rows_pass_info();
/// Registry entry of fuse-horizontal (fuse_horizontal.cpp).
PassInfo fuse_horizontal_pass_info();
/// Registry entry of fold-layout (fold_layout.cpp).
PassInfo fold_layout_pass_info();
/// Registry entry of layout-nhwc (layout_nhwc.cpp).
PassInfo layout_nhwc_pass_info();
/// The permutation a transpose applies, axes normalized; none given reverses them (numpy's
/// default). Defined in fold_layout.cpp.
std::vector<int64_t> perm_of(const Node& t);

// Grouping helpers shared by the fusion passes (defined in fuse_pointwise.cpp).

/// Whether `n` or anything nested in it must not be moved or merged.
bool has_side_effects(const Node& n);
/// Whether `g` is the body of a fused node: already one group, never regrouped.
inline bool is_fused_body(const Graph& g) {
  return g.parent_node() && g.parent_node()->op_name() == "fused";
}
bool has_unknown_dim(const Shape& s);
/// Numpy broadcasting of `a` and `b`, strict about symbols (a dim joins only an equal dim or a
/// static 1); nullopt when they do not broadcast.
std::optional<Shape> strict_join(const Shape& a, const Shape& b);
/// Whether `from` broadcasts to exactly `to`.
bool broadcasts_into(const Shape& from, const Shape& to);
/// A one-element constant, which groups copy into their region instead of taking it as input.
bool is_scalar_constant(const Node* n);
/// Replaces `members` (in graph order, one result each) with one fused node whose results are
/// the members' values used outside; false, changing nothing, when none is.
StatusOr<bool> build_fused(Graph& g, const std::vector<Node*>& members);
/// Restores a topological order after fused nodes were placed at their last member.
void reorder(Graph& g);
/// Builds a fused node from each group of at least `min_size` members (build_fused), then drops
/// the scalar constants the regions copied and restores a topological order; whether anything fused.
StatusOr<bool> fuse_groups(Graph& g, const std::vector<std::vector<Node*>>& groups, int64_t min_size);

}  // namespace kiln::fusion
