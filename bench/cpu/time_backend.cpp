// Times one backend on one model in-process: import, passes and compile once, then runs.
//   time_backend PLUGIN_DIR MODEL BACKEND PASSES THREADS WARMUP ITERS INPUT.npy... -> JSON line
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kiln/core/driver.h"
#include "kiln/core/npy.h"
#include "kiln/core/pipeline.h"

int main(int argc, char** argv) {
  using namespace kiln;
  if (argc < 8) return std::fprintf(stderr, "usage: see the banner\n"), 2;
  const std::string model = argv[2], backend = argv[3], passes = argv[4];
  const int warmup = std::atoi(argv[6]), iters = std::atoi(argv[7]);
  auto fail = [](const Status& s) { std::fprintf(stderr, "error: %s\n", s.message().c_str()); return 1; };
  Registry& reg = Registry::global();
  if (Status s = load_plugins_from({argv[1]}, reg, false); !s.ok()) return fail(s);
  auto p = parse_pipeline_string("| " + passes + " | " + backend, reg);
  if (!p.ok()) return fail(p.status());
  if (Status s = resolve_pipeline_defaults(*p, reg, model); !s.ok()) return fail(s);
  if (backend == "cpu") p->backend.options.set("threads", int64_t{std::atoi(argv[5])});
  auto t0 = std::chrono::steady_clock::now();
  auto g = import_model(model, p->frontend, reg);
  if (!g.ok()) return fail(g.status());
  if (Status s = run_pipeline_passes(**g, *p, reg, {}); !s.ok()) return fail(s);
  std::vector<Tensor> ins;
  for (int i = 8; i < argc; ++i) {
    auto t = read_npy(argv[i]);
    if (!t.ok()) return fail(t.status());
    ins.push_back(*t);
  }
  auto info = reg.backend(backend);
  auto be = (*info)->create(p->backend.options);
  if (!be.ok()) return fail(be.status());
  auto exe = (*be)->compile(**g);
  if (!exe.ok()) return fail(exe.status());
  std::vector<double> ms;
  std::vector<Tensor> outs;
  double first = 0;
  for (int i = 0; i < warmup + iters; ++i) {
    auto a = std::chrono::steady_clock::now();
    auto r = (*exe)->run(ins);
    if (!r.ok()) return fail(r.status());
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
    if (i == 0) first = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= warmup) ms.push_back(t);
    outs = std::move(*r);
  }
  std::sort(ms.begin(), ms.end());
  if (std::getenv("TIME_BACKEND_OUT")) (void)write_npy(std::getenv("TIME_BACKEND_OUT"), outs[0]);
  std::printf("{\"median_ms\": %.3f, \"min_ms\": %.3f, \"first_ms\": %.3f, \"iters\": %zu}\n",
              ms[ms.size() / 2], ms.front(), first, ms.size());
  return 0;
}
