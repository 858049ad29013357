// Running a whole device mesh in one process: the exchange, per-rank threads, and moving
// tensors between their global and per-rank forms.
#include "kiln/ir/mesh_run.h"

#include <cstring>
#include <thread>

#include "kiln/ir/interpreter.h"

namespace kiln {

// ---- MeshExchange --------------------------------------------------------------------------

MeshExchange::MeshExchange(int64_t num_ranks, std::chrono::milliseconds timeout)
    : num_ranks_(num_ranks), timeout_(timeout) {}

Status MeshExchange::wait(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready,
                          const std::string& what) {
  const bool done = cv_.wait_for(lock, timeout_, [&] { return !aborted_.ok() || ready(); });
  if (!aborted_.ok()) return aborted_;
  if (!done) {
    aborted_ = failed_precondition(what + " waited " + std::to_string(timeout_.count()) +
                                 " ms for the other ranks (a collective not reached by every rank of its group?)");
    cv_.notify_all();
    return aborted_;
  }
  return ok_status();
}

StatusOr<std::vector<Tensor>> MeshExchange::exchange(int64_t rank, const std::vector<int64_t>& group, int64_t seq,
                                                     Tensor mine) {
  int64_t pos = -1;
  for (size_t i = 0; i < group.size(); ++i)
    if (group[i] == rank) pos = static_cast<int64_t>(i);
  if (pos < 0) return internal_error("rank " + std::to_string(rank) + " is not in the collective's group");
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_pair(group, seq);
  Round& round = rounds_[key];
  if (round.parts.empty()) round.parts.resize(group.size());
  round.parts[static_cast<size_t>(pos)] = std::move(mine);
  ++round.arrived;
  cv_.notify_all();
  const auto size = static_cast<int64_t>(group.size());
  KILN_RETURN_IF_ERROR(wait(lock, [&] { return round.arrived == size; },
                            "rank " + std::to_string(rank) + ": collective #" + std::to_string(seq)));
  std::vector<Tensor> all = round.parts;
  if (++round.taken == size) rounds_.erase(key);
  return all;
}

Status MeshExchange::send(int64_t from, int64_t to, int64_t tag, Tensor t) {
  if (to < 0 || to >= num_ranks_) return invalid_argument("send to rank " + std::to_string(to) + " outside the mesh");
  std::lock_guard<std::mutex> lock(mu_);
  mailbox_[{from, to, tag}].push_back(std::move(t));
  cv_.notify_all();
  return ok_status();
}

StatusOr<Tensor> MeshExchange::recv(int64_t to, int64_t from, int64_t tag) {
  if (from < 0 || from >= num_ranks_) return invalid_argument("recv from rank " + std::to_string(from) + " outside the mesh");
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_tuple(from, to, tag);
  KILN_RETURN_IF_ERROR(wait(lock, [&] { return !mailbox_[key].empty(); },
                            "rank " + std::to_string(to) + ": recv from rank " + std::to_string(from)));
  Tensor t = std::move(mailbox_[key].front());
  mailbox_[key].erase(mailbox_[key].begin());
  return t;
}

Status MeshExchange::first_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return aborted_;
}

void MeshExchange::abort(Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.ok()) aborted_ = std::move(why);
  cv_.notify_all();
}

// ---- run_mesh and MeshRunner ------------------------------------------------------------------

StatusOr<std::vector<std::vector<Tensor>>> run_mesh(const DeviceMesh& mesh, std::span<const Graph* const> programs,
                                                    const std::vector<std::vector<Tensor>>& inputs,
                                                    std::chrono::milliseconds timeout) {
  MeshRunner runner(mesh, {programs.begin(), programs.end()}, timeout);
  return runner.run(inputs);
}

MeshRunner::MeshRunner(DeviceMesh mesh, std::vector<const Graph*> programs, std::chrono::milliseconds timeout)
    : mesh_(std::move(mesh)), programs_(std::move(programs)), timeout_(timeout) {
  for (int64_t r = 0; r < mesh_.num_ranks(); ++r) interps_.push_back(std::make_unique<Interpreter>());
}

MeshRunner::~MeshRunner() = default;

StatusOr<std::vector<std::vector<Tensor>>> MeshRunner::run(const std::vector<std::vector<Tensor>>& inputs) {
  const int64_t n = mesh_.num_ranks();
  if (programs_.size() != 1 && static_cast<int64_t>(programs_.size()) != n)
    return invalid_argument("run_mesh: " + std::to_string(programs_.size()) + " programs for " + std::to_string(n) +
                            " ranks (give one, or one per rank)");
  if (static_cast<int64_t>(inputs.size()) != n)
    return invalid_argument("run_mesh: inputs for " + std::to_string(inputs.size()) + " ranks, the mesh has " +
                            std::to_string(n));
  MeshExchange exchange(n, timeout_);
  std::vector<StatusOr<std::vector<Tensor>>> results(static_cast<size_t>(n), std::vector<Tensor>{});
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      MeshContext ctx{&mesh_, r, &exchange, {}};
      Interpreter& interp = *interps_[static_cast<size_t>(r)];
      interp.set_mesh_context(&ctx);
      auto out = interp.run(program(r), inputs[static_cast<size_t>(r)]);
      interp.set_mesh_context(nullptr);
      if (!out.ok()) {
        out = out.status().with_context("rank " + std::to_string(r));
        exchange.abort(out.status());
      }
      results[static_cast<size_t>(r)] = std::move(out);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<std::vector<Tensor>> outs;
  for (auto& r : results) {
    // The first failure (or the timeout) aborted the others: report it, not their echoes.
    if (!r.ok()) return exchange.first_error();
    outs.push_back(std::move(*r));
  }
  return outs;
}

namespace {

/// The placement of each top-level variable of `g`, by name.
std::map<std::string, const Value*> variables_of(const Graph& g) {
  std::map<std::string, const Value*> vars;
  for (const auto& node : g.nodes())
    if (node->op_name() == "variable") vars[node->get_string("name")] = node->result();
  return vars;
}

}  // namespace

StatusOr<std::map<std::string, Tensor>> MeshRunner::read_state() const {
  std::vector<std::map<std::string, Tensor>> by_rank;
  for (int64_t r = 0; r < mesh_.num_ranks(); ++r) by_rank.push_back(interps_[static_cast<size_t>(r)]->state_of(program(r)));
  std::map<std::string, Tensor> whole;
  for (const auto& [name, v] : variables_of(program(0))) {
    std::vector<Tensor> pieces;
    for (int64_t r = 0; r < mesh_.num_ranks(); ++r) {
      auto it = by_rank[static_cast<size_t>(r)].find(name);
      if (it == by_rank[static_cast<size_t>(r)].end())
        return failed_precondition("variable '" + name + "' is missing on rank " + std::to_string(r));
      pieces.push_back(it->second);
    }
    auto t = assemble(pieces, v->sharding(), mesh_);
    if (!t.ok()) return t.status().with_context("variable '" + name + "'");
    whole.emplace(name, std::move(*t));
  }
  return whole;
}

Status MeshRunner::write_state(const std::map<std::string, Tensor>& whole) {
  std::vector<std::map<std::string, Tensor>> by_rank(static_cast<size_t>(mesh_.num_ranks()));
  for (int64_t r = 0; r < mesh_.num_ranks(); ++r) {
    const auto vars = variables_of(program(r));
    for (const auto& [name, t] : whole) {
      auto it = vars.find(name);
      if (it == vars.end()) return not_found("graph @" + program(r).name() + " has no variable '" + name + "'");
      auto piece = local_piece(t, it->second->sharding(), mesh_, r);
      if (!piece.ok()) return piece.status().with_context("variable '" + name + "'");
      by_rank[static_cast<size_t>(r)].emplace(name, std::move(*piece));
    }
  }
  // Checked on every rank before any changes, so a bad value leaves the state as it was.
  for (int64_t r = 0; r < mesh_.num_ranks(); ++r) {
    Interpreter probe;
    KILN_RETURN_IF_ERROR(probe.set_state(program(r), by_rank[static_cast<size_t>(r)]));
  }
  for (int64_t r = 0; r < mesh_.num_ranks(); ++r)
    KILN_RETURN_IF_ERROR(interps_[static_cast<size_t>(r)]->set_state(program(r), by_rank[static_cast<size_t>(r)]));
  return ok_status();
}

StatusOr<std::vector<std::vector<Tensor>>> split_inputs_by_rank(const Graph& g, std::span<const Tensor> whole) {
  const DeviceMesh& mesh = g.mesh();
  if (static_cast<int>(whole.size()) != g.num_inputs())
    return invalid_argument("graph @" + g.name() + " takes " + std::to_string(g.num_inputs()) + " inputs, got " +
                            std::to_string(whole.size()));
  std::vector<std::vector<Tensor>> pieces(static_cast<size_t>(mesh.num_ranks()));
  for (int64_t r = 0; r < mesh.num_ranks(); ++r)
    for (int i = 0; i < g.num_inputs(); ++i) {
      auto piece = local_piece(whole[static_cast<size_t>(i)], g.input(i)->sharding(), mesh, r);
      if (!piece.ok()) return piece.status().with_context("input '" + g.input(i)->name() + "'");
      pieces[static_cast<size_t>(r)].push_back(std::move(*piece));
    }
  return pieces;
}

StatusOr<std::vector<Tensor>> assemble_outputs(const Graph& g, const std::vector<std::vector<Tensor>>& by_rank) {
  std::vector<Tensor> whole;
  for (int i = 0; i < g.num_outputs(); ++i) {
    std::vector<Tensor> pieces;
    for (const auto& rank_outs : by_rank) pieces.push_back(rank_outs[static_cast<size_t>(i)]);
    auto t = assemble(pieces, g.output(i)->sharding(), g.mesh());
    if (!t.ok()) return t.status().with_context("output '" + g.output_name(i) + "'");
    whole.push_back(std::move(*t));
  }
  return whole;
}

// ---- global and per-rank tensors -----------------------------------------------------------

StatusOr<Tensor> slice_dim(const Tensor& t, int64_t dim, int64_t begin, int64_t end) {
  if (dtype_bits(t.dtype()) < 8) return unimplemented("slicing " + std::string(dtype_name(t.dtype())) + " tensors");
  if (dim < 0 || dim >= t.rank() || begin < 0 || end > t.shape()[static_cast<size_t>(dim)] || begin > end)
    return out_of_range("slice [" + std::to_string(begin) + ", " + std::to_string(end) + ") of dim " +
                        std::to_string(dim) + " of " + t.type().str());
  std::vector<int64_t> shape = t.shape();
  const int64_t extent = shape[static_cast<size_t>(dim)];
  shape[static_cast<size_t>(dim)] = end - begin;
  Tensor out(t.dtype(), shape);
  int64_t outer = 1, inner = static_cast<int64_t>(dtype_bits(t.dtype()) / 8);
  for (int64_t d = 0; d < dim; ++d) outer *= t.shape()[static_cast<size_t>(d)];
  for (int64_t d = dim + 1; d < t.rank(); ++d) inner *= t.shape()[static_cast<size_t>(d)];
  const auto row = static_cast<size_t>((end - begin) * inner);
  for (int64_t o = 0; o < outer; ++o)
    if (row) std::memcpy(out.mutable_data() + o * (end - begin) * inner, t.data() + (o * extent + begin) * inner, row);
  return out;
}

StatusOr<Tensor> concat_dim(std::span<const Tensor> parts, int64_t dim) {
  if (parts.empty()) return invalid_argument("concat of no tensors");
  const Tensor& first = parts[0];
  if (dtype_bits(first.dtype()) < 8) return unimplemented("concatenating " + std::string(dtype_name(first.dtype())) + " tensors");
  if (dim < 0 || dim >= first.rank()) return out_of_range("concat dim " + std::to_string(dim) + " of " + first.type().str());
  std::vector<int64_t> shape = first.shape();
  shape[static_cast<size_t>(dim)] = 0;
  for (const Tensor& p : parts) {
    std::vector<int64_t> a = p.shape(), b = first.shape();
    if (p.dtype() != first.dtype() || a.size() != b.size())
      return invalid_argument("concat of " + p.type().str() + " and " + first.type().str());
    a[static_cast<size_t>(dim)] = b[static_cast<size_t>(dim)] = 0;
    if (a != b) return invalid_argument("concat of " + p.type().str() + " and " + first.type().str());
    shape[static_cast<size_t>(dim)] += p.shape()[static_cast<size_t>(dim)];
  }
  Tensor out(first.dtype(), shape);
  int64_t outer = 1, inner = static_cast<int64_t>(dtype_bits(first.dtype()) / 8);
  for (int64_t d = 0; d < dim; ++d) outer *= shape[static_cast<size_t>(d)];
  for (int64_t d = dim + 1; d < first.rank(); ++d) inner *= shape[static_cast<size_t>(d)];
  const int64_t total = shape[static_cast<size_t>(dim)];
  int64_t at = 0;
  for (const Tensor& p : parts) {
    const int64_t e = p.shape()[static_cast<size_t>(dim)];
    const auto row = static_cast<size_t>(e * inner);
    for (int64_t o = 0; o < outer; ++o)
      if (row) std::memcpy(out.mutable_data() + (o * total + at) * inner, p.data() + o * e * inner, row);
    at += e;
  }
  return out;
}

StatusOr<Tensor> local_piece(const Tensor& t, const Sharding& s, const DeviceMesh& mesh, int64_t rank) {
  for (const Placement& p : s)
    if (p.is_partial()) return invalid_argument("placement " + sharding_str(s) +
                                               " is partial: its whole value is a reduction of the ranks' pieces, which cannot be cut from it");
  KILN_RETURN_IF_ERROR(check_sharding(s, mesh, t.type()));
  Tensor piece = t;
  const auto ranges = local_ranges(t.shape(), s, mesh, rank);
  for (size_t d = 0; d < ranges.size(); ++d)
    if (ranges[d].first != 0 || ranges[d].second != t.shape()[d]) {
      KILN_ASSIGN_OR_RETURN(piece, slice_dim(piece, static_cast<int64_t>(d), ranges[d].first, ranges[d].second));
    }
  return piece;
}

namespace {

/// Elementwise reduction of equally shaped tensors in the given order, in f64, rounded once.
Tensor reduce_terms(std::span<const Tensor> terms, ReduceOp op) {
  Tensor out(terms[0].dtype(), terms[0].shape());
  for (int64_t i = 0; i < out.numel(); ++i) {
    double acc = terms[0].get_f64(i);
    for (size_t k = 1; k < terms.size(); ++k) {
      const double v = terms[k].get_f64(i);
      acc = op == ReduceOp::kSum ? acc + v : (v > acc || v != v ? v : acc);
    }
    out.set_f64(i, acc);
  }
  return out;
}

}  // namespace

StatusOr<Tensor> assemble(std::span<const Tensor> pieces, const Sharding& s, const DeviceMesh& mesh) {
  const int64_t n = mesh.num_ranks();
  if (static_cast<int64_t>(pieces.size()) != n)
    return invalid_argument("assemble: " + std::to_string(pieces.size()) + " pieces for " + std::to_string(n) + " ranks");
  if (s.empty()) {
    for (int64_t r = 1; r < n; ++r)
      if (!pieces[static_cast<size_t>(r)].identical(pieces[0]))
        return failed_precondition("replicated value differs between rank 0 and rank " + std::to_string(r));
    return pieces[0];
  }
  // Fold the mesh one axis at a time, last axis first: along a shard axis concatenate the
  // group's pieces, along a partial axis reduce them, along a replicate axis check they agree.
  std::vector<Tensor> level(pieces.begin(), pieces.end());
  std::vector<int64_t> sizes;
  for (const auto& a : mesh.axes) sizes.push_back(a.size);
  for (int a = mesh.rank() - 1; a >= 0; --a) {
    const int64_t k = sizes[static_cast<size_t>(a)];
    std::vector<Tensor> next;
    for (size_t base = 0; base < level.size(); base += static_cast<size_t>(k)) {
      std::span<const Tensor> group(level.data() + base, static_cast<size_t>(k));
      const Placement& p = s[static_cast<size_t>(a)];
      if (p.is_shard()) {
        KILN_ASSIGN_OR_RETURN(Tensor joined, concat_dim(group, p.dim));
        next.push_back(std::move(joined));
      } else if (p.is_partial()) {
        next.push_back(reduce_terms(group, p.reduce));
      } else {
        for (int64_t i = 1; i < k; ++i)
          if (!group[static_cast<size_t>(i)].identical(group[0]))
            return failed_precondition("value replicated over mesh axis '" + mesh.axes[static_cast<size_t>(a)].name +
                                       "' differs between its ranks");
        next.push_back(group[0]);
      }
    }
    level = std::move(next);
  }
  return level[0];
}

}  // namespace kiln
