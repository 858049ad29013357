// GPU test helper: load a serialized .kiln artifact through the runtime's C API and run it.
#pragma once

#include <string>
#include <vector>

#include "kiln/ir/tensor.h"
#include "kiln/runtime.h"

namespace kiln {

struct ArtifactRun {
  bool cuda_graphs = true;
  int runs = 1;  ///< a second run replays the captured graph
  std::vector<std::string>* problems = nullptr;  ///< receives the non-empty step descriptors
};

/// Loads `bytes` and runs it `how.runs` times on `inputs` into `outputs`; "" or why it failed.
inline std::string run_artifact(const std::string& bytes, const std::vector<Tensor>& inputs,
                                std::vector<Tensor>& outputs, const ArtifactRun& how = {}) {
  kiln_runtime_options o;
  kiln_runtime_options_initialize(&o);
  o.use_cuda_graphs = how.cuda_graphs ? 1 : 0;
  kiln_runtime* rt = nullptr;
  kiln_model* model = nullptr;
  std::string why;
  auto check = [&](kiln_status* st) {
    if (st && why.empty()) why = kiln_status_get_message(st);
    kiln_status_release(st);
    return why.empty();
  };
  if (check(kiln_runtime_create(&o, &rt)) && check(kiln_model_load_memory(rt, bytes.data(), bytes.size(), &model))) {
    std::vector<kiln_host_tensor> in, out;
    for (const Tensor& t : inputs) in.push_back({const_cast<std::byte*>(t.data()), t.nbytes()});
    for (Tensor& t : outputs) out.push_back({t.mutable_data(), t.nbytes()});
    for (int i = 0; i < how.runs && why.empty(); ++i)
      check(kiln_model_run(model, in.data(), in.size(), out.data(), out.size()));
    for (size_t i = 0; how.problems && why.empty() && i < kiln_model_num_steps(model); ++i) {
      char buf[2048];
      if (check(kiln_model_step_problem(model, i, buf, sizeof buf)) && buf[0]) how.problems->push_back(buf);
    }
  }
  if (model) kiln_model_release(model);
  if (rt) kiln_runtime_release(rt);
  return why;
}

}  // namespace kiln
