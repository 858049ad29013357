// Checkpoints by logical tensor: writing each rank's piece, reading them back whole, resharding.
#include "checkpoint.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <functional>
#include <fstream>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "kiln/core/npy.h"
#include "kiln/ir/mesh_run.h"
#include "partition.h"

namespace kiln::parallel {
namespace fs = std::filesystem;
namespace {

constexpr const char* kIndex = "checkpoint.toml";
constexpr int64_t kVersion = 1;

std::string mesh_option_str(const DeviceMesh& m) {
  std::string s;
  for (const auto& a : m.axes) s += (s.empty() ? "" : ", ") + a.name + "=" + std::to_string(a.size);
  return s;
}

StatusOr<Placement> parse_placement(const std::string& text) {
  if (text == "R") return Placement::replicate();
  if (text.size() > 3 && text.rfind("S(", 0) == 0 && text.back() == ')') {
    try {
      size_t used = 0;
      const int64_t d = std::stoll(text.substr(2, text.size() - 3), &used);
      if (used == text.size() - 3 && d >= 0) return Placement::shard(d);
    } catch (const std::exception&) {
    }
  }
  if (text == "P(sum)") return Placement::partial(ReduceOp::kSum);
  if (text == "P(max)") return Placement::partial(ReduceOp::kMax);
  return invalid_argument("placement '" + text + "': expected R, S(dim), P(sum) or P(max)");
}

std::string toml_string(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + "\"";
}

/// A file name for a tensor's piece: the tensor's index and name (unsafe characters replaced),
/// and the piece's block coordinates on the axes that split it.
std::string piece_file(size_t index, const CheckpointTensor& t, const DeviceMesh& mesh, int64_t rank) {
  std::string name;
  for (char c : t.name) name += (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-') ? c : '_';
  std::ostringstream f;
  f << index << "-" << name;
  const std::vector<int64_t> coords = mesh.coords(rank);
  for (size_t a = 0; a < t.placement.size(); ++a)
    if (!t.placement[a].is_replicate()) f << "." << mesh.axes[a].name << coords[a];
  f << ".npy";
  return f.str();
}

Status check_piece(const CheckpointTensor& t, const DeviceMesh& mesh, int64_t rank, const Tensor& piece) {
  const Shape want = local_shape(shape_of(t.shape), t.placement, mesh);
  if (piece.dtype() != t.dtype || piece.type().shape != want)
    return invalid_argument("checkpoint tensor '" + t.name + "': rank " + std::to_string(rank) + "'s piece is " +
                            piece.type().str() + ", its placement " + sharding_str(t.placement) + " on mesh " +
                            mesh.str() + " needs " + TensorType{t.dtype, want}.str());
  return ok_status();
}

StatusOr<std::vector<Tensor>> pieces_of(const Tensor& whole, const Sharding& s, const DeviceMesh& mesh) {
  std::vector<Tensor> pieces;
  for (int64_t r = 0; r < mesh.num_ranks(); ++r) {
    KILN_ASSIGN_OR_RETURN(Tensor p, local_piece(whole, s, mesh, r));
    pieces.push_back(std::move(p));
  }
  return pieces;
}

}  // namespace

StatusOr<Checkpoint> checkpoint_from_program(const Graph& g) {
  Checkpoint c;
  c.mesh = g.mesh().empty() ? DeviceMesh{{{"dp", 1}}} : g.mesh();
  if (!g.mesh().empty() && !g.is_per_rank())
    return failed_precondition("checkpoint: graph @" + g.name() + " is a global view; partition it first");
  std::set<std::string> names;
  for (const auto& n : g.nodes()) {
    if (n->op_name() != "constant" || n->result()->name().empty()) continue;
    const Value* v = n->result();
    const Tensor* whole = constant_tensor(v);
    if (!whole) continue;
    // The layout the rank's copy takes: where every use is a local_shard (of a local_shard ...),
    // the one layout they all end in; otherwise the rank uses it whole.
    std::set<std::string> layouts;
    Sharding placement;
    bool whole_use = false;
    std::function<void(const Value*)> walk = [&](const Value* x) {
      for (const Use& u : x->uses()) {
        if (u.user && u.user->op_name() == "local_shard") {
          walk(u.user->result());
        } else if (x == v) {
          whole_use = true;
        } else {
          layouts.insert(sharding_str(x->sharding()));
          placement = x->sharding();
        }
      }
    };
    walk(v);
    if (whole_use || layouts.size() != 1) placement.assign(static_cast<size_t>(c.mesh.rank()), Placement::replicate());
    if (!names.insert(v->name()).second)
      return invalid_argument("checkpoint: two constants of @" + g.name() + " are named '" + v->name() + "'");
    CheckpointTensor t{v->name(), whole->dtype(), whole->shape(), placement, {}};
    KILN_ASSIGN_OR_RETURN(t.pieces, pieces_of(*whole, placement, c.mesh));
    c.tensors.push_back(std::move(t));
  }
  return c;
}

Status write_checkpoint(const std::string& dir, const Checkpoint& c) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("checkpoint: cannot create folder '" + dir + "': " + ec.message());
  std::ostringstream index;
  index << "# A Kiln checkpoint: logical tensors, each with its placement over the mesh below and\n"
        << "# the .npy file of every rank's piece (docs/parallel.md).\n"
        << "format = \"kiln-checkpoint\"\nversion = " << kVersion << "\nmesh = " << toml_string(mesh_option_str(c.mesh))
        << "\n";
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const CheckpointTensor& t = c.tensors[i];
    if (static_cast<int64_t>(t.pieces.size()) != c.mesh.num_ranks())
      return invalid_argument("checkpoint tensor '" + t.name + "' has " + std::to_string(t.pieces.size()) +
                              " pieces for a mesh of " + std::to_string(c.mesh.num_ranks()) + " ranks");
    index << "\n[[tensor]]\nname = " << toml_string(t.name) << "\ndtype = \"" << dtype_name(t.dtype) << "\"\nshape = [";
    for (size_t d = 0; d < t.shape.size(); ++d) index << (d ? ", " : "") << t.shape[d];
    index << "]\nplacement = [";
    for (size_t a = 0; a < t.placement.size(); ++a) index << (a ? ", " : "") << "\"" << t.placement[a].str() << "\"";
    index << "]\nfiles = [";
    std::set<std::string> written;
    for (int64_t r = 0; r < c.mesh.num_ranks(); ++r) {
      KILN_RETURN_IF_ERROR(check_piece(t, c.mesh, r, t.pieces[static_cast<size_t>(r)]));
      const std::string file = piece_file(i, t, c.mesh, r);
      index << (r ? ", " : "") << toml_string(file);
      if (written.insert(file).second)
        KILN_RETURN_IF_ERROR(write_npy((fs::path(dir) / file).string(), t.pieces[static_cast<size_t>(r)]));
    }
    index << "]\n";
  }
  std::ofstream out(fs::path(dir) / kIndex);
  out << index.str();
  out.close();
  if (!out) return io_error("checkpoint: cannot write " + (fs::path(dir) / kIndex).string());
  return ok_status();
}

StatusOr<Checkpoint> read_checkpoint(const std::string& dir) {
  const std::string path = (fs::path(dir) / kIndex).string();
  if (!fs::exists(path)) return not_found("checkpoint: '" + dir + "' has no " + kIndex);
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << "checkpoint: " << path << ": " << e.description() << " at line " << e.source().begin.line;
    return invalid_argument(msg.str());
  }
  auto bad = [&](const std::string& why) { return invalid_argument("checkpoint: " + path + ": " + why); };
  if (t["format"].value_or(std::string()) != "kiln-checkpoint") return bad("format is not \"kiln-checkpoint\"");
  if (t["version"].value_or(int64_t{0}) != kVersion)
    return bad("version " + std::to_string(t["version"].value_or(int64_t{0})) + " is not " + std::to_string(kVersion));
  Checkpoint c;
  auto mesh = parse_mesh_option(t["mesh"].value_or(std::string()));
  if (!mesh.ok()) return bad(mesh.status().message());
  c.mesh = *mesh;
  const toml::array* tensors = t["tensor"].as_array();
  if (!tensors) return c;
  std::set<std::string> names;
  for (const toml::node& node : *tensors) {
    const toml::table* e = node.as_table();
    if (!e) return bad("every [[tensor]] must be a table");
    CheckpointTensor ct;
    ct.name = (*e)["name"].value_or(std::string());
    if (ct.name.empty() || !names.insert(ct.name).second) return bad("a tensor without a name, or named twice: '" + ct.name + "'");
    const std::string what = "tensor '" + ct.name + "': ";
    const auto dt = parse_dtype((*e)["dtype"].value_or(std::string()));
    if (!dt) return bad(what + "unknown dtype");
    ct.dtype = *dt;
    const toml::array* shape = (*e)["shape"].as_array();
    const toml::array* placement = (*e)["placement"].as_array();
    const toml::array* files = (*e)["files"].as_array();
    if (!shape || !placement || !files) return bad(what + "needs shape, placement and files");
    for (const toml::node& d : *shape) {
      const auto v = d.value<int64_t>();
      if (!v || *v < 0) return bad(what + "shape must hold sizes >= 0");
      ct.shape.push_back(*v);
    }
    for (const toml::node& p : *placement) {
      auto pl = parse_placement(p.value_or(std::string()));
      if (!pl.ok()) return bad(what + pl.status().message());
      ct.placement.push_back(*pl);
    }
    if (Status s = check_sharding(ct.placement, c.mesh, TensorType{ct.dtype, shape_of(ct.shape)}); !s.ok())
      return bad(what + s.message());
    if (static_cast<int64_t>(files->size()) != c.mesh.num_ranks())
      return bad(what + std::to_string(files->size()) + " files for a mesh of " + std::to_string(c.mesh.num_ranks()) + " ranks");
    std::map<std::string, Tensor> loaded;
    for (int64_t r = 0; r < c.mesh.num_ranks(); ++r) {
      const std::string file = (*files)[static_cast<size_t>(r)].value_or(std::string());
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        return bad(what + "piece file '" + file + "' must be a plain file name in the checkpoint folder");
      if (!loaded.count(file)) {
        auto piece = read_npy((fs::path(dir) / file).string(), ct.dtype);
        if (!piece.ok()) return piece.status().with_context("checkpoint " + what);
        loaded.emplace(file, std::move(*piece));
      }
      KILN_RETURN_IF_ERROR(check_piece(ct, c.mesh, r, loaded.at(file)));
      ct.pieces.push_back(loaded.at(file));
    }
    c.tensors.push_back(std::move(ct));
  }
  return c;
}

StatusOr<std::map<std::string, Tensor>> logical_tensors(const Checkpoint& c) {
  std::map<std::string, Tensor> out;
  for (const CheckpointTensor& t : c.tensors) {
    auto whole = assemble(t.pieces, t.placement, c.mesh);
    if (!whole.ok()) return whole.status().with_context("checkpoint tensor '" + t.name + "'");
    out.emplace(t.name, std::move(*whole));
  }
  return out;
}

StatusOr<Checkpoint> reshard(const Checkpoint& c, const DeviceMesh& mesh) {
  KILN_RETURN_IF_ERROR(mesh.validate());
  Checkpoint out;
  out.mesh = mesh;
  for (const CheckpointTensor& t : c.tensors) {
    auto whole = assemble(t.pieces, t.placement, c.mesh);
    if (!whole.ok()) return whole.status().with_context("checkpoint tensor '" + t.name + "'");
    CheckpointTensor n{t.name, t.dtype, t.shape, Sharding(static_cast<size_t>(mesh.rank()), Placement::replicate()), {}};
    for (size_t a = 0; a < mesh.axes.size(); ++a) {
      const int from = c.mesh.axis_index(mesh.axes[a].name);
      if (from >= 0) n.placement[a] = t.placement[static_cast<size_t>(from)];
    }
    if (Status s = check_sharding(n.placement, mesh, TensorType{t.dtype, shape_of(t.shape)}); !s.ok())
      return invalid_argument("reshard: tensor '" + t.name + "' on mesh " + mesh.str() + ": " + s.message());
    KILN_ASSIGN_OR_RETURN(n.pieces, pieces_of(*whole, n.placement, mesh));
    out.tensors.push_back(std::move(n));
  }
  return out;
}

Status load_weights(Graph& g, const std::map<std::string, Tensor>& weights, std::vector<std::string>* missing) {
  std::set<std::string> used;
  for (Node* n : g.node_list()) {
    if (n->op_name() != "constant" || n->result()->name().empty()) continue;
    const auto it = weights.find(n->result()->name());
    if (it == weights.end()) {
      if (missing) missing->push_back(n->result()->name());
      continue;
    }
    const TensorType& want = n->result()->type();
    if (it->second.type() != want)
      return invalid_argument("weights: '" + it->first + "' is " + it->second.type().str() + ", the model's %" +
                              it->first + " is " + want.str());
    n->set_attr("value", Attribute(it->second));
    used.insert(it->first);
  }
  for (const auto& [name, t] : weights)
    if (!used.count(name))
      return invalid_argument("weights: '" + name + "' names no constant of @" + g.name() + " (a checkpoint of another model?)");
  return ok_status();
}

}  // namespace kiln::parallel
