// `kiln train`: runs a training pipeline's step (autodiff + optimizer) on batches read from .npy
// files, printing a progress line per step, with checkpoints of weights and optimizer state.
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "cli.h"
#include "kiln/core/checkpoint.h"
#include "kiln/core/driver.h"
#include "kiln/core/npy.h"
#include "kiln/distributed.h"
#include "kiln/ir/interpreter.h"

namespace kiln::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kStepKey = "train.step";

struct TrainFlags {
  PipelineRequest request;
  std::vector<std::string> plugin_paths;
  PassManagerOptions pm;
  std::string data_dir, checkpoint, resume, loss_file, loss_output = "loss";
  int64_t steps = 0, save_every = 0;
  std::optional<double> lr;
};

int64_t parse_int(const std::string& text, const std::string& what) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty())
    throw UsageError{what + " must be an integer, got '" + text + "'"};
  return v;
}

double parse_float(const std::string& text, const std::string& what) {
  double v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty() || !std::isfinite(v))
    throw UsageError{what + " must be a number, got '" + text + "'"};
  return v;
}

/// One graph input's batches: a stacked array (batch k is row k) or one file per step.
struct InputData {
  std::string name;
  Tensor stacked;                  ///< [count, ...input shape] when read from NAME.npy
  std::vector<std::string> files;  ///< NAME/0.npy, NAME/1.npy, ... otherwise
  int64_t count = 0;
};

StatusOr<InputData> find_data(const std::string& dir, const std::string& name, const TensorType& type) {
  InputData d{name, {}, {}, 0};
  const fs::path stacked = fs::path(dir) / (name + ".npy");
  std::error_code ec;
  if (fs::exists(stacked, ec)) {
    KILN_ASSIGN_OR_RETURN(d.stacked, read_npy(stacked.string(), type.dtype));
    if (d.stacked.rank() != type.rank() + 1)
      return invalid_argument(stacked.string() + ": a stacked batch file is [steps, ...] of " + type.str() + ", got " +
                              d.stacked.type().str());
    for (int64_t k = 0; k < type.rank(); ++k)
      if (type.shape[static_cast<size_t>(k)].is_static() &&
          type.shape[static_cast<size_t>(k)].value() != d.stacked.shape()[static_cast<size_t>(k + 1)])
        return invalid_argument(stacked.string() + ": a stacked batch file is [steps, ...] of " + type.str() + ", got " +
                                d.stacked.type().str());
    d.count = d.stacked.shape()[0];
    if (d.count == 0) return invalid_argument(stacked.string() + " holds no batch");
    return d;
  }
  for (int64_t k = 0;; ++k) {
    const fs::path f = fs::path(dir) / name / (std::to_string(k) + ".npy");
    if (!fs::exists(f, ec)) break;
    d.files.push_back(f.string());
  }
  d.count = static_cast<int64_t>(d.files.size());
  if (d.count == 0)
    return not_found("no data for input '" + name + "' (" + type.str() + "): expected " + stacked.string() + " or " +
                     (fs::path(dir) / name / "0.npy").string());
  return d;
}

/// Batch `step` of `d` (cycling when the data holds fewer batches than steps).
StatusOr<Tensor> batch(const InputData& d, int64_t step, DType dtype) {
  const int64_t k = step % d.count;
  if (!d.files.empty()) return read_npy(d.files[static_cast<size_t>(k)], dtype);
  std::vector<int64_t> shape(d.stacked.shape().begin() + 1, d.stacked.shape().end());
  Tensor t(d.stacked.dtype(), shape);
  const size_t bytes = t.nbytes();
  if (bytes > 0) std::memcpy(t.mutable_data(), d.stacked.data() + static_cast<size_t>(k) * bytes, bytes);
  return t;
}

/// Sets option `lr` of the optimizer pass (kiln train --lr).
Status override_lr(Pipeline& p, double lr) {
  for (StageSpec& s : p.passes)
    if (s.name == "optimizer") {
      s.options.set("lr", lr);
      return ok_status();
    }
  return invalid_argument("--lr: the pipeline has no 'optimizer' pass");
}

/// Where the ranks of a per-rank (data-parallel) step run: all in this process (the reference
/// backend simulates the mesh; whole batches in, whole outputs and state out), or one rank per
/// process under a launcher, each feeding its own slice of the batch.
struct Ranks {
  bool per_process = false;
  dist::LaunchInfo info;  ///< this process's rank when per_process
};

StatusOr<Ranks> find_ranks(const Graph& g, const std::string& backend) {
  Ranks r;
  if (!g.is_per_rank() || g.mesh().empty()) return r;
  std::string error;
  const dist::LaunchFound launched = dist::find_launch(&r.info, &error);
  if (launched == dist::LaunchFound::kError) return invalid_argument(error);
  if (backend == "reference") {
    // Every launched process would train every rank and write the same checkpoint.
    if (launched == dist::LaunchFound::kFound && r.info.world_size > 1)
      return invalid_argument("backend 'reference' runs every rank of mesh " + g.mesh().str() +
                              " in one process: run kiln train without a launcher, or use a cuda backend");
    return r;
  }
  if (launched != dist::LaunchFound::kFound) r.info = dist::LaunchInfo{};
  const int64_t ranks = g.mesh().num_ranks();
  if (r.info.world_size != ranks)
    return invalid_argument("the training step is a per-rank program for " + std::to_string(ranks) + " ranks (mesh " +
                            g.mesh().str() + "), but " +
                            (launched == dist::LaunchFound::kFound ? r.info.launcher + " started " + std::to_string(r.info.world_size)
                                                                   : std::string("no launcher started the ranks")) +
                            ": run `kiln launch -n " + std::to_string(ranks) +
                            " -- kiln train ...` (or torchrun, srun, mpirun), or every rank in this process with --backend reference");
  r.per_process = true;
  return r;
}

/// This rank's piece of every whole variable in `state` (resuming one rank of a launched run).
StatusOr<std::map<std::string, Tensor>> rank_state(const Graph& g, const std::map<std::string, Tensor>& state, int rank) {
  std::map<std::string, Tensor> mine;
  for (const auto& n : g.nodes()) {
    if (n->op_name() != "variable") continue;
    auto it = state.find(n->get_string("name"));
    if (it == state.end()) continue;
    KILN_ASSIGN_OR_RETURN(Tensor piece, local_piece(it->second, n->result()->sharding(), g.mesh(), rank));
    mine.emplace(it->first, std::move(piece));
  }
  return mine;
}

int train(const TrainFlags& f) {
  Registry& reg = Registry::global();
  if (Status s = load_plugins_from(f.plugin_paths, reg); !s.ok()) return report(s);
  Pipeline p;
  if (Status s = prepare_pipeline(f.request, reg, p); !s.ok()) return report(s);
  if (f.lr)
    if (Status s = override_lr(p, *f.lr); !s.ok()) return report(s);
  auto g = import_and_run_passes(f.request.model, p, reg, f.pm);
  if (!g.ok()) return report(g.status());
  const Graph& graph = **g;

  int loss_index = -1;
  std::string outputs;
  for (int i = 0; i < graph.num_outputs(); ++i) {
    if (graph_output_name(graph, i) == f.loss_output) loss_index = i;
    outputs += (i ? ", " : "") + graph_output_name(graph, i);
  }
  if (loss_index < 0)
    return report(not_found("the trained graph has no output '" + f.loss_output + "' (--loss); its outputs: " + outputs));
  bool has_state = false;
  for (const auto& n : graph.nodes()) has_state |= n->op_name() == "variable";
  if (!has_state)
    return report(invalid_argument("the graph keeps no state to train: add the 'autodiff' and 'optimizer' passes to the pipeline"));

  auto ranks = find_ranks(graph, p.backend.name);
  if (!ranks.ok()) return report(ranks.status());
  const bool speaks = !ranks->per_process || ranks->info.rank == 0;  // rank 0 prints and saves
  if (graph.is_per_rank() && !graph.mesh().empty() && speaks)
    note("data-parallel step over mesh " + graph.mesh().str() + ": " + std::to_string(graph.mesh().num_ranks()) + " ranks" +
         (ranks->per_process ? ", one per process" : ", all in this process"));

  std::vector<InputData> data;
  for (int i = 0; i < graph.num_inputs(); ++i) {
    auto d = find_data(f.data_dir, graph_input_name(graph, i), interface_type(graph, graph.input(i)));
    if (!d.ok()) return report(d.status());
    data.push_back(std::move(*d));
  }
  auto exe = compile_graph(graph, p.backend, reg);
  if (!exe.ok()) return report(exe.status());

  int64_t start = 0;
  if (!f.resume.empty()) {
    auto ckpt = read_checkpoint(f.resume);
    if (!ckpt.ok()) return report(ckpt.status());
    auto it = ckpt->find(kStepKey);
    if (it == ckpt->end()) return report(invalid_argument("checkpoint '" + f.resume + "' has no '" + kStepKey + "' entry"));
    start = it->second.get_i64(0);
    ckpt->erase(it);
    auto current = (*exe)->read_state();
    if (!current.ok()) return report(current.status());
    std::map<std::string, std::string> copy_of;
    for (const auto& n : graph.nodes())
      if (n->op_name() == "variable" && !state_copy_master(*n).empty()) copy_of[n->get_string("name")] = state_copy_master(*n);
    int refreshed = 0;
    for (const auto& [name, t] : *current) {
      if (ckpt->count(name)) continue;
      // A weight's low-precision copy is recomputed from the weight when the state is written
      // (a checkpoint saved without the optimizer's low-precision-copies has none).
      auto c = copy_of.find(name);
      if (c != copy_of.end() && ckpt->count(c->second)) {
        ++refreshed;
        continue;
      }
      return report(invalid_argument("checkpoint '" + f.resume + "' has no value for variable '" + name + "'"));
    }
    if (refreshed > 0 && speaks)
      note("checkpoint '" + f.resume + "' holds no low-precision copy of " + std::to_string(refreshed) +
           " weights: computed from the weights");
    if (ranks->per_process) {
      auto mine = rank_state(graph, *ckpt, ranks->info.rank);
      if (!mine.ok()) return report(mine.status().with_context("checkpoint '" + f.resume + "'"));
      *ckpt = std::move(*mine);
    }
    if (Status s = (*exe)->write_state(*ckpt); !s.ok()) return report(s.with_context("checkpoint '" + f.resume + "'"));
    if (speaks) note("resumed from '" + f.resume + "' at step " + std::to_string(start));
  }

  // Written once: by this process, or by rank 0 of a launched run, whose state is every
  // rank's (a variable split over the ranks cannot be saved from one of them).
  auto save = [&](int64_t done) -> Status {
    if (!speaks) return ok_status();
    if (ranks->per_process)
      for (const auto& n : graph.nodes())
        if (n->op_name() == "variable" && !is_replicated(n->result()->sharding()))
          return unimplemented("variable '" + n->get_string("name") + "' is split over the ranks (" +
                               sharding_str(n->result()->sharding()) +
                               "): checkpoints of a multi-process run hold replicated state only");
    KILN_ASSIGN_OR_RETURN(auto state, (*exe)->read_state());
    state[kStepKey] = Tensor::scalar_i64(DType::kI64, done);
    return write_checkpoint(f.checkpoint, state);
  };

  // Throughput unit: tokens for a model fed integer ids [B, T], samples (dim 0) otherwise.
  int64_t tokens = 0, samples = 0;
  for (int i = 0; i < graph.num_inputs(); ++i) {
    const TensorType t = interface_type(graph, graph.input(i));
    if (is_integer(t.dtype) && t.rank() == 2 && tokens == 0) tokens = num_elements(t.shape);
    if (samples == 0 && t.rank() >= 1 && t.shape[0].is_static()) samples = t.shape[0].value();
  }
  std::vector<double> losses;
  for (int64_t step = start; step < f.steps; ++step) {
    std::vector<Tensor> inputs;
    for (int i = 0; i < graph.num_inputs(); ++i) {
      auto t = batch(data[static_cast<size_t>(i)], step, graph.input(i)->dtype());
      if (!t.ok()) return report(t.status());
      inputs.push_back(std::move(*t));
    }
    if (ranks->per_process) {  // this rank's slice of the batch
      auto pieces = split_inputs_by_rank(graph, inputs);
      if (!pieces.ok()) return report(pieces.status());
      inputs = std::move((*pieces)[static_cast<size_t>(ranks->info.rank)]);
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto outs = (*exe)->run(inputs);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!outs.ok()) return report(outs.status().with_context("step " + std::to_string(step + 1)));
    const double loss = (*outs)[static_cast<size_t>(loss_index)].get_f64(0);
    losses.push_back(loss);
    if (!std::isfinite(loss)) return report(invalid_argument("step " + std::to_string(step + 1) + ": the loss is not finite"));
    if (!speaks) continue;
    const double rate = static_cast<double>(tokens ? tokens : samples) / std::max(seconds, 1e-9);
    std::printf("step %lld/%lld  loss %.6f  time %.2f ms  %.0f %s/s\n", static_cast<long long>(step + 1),
                static_cast<long long>(f.steps), loss, seconds * 1e3, rate, tokens ? "tokens" : "samples");
    std::fflush(stdout);
    if (!f.checkpoint.empty() && f.save_every > 0 && (step + 1) % f.save_every == 0 && step + 1 < f.steps)
      if (Status s = save(step + 1); !s.ok()) return report(s);
  }
  if (!f.checkpoint.empty())
    if (Status s = save(std::max(start, f.steps)); !s.ok()) return report(s);
  if (!f.loss_file.empty() && speaks) {
    Tensor t = Tensor::from_f64(DType::kF64, {static_cast<int64_t>(losses.size())}, losses);
    if (Status s = write_npy(f.loss_file, t); !s.ok()) return report(s);
  }
  return kExitOk;
}

}  // namespace

std::string train_usage() {
  return R"(usage: kiln train MODEL --pipeline P.toml --data DIR --steps N [options]

Run training steps: the pipeline's passes (autodiff, optimizer, then any others) turn the
model's forward graph and loss into one step whose weights and optimizer state live in the
graph's variables; each step reads its batch, runs, and prints
  step K/N  loss L  time T ms  R tokens/s   (samples/s unless an input is i[B, T] token ids)

With a data-parallel [parallel] section each batch is split over the mesh's ranks (the loss
printed is the whole batch's): on backend reference every rank runs in this process; on a CUDA
backend start one process per rank, `kiln launch -n N -- kiln train ...` (or torchrun, srun,
mpirun), rank 0 printing and saving (docs/training.md, "Data-parallel training").

  --data DIR            batches: DIR/NAME.npy holds every step's batch of input NAME stacked
                        ([count, ...], step k uses row k mod count), or DIR/NAME/0.npy,
                        DIR/NAME/1.npy, ... one file per step (cycled the same way)
  --steps N             train until N steps are done (counting those of a resumed checkpoint)
  --lr X                learning rate (overrides the optimizer pass's option 'lr')
  --loss NAME           the output printed as the loss (default: loss)
  --checkpoint FILE     save weights, optimizer state and the step count here at the end
  --save-every K        ... and every K steps
  --resume FILE         start from a checkpoint (a corrupt file is an error)
  --loss-file FILE.npy  write every step's loss (f64) there
  --backend NAME        run with this backend (default: the pipeline's, else reference)
)" + usage_text("opt").substr(usage_text("opt").find("\npipeline:"));
}

int cmd_train(Args& args) {
  TrainFlags f;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!f.request.model.empty()) throw UsageError{"train: more than one model ('" + f.request.model + "', '" + args.positional() + "')"};
      f.request.model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (flag == "--pipeline") f.request.pipeline_file = args.value(flag);
    else if (flag == "--passes") f.request.passes = args.value(flag);
    else if (flag == "--frontend") f.request.frontend = args.value(flag);
    else if (flag == "--backend") f.request.backend = args.value(flag);
    else if (flag == "--plugin-path") f.plugin_paths.push_back(args.value(flag));
    else if (pass_manager_flag(flag, args, f.pm)) continue;
    else if (flag == "--data") f.data_dir = args.value(flag);
    else if (flag == "--steps") f.steps = parse_int(args.value(flag), "--steps");
    else if (flag == "--save-every") f.save_every = parse_int(args.value(flag), "--save-every");
    else if (flag == "--lr") f.lr = parse_float(args.value(flag), "--lr");
    else if (flag == "--loss") f.loss_output = args.value(flag);
    else if (flag == "--checkpoint") f.checkpoint = args.value(flag);
    else if (flag == "--resume") f.resume = args.value(flag);
    else if (flag == "--loss-file") f.loss_file = args.value(flag);
    else args.unknown(flag);
  }
  if (f.request.model.empty()) throw UsageError{"train: no model given"};
  if (!f.request.pipeline_file.empty() && f.request.passes) throw UsageError{"train: give --pipeline or --passes, not both"};
  if (f.data_dir.empty()) throw UsageError{"train: --data DIR is required"};
  if (f.steps < 1) throw UsageError{"train: --steps must be at least 1"};
  if (f.save_every < 0) throw UsageError{"train: --save-every must be >= 0"};
  if (f.lr && *f.lr < 0) throw UsageError{"train: --lr must be >= 0"};
  return train(f);
}

}  // namespace kiln::cli
