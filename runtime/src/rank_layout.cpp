// A rank's coordinates, weights and pieces (rank_layout.h).
#include "rank_layout.h"

#include <algorithm>

#include "kiln/artifact_format.h"

namespace kiln::rt {

using artifact::MeshAxis;
using artifact::PlanBuffer;
using artifact::PlanPlacement;

std::vector<int64_t> mesh_coords(const std::vector<MeshAxis>& mesh, int64_t rank) {
  std::vector<int64_t> c(mesh.size(), 0);
  for (size_t a = mesh.size(); a-- > 0;) {
    c[a] = rank % mesh[a].size;
    rank /= mesh[a].size;
  }
  return c;
}

namespace {

int64_t coord_on(const std::string& axis, const std::vector<MeshAxis>& mesh,
                 const std::vector<int64_t>& coords) {
  for (size_t a = 0; a < mesh.size() && a < coords.size(); ++a)
    if (mesh[a].name == axis) return coords[a];
  return 0;
}

int64_t axis_size(const std::string& axis, const std::vector<MeshAxis>& mesh) {
  for (const MeshAxis& a : mesh)
    if (a.name == axis) return a.size;
  return 1;
}

}  // namespace

uint64_t rank_offset(const PlanBuffer& b, const std::vector<MeshAxis>& mesh,
                     const std::vector<int64_t>& coords) {
  if (b.rank_axis.empty()) return b.offset;
  return b.offset + static_cast<uint64_t>(coord_on(b.rank_axis, mesh, coords)) * b.rank_stride;
}

bool WeightLayout::build(const artifact::Plan& plan, uint64_t section_bytes,
                         const std::vector<int64_t>& coords, WeightLayout* out,
                         std::string* error) {
  WeightLayout l;
  l.section_bytes_ = section_bytes;
  for (const PlanBuffer& b : plan.buffers) {
    if (b.kind != PlanBuffer::Kind::kWeight || b.rank_axis.empty() || b.bytes == 0) continue;
    const int64_t mine = coord_on(b.rank_axis, plan.mesh, coords);
    for (int64_t k = 0; k < axis_size(b.rank_axis, plan.mesh); ++k) {
      // Whole 256-byte units, so the weights after a hole keep their alignment on the device.
      const uint64_t at = b.offset + static_cast<uint64_t>(k) * b.rank_stride;
      const uint64_t end =
          std::min(section_bytes, (at + b.bytes + artifact::kTensorAlign - 1) /
                                      artifact::kTensorAlign * artifact::kTensorAlign);
      if (k != mine) l.holes_.emplace_back(at, end);
    }
  }
  std::sort(l.holes_.begin(), l.holes_.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& h : l.holes_) {
    if (!merged.empty() && h.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, h.second);
    else
      merged.push_back(h);
  }
  l.holes_ = std::move(merged);
  for (const auto& [b, e] : l.holes_) l.left_out_ += e - b;
  // Every weight this rank reads must survive: none may reach into a left-out block.
  for (const PlanBuffer& b : plan.buffers) {
    if (b.kind != PlanBuffer::Kind::kWeight || b.bytes == 0) continue;
    const uint64_t begin = rank_offset(b, plan.mesh, coords), end = begin + b.bytes;
    auto it =
        std::upper_bound(l.holes_.begin(), l.holes_.end(), std::make_pair(begin, ~uint64_t{0}));
    const bool overlaps = (it != l.holes_.end() && it->first < end) ||
                          (it != l.holes_.begin() && std::prev(it)->second > begin);
    if (overlaps) {
      *error = "plan: weight buffer " + std::to_string(b.id) +
               (b.name.empty() ? "" : " (" + b.name + ")") +
               " overlaps another rank's block of a rank-dependent weight";
      return false;
    }
  }
  *out = std::move(l);
  return true;
}

uint64_t WeightLayout::device_offset(uint64_t o) const {
  uint64_t shift = 0;
  for (const auto& [b, e] : holes_) {
    if (b >= o) break;
    shift += std::min(e, o) - b;
  }
  return o - shift;
}

uint64_t WeightLayout::section_offset(uint64_t d) const {
  uint64_t o = d;
  for (const auto& [b, e] : holes_) {
    if (b > o) break;
    o += e - b;
  }
  return o;
}

std::vector<std::pair<uint64_t, uint64_t>> WeightLayout::kept() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t at = 0;
  for (const auto& [b, e] : holes_) {
    if (b > at) out.emplace_back(at, b - at);
    at = e;
  }
  if (section_bytes_ > at) out.emplace_back(at, section_bytes_ - at);
  return out;
}

Piece piece_of(const std::vector<int64_t>& local, const std::vector<PlanPlacement>& placement,
               const std::vector<MeshAxis>& mesh, const std::vector<int64_t>& coords) {
  Piece p;
  p.global_dims = local;
  p.offsets.assign(local.size(), 0);
  std::vector<int64_t> index(local.size(), 0);  // the block index along each dim, outer axis first
  for (size_t a = 0; a < placement.size() && a < mesh.size(); ++a) {
    const PlanPlacement& pl = placement[a];
    if (pl.kind == PlanPlacement::Kind::kPartial) p.partial = true;
    if (pl.kind != PlanPlacement::Kind::kShard || pl.dim < 0 ||
        static_cast<size_t>(pl.dim) >= local.size())
      continue;
    const auto d = static_cast<size_t>(pl.dim);
    p.global_dims[d] *= mesh[a].size;
    index[d] = index[d] * mesh[a].size + (a < coords.size() ? coords[a] : 0);
  }
  for (size_t d = 0; d < local.size(); ++d) p.offsets[d] = index[d] * local[d];
  return p;
}

}  // namespace kiln::rt
