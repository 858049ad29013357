// Device meshes and placements: rank arithmetic, checks, printing and local shapes.
#include "kiln/ir/placement.h"

#include <cctype>
#include <set>

namespace kiln {

int64_t DeviceMesh::num_ranks() const {
  int64_t n = 1;
  for (const Axis& a : axes) n *= a.size;
  return n;
}

int DeviceMesh::axis_index(const std::string& name) const {
  for (int i = 0; i < rank(); ++i)
    if (axes[static_cast<size_t>(i)].name == name) return i;
  return -1;
}

std::vector<int64_t> DeviceMesh::coords(int64_t r) const {
  std::vector<int64_t> c(axes.size());
  for (int i = rank() - 1; i >= 0; --i) {
    const int64_t size = axes[static_cast<size_t>(i)].size;
    c[static_cast<size_t>(i)] = r % size;
    r /= size;
  }
  return c;
}

int64_t DeviceMesh::rank_at(const std::vector<int64_t>& c) const {
  int64_t r = 0;
  for (size_t i = 0; i < axes.size(); ++i) r = r * axes[i].size + c[i];
  return r;
}

std::vector<int64_t> DeviceMesh::group(int64_t r, int axis) const {
  std::vector<int64_t> c = coords(r), out;
  for (int64_t k = 0; k < axes[static_cast<size_t>(axis)].size; ++k) {
    c[static_cast<size_t>(axis)] = k;
    out.push_back(rank_at(c));
  }
  return out;
}

std::string DeviceMesh::str() const {
  std::string s = "<";
  for (size_t i = 0; i < axes.size(); ++i)
    s += (i ? ", " : "") + axes[i].name + " = " + std::to_string(axes[i].size);
  return s + ">";
}

Status DeviceMesh::validate() const {
  std::set<std::string> seen;
  for (const Axis& a : axes) {
    bool ident = !a.name.empty() && (std::isalpha(static_cast<unsigned char>(a.name[0])) || a.name[0] == '_');
    for (char c : a.name) ident = ident && (std::isalnum(static_cast<unsigned char>(c)) || c == '_');
    if (!ident) return invalid_argument("mesh axis name '" + a.name + "' is not an identifier");
    if (!seen.insert(a.name).second) return invalid_argument("mesh axis '" + a.name + "' is named twice");
    if (a.size < 1) return invalid_argument("mesh axis '" + a.name + "' has size " + std::to_string(a.size) + ", expected >= 1");
  }
  return ok_status();
}

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "max"; }

std::optional<ReduceOp> parse_reduce_op(const std::string& s) {
  if (s == "sum") return ReduceOp::kSum;
  if (s == "max") return ReduceOp::kMax;
  return std::nullopt;
}

std::string Placement::str() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kShard: return "S(" + std::to_string(dim) + ")";
    case Kind::kPartial: return std::string("P(") + reduce_op_name(reduce) + ")";
  }
  return "?";
}

std::string sharding_str(const Sharding& s) {
  if (s.empty()) return "";
  std::string out = "<";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + s[i].str();
  return out + ">";
}

bool is_replicated(const Sharding& s) {
  for (const Placement& p : s)
    if (!p.is_replicate()) return false;
  return true;
}

namespace {

/// The number of blocks dim `d` is split into: the product of the sizes of the axes sharding it.
int64_t split_factor(const Sharding& s, const DeviceMesh& mesh, int64_t d) {
  int64_t n = 1;
  for (size_t a = 0; a < s.size() && a < mesh.axes.size(); ++a)
    if (s[a].is_shard() && s[a].dim == d) n *= mesh.axes[a].size;
  return n;
}

}  // namespace

Status check_sharding(const Sharding& s, const DeviceMesh& mesh, const TensorType& type, bool divisible) {
  if (s.empty()) return ok_status();
  if (mesh.empty()) return invalid_argument("placement " + sharding_str(s) + " on a graph without a mesh");
  if (static_cast<int>(s.size()) != mesh.rank())
    return invalid_argument("placement " + sharding_str(s) + " has " + std::to_string(s.size()) +
                            " entries for a mesh of " + std::to_string(mesh.rank()) + " axes " + mesh.str());
  for (size_t a = 0; a < s.size(); ++a) {
    if (!s[a].is_shard()) continue;
    if (s[a].dim < 0 || s[a].dim >= type.rank())
      return invalid_argument("placement " + s[a].str() + " on mesh axis '" + mesh.axes[a].name + "' of a value of type " +
                              type.str() + ": dim out of range");
  }
  for (int64_t d = 0; divisible && d < type.rank(); ++d) {
    const Dim& dim = type.shape[static_cast<size_t>(d)];
    const int64_t n = split_factor(s, mesh, d);
    if (n > 1 && dim.is_static() && dim.value() % n != 0)
      return invalid_argument("placement " + sharding_str(s) + " splits dim " + std::to_string(d) + " of " + type.str() +
                              " into " + std::to_string(n) + " blocks, which does not divide " + std::to_string(dim.value()));
  }
  return ok_status();
}

Shape local_shape(const Shape& global, const Sharding& s, const DeviceMesh& mesh) {
  Shape out = global;
  for (size_t d = 0; d < out.size(); ++d) {
    const int64_t n = split_factor(s, mesh, static_cast<int64_t>(d));
    if (n > 1 && out[d].is_static()) out[d] = Dim(out[d].value() / n);
  }
  return out;
}

Shape global_shape(const Shape& local, const Sharding& s, const DeviceMesh& mesh) {
  Shape out = local;
  for (size_t d = 0; d < out.size(); ++d) {
    const int64_t n = split_factor(s, mesh, static_cast<int64_t>(d));
    if (n > 1 && out[d].is_static()) out[d] = Dim(out[d].value() * n);
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> local_ranges(const std::vector<int64_t>& global, const Sharding& s,
                                                      const DeviceMesh& mesh, int64_t rank) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t g : global) ranges.emplace_back(0, g);
  const std::vector<int64_t> c = mesh.coords(rank);
  // Several axes sharding one dim split it in mesh-axis order: the first axis gives the
  // outermost blocks (DTensor's convention).
  for (size_t a = 0; a < s.size() && a < mesh.axes.size(); ++a) {
    if (!s[a].is_shard()) continue;
    auto& [begin, end] = ranges[static_cast<size_t>(s[a].dim)];
    const int64_t block = (end - begin) / mesh.axes[a].size;
    begin += c[a] * block;
    end = begin + block;
  }
  return ranges;
}

}  // namespace kiln
