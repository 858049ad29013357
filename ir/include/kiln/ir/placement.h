// Device meshes and placements: how a value is laid out over the ranks of a parallel run
// (DTensor's vocabulary: Shard(dim), Replicate, Partial(sum|max) per mesh axis).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kiln/ir/shape.h"
#include "kiln/ir/status.h"

namespace kiln {

/// Ranks arranged as an n-dimensional grid with named axes ("dp", "tp"), row-major: the last
/// axis varies fastest, so mesh {dp: 2, tp: 4} puts ranks 0-3 in data-parallel group 0.
struct DeviceMesh {
  struct Axis {
    std::string name;
    int64_t size = 1;
    bool operator==(const Axis&) const = default;
  };
  std::vector<Axis> axes;

  bool empty() const { return axes.empty(); }
  int rank() const { return static_cast<int>(axes.size()); }
  int64_t num_ranks() const;
  /// Index of the axis called `name`, or -1.
  int axis_index(const std::string& name) const;
  /// The coordinates of `rank` along every axis.
  std::vector<int64_t> coords(int64_t rank) const;
  int64_t rank_at(const std::vector<int64_t>& coords) const;
  /// The ranks that differ from `rank` only along `axis`, in axis order: the group a collective
  /// over that axis runs in. `rank`'s position in it is coords(rank)[axis].
  std::vector<int64_t> group(int64_t rank, int axis) const;
  /// "<dp = 2, tp = 4>"
  std::string str() const;
  /// Names are unique identifiers, sizes >= 1.
  Status validate() const;
  bool operator==(const DeviceMesh&) const = default;
};

enum class ReduceOp { kSum, kMax };
/// "sum", "max"
const char* reduce_op_name(ReduceOp op);
std::optional<ReduceOp> parse_reduce_op(const std::string& s);

/// How a value is laid out along one mesh axis.
struct Placement {
  enum class Kind { kReplicate, kShard, kPartial };
  Kind kind = Kind::kReplicate;
  int64_t dim = 0;                 ///< kShard: the tensor dim split into equal contiguous blocks
  ReduceOp reduce = ReduceOp::kSum;  ///< kPartial: each rank holds a term of this reduction

  static Placement replicate() { return {}; }
  static Placement shard(int64_t dim) { return {Kind::kShard, dim, ReduceOp::kSum}; }
  static Placement partial(ReduceOp op = ReduceOp::kSum) { return {Kind::kPartial, 0, op}; }
  bool is_replicate() const { return kind == Kind::kReplicate; }
  bool is_shard() const { return kind == Kind::kShard; }
  bool is_partial() const { return kind == Kind::kPartial; }
  /// "R", "S(1)", "P(sum)"
  std::string str() const;
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::kShard || dim == o.dim) && (kind != Kind::kPartial || reduce == o.reduce);
  }
};

/// One placement per mesh axis; empty means "not annotated" (replicated on every rank).
using Sharding = std::vector<Placement>;

/// "<S(0), R>"; "" for an empty sharding.
std::string sharding_str(const Sharding& s);
bool is_replicated(const Sharding& s);

/// Checks `s` against `mesh` and a value of `type`: one placement per axis, shard dims in range,
/// and (for global types, `divisible`) every sharded static dim divisible by the product of the
/// axis sizes that split it.
Status check_sharding(const Sharding& s, const DeviceMesh& mesh, const TensorType& type, bool divisible = true);

/// The shape one rank holds: every static dim sharded over axes of total size n divided by n.
/// Symbolic dims stay symbolic: in a per-rank program a symbol denotes the rank's own extent,
/// bound when its inputs arrive.
Shape local_shape(const Shape& global, const Sharding& s, const DeviceMesh& mesh);

/// The whole value's shape from a rank's piece: static sharded dims multiplied back.
Shape global_shape(const Shape& local, const Sharding& s, const DeviceMesh& mesh);

/// Element ranges of `global` held by `rank` along each dim: [begin, end).
std::vector<std::pair<int64_t, int64_t>> local_ranges(const std::vector<int64_t>& global, const Sharding& s,
                                                      const DeviceMesh& mesh, int64_t rank);

}  // namespace kiln
