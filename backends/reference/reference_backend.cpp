// The reference backend: "compiles" a graph by keeping a copy and runs it with the interpreter
// (a per-rank program: every rank of its mesh, in this process).
#include <memory>
#include <mutex>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/mesh_run.h"
#include "kiln/ir/verifier.h"
#include "kiln/plugin.h"

namespace {

/// Owns a private copy of the graph, so it outlives whatever the caller compiled from, and one
/// interpreter, whose variable state (variable/assign) persists from one run to the next.
class ReferenceExecutable final : public kiln::Executable {
 public:
  explicit ReferenceExecutable(std::unique_ptr<kiln::Graph> g) : graph_(std::move(g)) {}
  kiln::StatusOr<std::vector<kiln::Tensor>> run(std::span<const kiln::Tensor> inputs) override {
    std::lock_guard<std::mutex> lock(mu_);  // runs of one model are steps: one at a time
    return interp_.run(*graph_, inputs);
  }
  kiln::StatusOr<std::map<std::string, kiln::Tensor>> read_state() override {
    std::lock_guard<std::mutex> lock(mu_);
    return interp_.state_of(*graph_);
  }
  kiln::Status write_state(const std::map<std::string, kiln::Tensor>& values) override {
    std::lock_guard<std::mutex> lock(mu_);
    return interp_.set_state(*graph_, values);
  }

 private:
  std::unique_ptr<kiln::Graph> graph_;
  std::mutex mu_;
  kiln::Interpreter interp_;
};

/// A per-rank program: every rank of its mesh in this process (one interpreter per rank, so
/// each rank's variables persist), with the whole-tensor interface of the unsplit graph:
/// inputs are cut into the ranks' pieces, outputs and state put back together.
class MeshExecutable final : public kiln::Executable {
 public:
  explicit MeshExecutable(std::unique_ptr<kiln::Graph> g)
      : graph_(std::move(g)), runner_(graph_->mesh(), {graph_.get()}) {}
  kiln::StatusOr<std::vector<kiln::Tensor>> run(std::span<const kiln::Tensor> inputs) override {
    std::lock_guard<std::mutex> lock(mu_);
    KILN_ASSIGN_OR_RETURN(auto pieces, kiln::split_inputs_by_rank(*graph_, inputs));
    KILN_ASSIGN_OR_RETURN(auto outs, runner_.run(pieces));
    return kiln::assemble_outputs(*graph_, outs);
  }
  kiln::StatusOr<std::map<std::string, kiln::Tensor>> read_state() override {
    std::lock_guard<std::mutex> lock(mu_);
    return runner_.read_state();
  }
  kiln::Status write_state(const std::map<std::string, kiln::Tensor>& values) override {
    std::lock_guard<std::mutex> lock(mu_);
    return runner_.write_state(values);
  }

 private:
  std::unique_ptr<kiln::Graph> graph_;
  std::mutex mu_;
  kiln::MeshRunner runner_;
};

class ReferenceBackend final : public kiln::Backend {
 public:
  kiln::StatusOr<std::unique_ptr<kiln::Executable>> compile(const kiln::Graph& g) override {
    KILN_RETURN_IF_ERROR(kiln::verify(g).with_context("reference"));
    if (g.is_per_rank() && !g.mesh().empty())
      return std::unique_ptr<kiln::Executable>(std::make_unique<MeshExecutable>(g.clone()));
    return std::unique_ptr<kiln::Executable>(std::make_unique<ReferenceExecutable>(g.clone()));
  }
};

kiln::Status register_reference_backend(kiln::Registry& r) {
  kiln::BackendInfo info;
  info.name = "reference";
  info.version = "0.1.0";
  info.summary = "runs graphs on the CPU with the reference interpreter (the numeric oracle)";
  info.targets = {"cpu"};
  info.create = [](const kiln::Options&) -> kiln::StatusOr<std::unique_ptr<kiln::Backend>> {
    return std::unique_ptr<kiln::Backend>(std::make_unique<ReferenceBackend>());
  };
  return r.add_backend(std::move(info));
}

}  // namespace

KILN_PLUGIN("kiln-backend-reference", "0.1.0", register_reference_backend)
