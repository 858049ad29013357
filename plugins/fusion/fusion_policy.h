// The fusion decisions of the kiln-fusion passes, behind one small interface: which group a
// node can anchor or join, and whether a producer and a consumer can share a kernel.
#pragma once

#include <cstdint>
#include <optional>

#include "kiln/ir/graph.h"

namespace kiln::fusion {

/// What kind of kernel a group becomes on the CUDA backend.
enum class GroupKind {
  kNone,       ///< not fusable: lowered on its own
  kPointwise,  ///< elementwise ops over one shape: one thread per element
  kRows,       ///< row reductions with their elementwise prologue and epilogue: one row per block
};

/// The index space of a row group: `full` shaped values split into rows at `axis`; every row
/// (dims [axis, rank)) is reduced as a whole.
struct RowSpace {
  Shape full;
  int64_t axis = 0;
  bool operator==(const RowSpace& o) const { return full == o.full && axis == o.axis; }
};

/// The row space `n` reduces over when it anchors a row group (rms_norm, layer_norm, softmax
/// and log_softmax over the last dim, reduce_* over trailing dims; static float shapes), else
/// nullopt.
std::optional<RowSpace> row_anchor(const Node& n);

/// What a value of shape `s` is in `space`: a full row value, one value per row (the full shape
/// with dims [axis, rank) set to 1), or neither.
enum class RowValue { kNone, kFull, kPerRow };
RowValue row_value(const Shape& s, const RowSpace& space);

/// Whether `n` is a quantize to f8 that may end a pointwise or row group: a float (not f8) input
/// of static shape and a one-element scale. Its f8 result only leaves the group (no member reads
/// an f8 value), so the group's kernel writes the quantized tensor in place of its input's
/// round trip through memory.
bool is_quantize_epilogue(const Node& n);

/// Whether `n` is an amax (max |x| over a whole float tensor, FP8 delayed scaling) that may end
/// the pointwise or row group computing x: the group's kernel reduces |x| as it computes x and
/// combines the blocks' maxima atomically. Its f32[] result only leaves the group.
bool is_amax_epilogue(const Node& n);

/// Whether `n`'s result may only leave its group (a quantize or amax epilogue): nothing in a
/// group reads it, so no member joins through it.
bool is_epilogue_only(const Node& n);

/// The group kind `n` anchors (kRows) or joins as a member (kPointwise), kNone otherwise.
GroupKind group_kind(const Node& n);

/// Whether `n` can be a member of a row group over `space`: an anchor of the same space, or an
/// elementwise op with a float result that is a full or per-row value and operands that
/// broadcast into it.
bool can_join_rows(const Node& n, const RowSpace& space);

/// Whether `n` is a data-movement op (transpose, slice, concat, expand, reshape, flatten,
/// squeeze, unsqueeze, identity) that a pointwise group may absorb: the CUDA lowering computes
/// it as index arithmetic inside the group's kernel. Needs static shapes throughout; whether
/// its users allow it (only group members) is the grouper's decision.
bool is_movement_member(const Node& n);

/// Whether `producer` and `consumer` can be in one kernel, given the row space of the group
/// they would form (nullopt for a pointwise group).
bool can_fuse(const Node& producer, const Node& consumer, const std::optional<RowSpace>& space);

/// Whether `consumer` is a weight gradient's running sum (autodiff's `_accumulate` add) and
/// `producer` made the sum so far: such an edge never fuses, so each contribution is added as
/// soon as it exists instead of every one waiting in memory for one kernel that sums them all.
bool is_running_sum_edge(const Node& producer, const Node& consumer);

}  // namespace kiln::fusion
