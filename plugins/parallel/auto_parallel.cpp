// The `auto` strategy: the planner picks the mesh and the strategy (planner.h), prints its plan,
// and the chosen strategy rewrites the graph.
#include <iostream>

#include "kiln/plugin.h"
#include "planner.h"

namespace kiln::parallel {
namespace {

class AutoParallel final : public Pass {
 public:
  AutoParallel(PlannerOptions options, bool print) : options_(std::move(options)), print_(print) {}

  StatusOr<bool> run(Graph& g) override {
    KILN_ASSIGN_OR_RETURN(Plan plan, make_plan(g, options_));
    if (print_) std::cerr << format_plan(plan);
    // The plan was costed with every symbol bound; should the chosen split not apply to the
    // symbolic graph, take the next one rather than fail.
    Status first;
    for (const Candidate& c : plan.ranked) {
      std::unique_ptr<Graph> attempt = g.clone();
      Status s = apply_candidate(*attempt, c, options_);
      if (s.ok()) {
        if (!first.ok()) std::cerr << "auto: " << first.message() << "; applied " << c.strategy() << " instead\n";
        g.take_contents(*attempt);
        return true;
      }
      if (first.ok()) first = s.with_context("auto: the chosen " + c.strategy() + " does not apply to @" + g.name());
    }
    return first;
  }

 private:
  PlannerOptions options_;
  bool print_;
};

Status register_auto_parallel(Registry& r) {
  ParallelInfo info;
  info.name = "auto";
  info.version = "0.1.0";
  info.summary = "chooses the mesh and strategy for N devices with a cost model (throughput or memory)";
  info.options = planner_option_specs();
  info.create = [](const Options& o) -> StatusOr<std::unique_ptr<Pass>> {
    KILN_ASSIGN_OR_RETURN(PlannerOptions p, planner_options(o));
    return std::unique_ptr<Pass>(new AutoParallel(std::move(p), o.get_bool("print-plan")));
  };
  return r.add_parallel(std::move(info));
}

}  // namespace
}  // namespace kiln::parallel

KILN_PLUGIN("kiln-parallel-auto", "0.1.0", kiln::parallel::register_auto_parallel)
