// Running a whole device mesh in one process: the reference interpreter runs every rank's
// program on a thread of its own, and collective ops meet through an in-process exchange. This
// is the oracle for parallel programs: a sharded run is checked against the unsharded graph.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <mutex>
#include <span>
#include <vector>

#include "kiln/ir/graph.h"
#include "kiln/ir/placement.h"
#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

class Interpreter;  // kiln/ir/interpreter.h

/// How the ranks of one in-process mesh run exchange tensors. Thread-safe. Every collective is
/// built on `exchange` (each member of a group contributes one tensor and receives all of
/// them, in group order) and point-to-point `send`/`recv`. When any rank fails, `abort` wakes
/// every waiting rank with that error, and a wait longer than the timeout fails instead of
/// hanging: a wrong program must never deadlock the test suite.
class MeshExchange {
 public:
  explicit MeshExchange(int64_t num_ranks, std::chrono::milliseconds timeout = std::chrono::seconds(60));

  /// Contributes `mine` for `rank` to the `seq`-th collective of `group` and returns every
  /// member's contribution in group order once all have arrived.
  StatusOr<std::vector<Tensor>> exchange(int64_t rank, const std::vector<int64_t>& group, int64_t seq, Tensor mine);
  /// Queues `t` for rank `to` under `tag`; never blocks.
  Status send(int64_t from, int64_t to, int64_t tag, Tensor t);
  /// Waits for the tensor `from` sent to `to` under `tag`.
  StatusOr<Tensor> recv(int64_t to, int64_t from, int64_t tag);
  /// Fails every pending and later wait with `why` (the first abort wins).
  void abort(Status why);
  /// The first abort's status (a rank's failure or a timeout); ok while none happened.
  Status first_error();

 private:
  struct Round {
    std::vector<Tensor> parts;
    int64_t arrived = 0, taken = 0;
  };
  Status wait(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready, const std::string& what);

  int64_t num_ranks_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<std::vector<int64_t>, int64_t>, Round> rounds_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<Tensor>> mailbox_;  // (from, to, tag)
  Status aborted_;
};

/// What the collective ops of a per-rank program see while the interpreter runs one rank.
struct MeshContext {
  const DeviceMesh* mesh = nullptr;
  int64_t rank = 0;
  MeshExchange* exchange = nullptr;
  /// How many collectives this rank has issued per group (the exchange's sequence numbers).
  std::map<std::vector<int64_t>, int64_t> issued;
};

/// Runs `programs[r]` (per-rank graphs over `mesh`) on `inputs[r]` for every rank r at once,
/// one thread per rank, and returns each rank's outputs. One program may serve every rank
/// (SPMD): pass it once. The first failing rank's error is returned, naming the rank.
StatusOr<std::vector<std::vector<Tensor>>> run_mesh(const DeviceMesh& mesh, std::span<const Graph* const> programs,
                                                    const std::vector<std::vector<Tensor>>& inputs,
                                                    std::chrono::milliseconds timeout = std::chrono::seconds(60));

/// run_mesh step after step: one interpreter per rank that lives as long as the runner, so each
/// rank's variables (a data-parallel training step's weights and optimizer state) persist from
/// one run to the next. The programs must outlive the runner. Not thread-safe.
class MeshRunner {
 public:
  MeshRunner(DeviceMesh mesh, std::vector<const Graph*> programs,
             std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~MeshRunner();

  /// Runs every rank r on inputs[r] at once; each rank's outputs. A rank that fails stops the
  /// others (its error names it); ranks that finished keep their new state.
  StatusOr<std::vector<std::vector<Tensor>>> run(const std::vector<std::vector<Tensor>>& inputs);
  /// Every variable as one whole tensor: the ranks' pieces put together by the variable's
  /// placement (a replicated variable must hold the same bits on every rank).
  StatusOr<std::map<std::string, Tensor>> read_state() const;
  /// Sets variables from whole tensors: each rank takes its piece.
  Status write_state(const std::map<std::string, Tensor>& whole);
  /// Rank r's interpreter, whose variables are that rank's.
  const Interpreter& rank(int64_t r) const { return *interps_[static_cast<size_t>(r)]; }

 private:
  const Graph& program(int64_t r) const { return *programs_[programs_.size() == 1 ? 0 : static_cast<size_t>(r)]; }

  DeviceMesh mesh_;
  std::vector<const Graph*> programs_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Interpreter>> interps_;
};

/// Every rank's piece of each whole input of per-rank program `g`: pieces[rank][input].
StatusOr<std::vector<std::vector<Tensor>>> split_inputs_by_rank(const Graph& g, std::span<const Tensor> whole);
/// Each output of per-rank program `g` put together from every rank's (by_rank[rank][output]):
/// shards joined, partial terms reduced, replicas checked to agree.
StatusOr<std::vector<Tensor>> assemble_outputs(const Graph& g, const std::vector<std::vector<Tensor>>& by_rank);

/// Rank `rank`'s piece of the global tensor `t` laid out as `s`: shard dims sliced; replicated
/// dims whole. Partial placements are refused (a caller's input is a whole value).
StatusOr<Tensor> local_piece(const Tensor& t, const Sharding& s, const DeviceMesh& mesh, int64_t rank);

/// The global tensor from every rank's piece laid out as `s`: shards concatenated, partial
/// terms reduced, replicas checked to agree (a replica that differs is an error).
StatusOr<Tensor> assemble(std::span<const Tensor> pieces, const Sharding& s, const DeviceMesh& mesh);

/// Block [begin, end) of `t` along `dim`; concatenation of `parts` along `dim`. Byte-sized
/// dtypes only (i4 is refused).
StatusOr<Tensor> slice_dim(const Tensor& t, int64_t dim, int64_t begin, int64_t end);
StatusOr<Tensor> concat_dim(std::span<const Tensor> parts, int64_t dim);

}  // namespace kiln
