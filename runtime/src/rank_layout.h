// Where one rank's data lies: its coordinates on the mesh, the weights it uploads (a
// rank-dependent weight only as this rank's block), and where its piece of each input and
// output sits in the whole tensor. Pure arithmetic on the plan: tested without a GPU.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kiln/artifact_reader.h"

namespace kiln::rt {

/// The coordinates of `rank` on every axis of `mesh`: row-major, the last axis fastest.
std::vector<int64_t> mesh_coords(const std::vector<artifact::MeshAxis>& mesh, int64_t rank);

/// Where this rank's bytes of buffer `b` start: offset + coord(rank_axis) * rank_stride.
uint64_t rank_offset(const artifact::PlanBuffer& b, const std::vector<artifact::MeshAxis>& mesh,
                     const std::vector<int64_t>& coords);

/// The weights a rank keeps on its device: the section without the other ranks' blocks of
/// rank-dependent weights (docs/artifact.md "rank_axis"), so a weight sharded over n ranks
/// costs each one 1/n of it. Offsets in the section map to offsets in the device copy.
class WeightLayout {
 public:
  /// Fails when a weight overlaps another rank's block (it would not be on the device).
  static bool build(const artifact::Plan& plan, uint64_t section_bytes,
                    const std::vector<int64_t>& coords, WeightLayout* out, std::string* error);
  /// Bytes of the device copy.
  uint64_t device_bytes() const { return section_bytes_ - left_out_; }
  /// The device offset of section offset `o`, which lies outside every left-out block.
  uint64_t device_offset(uint64_t o) const;
  /// The section offset of device offset `d`.
  uint64_t section_offset(uint64_t d) const;
  /// The section's ranges to upload, in order: (section offset, bytes).
  std::vector<std::pair<uint64_t, uint64_t>> kept() const;

 private:
  uint64_t section_bytes_ = 0, left_out_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> holes_;  ///< left-out [begin, end), sorted, disjoint
};

/// A rank's piece of an input or output within the whole tensor.
struct Piece {
  std::vector<int64_t> global_dims;  ///< the whole tensor
  std::vector<int64_t> offsets;      ///< where this rank's piece starts
  bool partial = false;              ///< the whole tensor reduces the pieces of a partial axis
};

/// The piece of a tensor of this rank's shape `local` laid out as `placement` (one entry per
/// mesh axis, or empty: replicated). Several axes sharding one dim split it outer axis first.
Piece piece_of(const std::vector<int64_t>& local,
               const std::vector<artifact::PlanPlacement>& placement,
               const std::vector<artifact::MeshAxis>& mesh, const std::vector<int64_t>& coords);

}  // namespace kiln::rt
