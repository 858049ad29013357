// `kiln run` of a per-rank program (a graph over a device mesh, marked per_rank): whole inputs
// are cut into each rank's piece and the outputs put back together from every rank's piece.
// The reference backend runs every rank in this process (run_mesh); a CUDA backend runs one
// rank per process under a launcher (kiln launch, torchrun, srun, mpirun), NCCL carrying the
// collectives, and rank 0 prints or writes the outputs.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "cli.h"
#include "kiln/core/artifact.h"
#include "kiln/core/compile.h"
#include "kiln/distributed.h"
#include "kiln/ir/mesh_run.h"
#include "kiln/runtime.h"
#include "kiln/version.h"

namespace kiln::cli {

namespace {

/// One rank of a CUDA run: compile the program, load it as rank `info.rank`, run this rank's
/// piece, and gather every rank's outputs (returned on every rank; rank 0 prints them).
StatusOr<std::vector<std::vector<Tensor>>> run_rank(const Graph& g, const Pipeline& p,
                                                    const dist::LaunchInfo& info,
                                                    const std::vector<Tensor>& inputs,
                                                    double timeout_s) {
  Registry& reg = Registry::global();
  KILN_ASSIGN_OR_RETURN(const BackendInfo* be, reg.backend(p.backend.name));
  const std::string who = "backend '" + be->name + "'";
  // Symbols take the rank's own extents (a per-rank program's symbols are local).
  // A pipeline's rank runs only its own stage.
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Graph> bound, program_of_rank(g, info.rank));
  std::map<std::string, int64_t> symbols;
  for (int i = 0; i < g.num_inputs(); ++i)
    for (size_t d = 0; d < g.input(i)->shape().size(); ++d)
      if (const Dim& dim = g.input(i)->shape()[d]; !dim.is_static() && !dim.is_unknown())
        symbols.emplace(dim.symbol_name(), inputs[static_cast<size_t>(i)].shape()[d]);
  KILN_RETURN_IF_ERROR(bind_symbols(*bound, symbols, {}));
  std::vector<std::string> targets = p.targets;
  if (targets.empty() && p.backend.options.has("images"))
    targets = p.backend.options.get_strings("images");
  if (targets.empty()) targets = be->targets;
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, be->create(p.backend.options));
  ArtifactContents art;
  art.meta = {{"kiln_version", KILN_VERSION_STRING}, {"created_by", "kiln run"}};
  for (const std::string& t : targets)
    art.meta["targets"] += (art.meta["targets"].empty() ? "" : ",") + t;
  KILN_RETURN_IF_ERROR(backend->build_artifact(*bound, targets, art).with_context(who));
  const std::string bytes = serialize_artifact(art);

  LoadedModel l;
  std::string error;
  kiln_runtime_options ro;
  kiln_runtime_options_initialize(&ro);
  ro.device_ordinal = dist::launch_device(&error);
  if (ro.device_ordinal < 0) return invalid_argument(error);
  if (std::string e = take_status(kiln_runtime_create(&ro, &l.rt)); !e.empty())
    return failed_precondition(e);
  kiln_distributed_options o;
  kiln_distributed_options_initialize(&o);
  o.collective_timeout_s = timeout_s;
  if (std::string e = take_status(
          kiln_model_load_memory_distributed(l.rt, bytes.data(), bytes.size(), &o, &l.m));
      !e.empty())
    return failed_precondition(who + ": " + e);
  std::vector<kiln_host_tensor> in, out;
  for (const Tensor& t : inputs) in.push_back({const_cast<std::byte*>(t.data()), t.nbytes()});
  std::vector<Tensor> mine;
  for (const Value* v : bound->outputs()) mine.emplace_back(v->dtype(), static_sizes(v->shape()));
  for (Tensor& t : mine) out.push_back({t.mutable_data(), t.nbytes()});
  if (std::string e =
          take_status(kiln_model_run(l.m, in.data(), in.size(), out.data(), out.size()));
      !e.empty())
    return failed_precondition(who + ": " + e);
  // Every rank's pieces, through the model's world communicator.
  std::vector<std::vector<Tensor>> by_rank(static_cast<size_t>(info.world_size));
  for (const Tensor& t : mine) {
    std::string all(t.nbytes() * static_cast<size_t>(info.world_size), '\0');
    if (std::string e =
            take_status(kiln_model_all_gather_host(l.m, t.data(), t.nbytes(), all.data()));
        !e.empty())
      return failed_precondition(e);
    auto storage = std::make_shared<std::string>(std::move(all));
    for (int r = 0; r < info.world_size; ++r)
      by_rank[static_cast<size_t>(r)].push_back(Tensor::wrap(
          t.dtype(), t.shape(),
          reinterpret_cast<const std::byte*>(storage->data()) + r * t.nbytes(), storage));
  }
  return by_rank;
}

}  // namespace

// A failed collective leaves the device busy with aborted work: report it and exit at once (cli.h).
std::string take_status(kiln_status* st) {
  if (!st) return "";
  const std::string m = kiln_status_get_message(st);
  const bool collective = kiln_status_get_code(st) == KILN_STATUS_COLLECTIVE_FAILED;
  kiln_status_release(st);
  if (collective) {
    std::cout.flush();
    std::cerr << "kiln: error: " << m << "\n";
    std::cerr.flush();
    std::_Exit(kExitError);
  }
  return m;
}

int run_per_rank(const Graph& g, const Pipeline& p, const InputBindings& b,
                 const std::map<std::string, std::string>& files, double collective_timeout_s) {
  const DeviceMesh& mesh = g.mesh();
  const int64_t ranks = mesh.num_ranks();
  std::vector<std::string> notes;
  auto inputs = bind_inputs(g, b, &notes);  // whole inputs (interface_type)
  if (!inputs.ok()) return report(inputs.status());

  dist::LaunchInfo info;
  std::string error;
  const dist::LaunchFound launched = dist::find_launch(&info, &error);
  if (launched == dist::LaunchFound::kError) return report(invalid_argument(error));
  const bool one_of_many = launched == dist::LaunchFound::kFound && info.world_size > 1;
  if (p.backend.name == "reference") {
    // The interpreter runs the whole mesh, one thread per rank.
    if (one_of_many)
      return report(
          invalid_argument("backend 'reference' runs every rank of mesh " + mesh.str() +
                           " in one process: run it without a launcher, or use a cuda backend"));
    for (const auto& n : notes) note(n);
    auto outs = compile_and_run(g, p.backend, Registry::global(), *inputs);
    if (!outs.ok()) return report(outs.status());
    return print_outputs(g, *outs, files);
  }
  if (p.backend.name.rfind("cuda", 0) != 0)
    return report(invalid_argument(
        "backend '" + p.backend.name + "' cannot run a per-rank program (mesh " + mesh.str() +
        "): use reference (every rank in this process) or a cuda backend (one process per "
        "rank)"));
  if (!one_of_many && ranks > 1)
    return report(invalid_argument("graph '" + g.name() + "' is a per-rank program for " +
                                   std::to_string(ranks) + " ranks (mesh " + mesh.str() +
                                   "): start one process per rank, e.g. `kiln launch -n " +
                                   std::to_string(ranks) +
                                   " -- kiln run ...` on one host, or torchrun, srun or mpirun; or "
                                   "run every rank here with --backend reference"));
  if (launched != dist::LaunchFound::kFound) info = dist::LaunchInfo{};
  if (info.world_size != ranks)
    return report(invalid_argument("graph '" + g.name() + "' is a per-rank program for " +
                                   std::to_string(ranks) + " ranks (mesh " + mesh.str() +
                                   "), but " + info.launcher + " started " +
                                   std::to_string(info.world_size)));
  if (info.rank == 0)
    for (const auto& n : notes) note(n);
  auto pieces = split_inputs_by_rank(g, *inputs);
  if (!pieces.ok()) return report(pieces.status());
  auto by_rank =
      run_rank(g, p, info, (*pieces)[static_cast<size_t>(info.rank)], collective_timeout_s);
  if (!by_rank.ok())
    return report(by_rank.status().with_context("rank " + std::to_string(info.rank)));
  if (info.rank != 0) return kExitOk;  // rank 0 speaks for the run
  auto together = assemble_outputs(g, *by_rank);
  if (!together.ok()) return report(together.status());
  return print_outputs(g, *together, files);
}

}  // namespace kiln::cli
