// `kiln checkpoint`: save a model's weights by logical tensor with the placements a parallel
// strategy gives them, print a checkpoint, or reshard it for another mesh (checkpoint.h).
#include <iostream>

#include "checkpoint.h"
#include "cli.h"
#include "partition.h"

namespace kiln::cli {

namespace {

/// Fills the first empty slot with the next positional argument.
void take_positional(Args& args, std::initializer_list<std::string*> slots, const std::string& who) {
  for (std::string* s : slots)
    if (s->empty()) {
      *s = args.positional();
      return;
    }
  throw UsageError{who + ": too many arguments ('" + args.positional() + "')"};
}

constexpr std::string_view kCheckpoint = R"(usage: kiln checkpoint save MODEL OUT [--pipeline FILE.toml | --passes LIST] [--sym NAME=SIZE]...
       kiln checkpoint reshard IN OUT --mesh MESH
       kiln checkpoint info IN

A checkpoint is a folder: checkpoint.toml (the mesh; per tensor its name, dtype, whole shape,
placement and one .npy file per rank) and the .npy pieces. It loads into a model of the same
shapes on any mesh: `kiln run MODEL --weights DIR --pipeline P.toml` (docs/parallel.md).

  save      run MODEL's passes (usually with a parallel strategy) and write its named constants,
            each rank's piece under the placement the strategy gave it
  reshard   lay IN out over MESH (e.g. "tp=4"): placements kept on the axes MESH shares with
            IN's mesh by name, replicated on the others
  info      print the mesh and every tensor's dtype, shape and placement

  --pipeline FILE.toml, --passes LIST   the passes save runs (default "canonicalize,cse")
  --sym NAME=SIZE                       size of a symbolic dim; repeatable
  --mesh MESH                           reshard's target mesh
  --plugin-path DIR                     also load the plugins in DIR; repeatable
)";

int save(Args& args) {
  std::string model, out, pipeline_file, passes = "canonicalize,cse";
  std::vector<std::string> plugin_paths;
  std::map<std::string, int64_t> symbols;
  while (!args.done()) {
    if (!args.at_option()) {
      take_positional(args, {&model, &out}, "checkpoint save");
      continue;
    }
    const std::string flag = args.option();
    if (flag == "--pipeline") pipeline_file = args.value(flag);
    else if (flag == "--passes") passes = args.value(flag);
    else if (flag == "--plugin-path") plugin_paths.push_back(args.value(flag));
    else if (flag == "--sym") {
      const std::string v = args.value(flag);
      const size_t eq = v.find('=');
      if (eq == 0 || eq == std::string::npos) throw UsageError{"--sym expects NAME=SIZE, got '" + v + "'"};
      try {
        symbols[v.substr(0, eq)] = std::stoll(v.substr(eq + 1));
      } catch (const std::exception&) {
        throw UsageError{"--sym expects NAME=SIZE, got '" + v + "'"};
      }
    } else {
      args.unknown(flag);
    }
  }
  if (out.empty()) throw UsageError{"checkpoint save: expected MODEL and OUT"};
  auto g = prepare_model(model, pipeline_file, passes, symbols, plugin_paths, /*before_strategy=*/false);
  if (!g.ok()) return report(g.status());
  auto c = parallel::checkpoint_from_program(**g);
  if (!c.ok()) return report(c.status());
  if (c->tensors.empty()) return report(invalid_argument("checkpoint save: @" + (*g)->name() + " has no named constants"));
  if (Status s = parallel::write_checkpoint(out, *c); !s.ok()) return report(s);
  std::cerr << "wrote " << c->tensors.size() << " tensors over mesh " << c->mesh.str() << " to " << out << "\n";
  return kExitOk;
}

int reshard_cmd(Args& args) {
  std::string in, out, mesh_text;
  while (!args.done()) {
    if (!args.at_option()) {
      take_positional(args, {&in, &out}, "checkpoint reshard");
      continue;
    }
    const std::string flag = args.option();
    if (flag == "--mesh") mesh_text = args.value(flag);
    else args.unknown(flag);
  }
  if (out.empty() || mesh_text.empty()) throw UsageError{"checkpoint reshard: expected IN OUT --mesh MESH"};
  auto mesh = parallel::parse_mesh_option(mesh_text);
  if (!mesh.ok()) return report(mesh.status());
  auto c = parallel::read_checkpoint(in);
  if (!c.ok()) return report(c.status());
  auto r = parallel::reshard(*c, *mesh);
  if (!r.ok()) return report(r.status());
  if (Status s = parallel::write_checkpoint(out, *r); !s.ok()) return report(s);
  std::cerr << "resharded " << r->tensors.size() << " tensors from mesh " << c->mesh.str() << " to " << mesh->str() << "\n";
  return kExitOk;
}

int info(Args& args) {
  std::string in;
  while (!args.done()) {
    if (args.at_option()) args.unknown(args.option());
    take_positional(args, {&in}, "checkpoint info");
  }
  if (in.empty()) throw UsageError{"checkpoint info: expected a checkpoint folder"};
  auto c = parallel::read_checkpoint(in);
  if (!c.ok()) return report(c.status());
  std::cout << "mesh " << c->mesh.str() << ", " << c->tensors.size() << " tensors\n";
  for (const auto& t : c->tensors)
    std::cout << "  " << t.name << ": " << TensorType{t.dtype, shape_of(t.shape)}.str() << sharding_str(t.placement)
              << ", rank 0 holds " << t.pieces[0].type().str() << "\n";
  return kExitOk;
}

}  // namespace

std::string checkpoint_usage() { return std::string(kCheckpoint); }

int cmd_checkpoint(Args& args) {
  if (args.done()) throw UsageError{"checkpoint: expected save, reshard or info"};
  const std::string verb = args.positional();
  if (verb == "save") return save(args);
  if (verb == "reshard") return reshard_cmd(args);
  if (verb == "info") return info(args);
  throw UsageError{"checkpoint: unknown action '" + verb + "' (expected save, reshard or info)"};
}

/// Reads checkpoint folder `dir` and gives its tensors, whole, to `g`'s constants.
Status load_checkpoint_weights(Graph& g, const std::string& dir) {
  KILN_ASSIGN_OR_RETURN(parallel::Checkpoint c, parallel::read_checkpoint(dir));
  KILN_ASSIGN_OR_RETURN(auto weights, parallel::logical_tensors(c));
  std::vector<std::string> missing;
  KILN_RETURN_IF_ERROR(parallel::load_weights(g, weights, &missing));
  if (!missing.empty()) {
    std::string names;
    for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
    note("--weights: " + std::to_string(missing.size()) + " constants keep the model's values: " + names);
  }
  return ok_status();
}

}  // namespace kiln::cli
