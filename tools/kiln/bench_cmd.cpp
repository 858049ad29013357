// `kiln bench`: load a .kiln artifact through the runtime C API and time it on the GPU.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>

#include "cli.h"
#include "kiln/artifact_reader.h"
#include "kiln/distributed.h"
#include "kiln/runtime.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kBench = R"(usage: kiln bench MODEL.kiln [--iterations N] [--warmup N] [--graphs on|off|both]
                  [--report-json FILE] [--device N] [options]
       kiln bench MODEL.onnx|MODEL.kir --target LIST [--sym NAME=VALUE]... [-o OUT.kiln] ...

Load an artifact with the runtime, fill its inputs with seeded random data, warm up, then
time N runs. Reported per mode (CUDA graphs on, off): latency of a whole run (input upload,
plan, output download, as kiln_model_run) as min, median, mean, p90, p99 and max; the device
time of the plan alone (CUDA events, measured in a separate pass of N runs on a timing
runtime); the host time to enqueue a run; throughput in runs/s and, given a batch, samples/s.
A model that is not a .kiln is compiled first, as `kiln compile` does, into OUT.kiln
(default: MODEL with the extension .kiln).

  --iterations N        timed runs per mode (default 100)
  --warmup N            untimed runs first (default 10)
  --graphs on|off|both  CUDA graph replay (default on)
  --no-cuda-graphs      same as --graphs off
  --report-json FILE    also write the results as JSON
  --device N            CUDA device ordinal (default 0)
  --seed N              seed of the random inputs (default 0)
  --int-max N           integer inputs are drawn from [0, N) (default 2: valid indices for any
                        dimension of size 2 or more)
  --batch N             samples per run for samples/s (default: the first input's leading
                        dimension when its rank is 2 or more; 0: do not report samples/s)
  --profile N           also time every plan step alone (CUDA events between steps, no
                        graph) and print the N slowest steps and the time by kind of step

compile first (MODEL not a .kiln): --target, --sym, -o/--output, --backend, --pipeline,
  --passes, --frontend, --plugin-path, as for `kiln compile`

Under a launcher (kiln launch, torchrun, srun, mpirun) every rank loads the artifact as its
rank of the plan's mesh on its own device and runs the same timing passes; rank 0 prints the
results and writes the report (its own timings: the collectives keep the ranks in step).

  --collective-timeout S  a run whose collectives have not finished in S seconds fails (300)

The timing pass's runs start behind a 50 us device wait, so device time holds neither the graph
launch nor the input copies' hand-over (latency comes from the other pass, without it).
Environment: KILN_TIMING_LEAD_US=N sets that wait (0 drops it); KILN_TIMING_FLUSH_L2=1 reads
twice the L2's size before each timed run, so the plan finds none of its inputs in L2 (weights
of a real model rarely are; small ones would stay there after the copies).
)";

struct BenchFlags {
  std::string model, report_json;
  int iterations = 100, warmup = 10, device = 0;
  int64_t batch = -1;  // -1: from the first input
  uint64_t seed = 0;
  int64_t int_max = 2;
  int profile_top = 0;  // 0: no per-step profile
  std::vector<bool> graph_modes = {true};
  std::vector<std::string> compile_args;  // forwarded to `kiln compile`
  bool device_given = false;
  double collective_timeout_s = 300;
  /// Per-rank artifacts, or any artifact under a launcher: loaded as one rank of the run.
  bool distributed = false;
  int rank = 0;
};

template <typename T>
T number(const std::string& text, const std::string& flag, T min) {
  T v{};
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size() || v < min)
    throw UsageError{"bench: " + flag + " expects an integer >= " + std::to_string(min) + ", got '" + text + "'"};
  return v;
}

BenchFlags parse_bench(Args& args) {
  BenchFlags f;
  std::string output;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!f.model.empty()) throw UsageError{"bench: more than one model ('" + f.model + "', '" + args.positional() + "')"};
      f.model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (flag == "--iterations") f.iterations = number<int>(args.value(flag), flag, 1);
    else if (flag == "--warmup") f.warmup = number<int>(args.value(flag), flag, 0);
    else if (flag == "--device") f.device = number<int>(args.value(flag), flag, 0), f.device_given = true;
    else if (flag == "--collective-timeout") f.collective_timeout_s = number<int>(args.value(flag), flag, 1);
    else if (flag == "--seed") f.seed = number<uint64_t>(args.value(flag), flag, 0);
    else if (flag == "--int-max") f.int_max = number<int64_t>(args.value(flag), flag, 1);
    else if (flag == "--batch") f.batch = number<int64_t>(args.value(flag), flag, 0);
    else if (flag == "--profile") f.profile_top = number<int>(args.value(flag), flag, 1);
    else if (flag == "--report-json") f.report_json = args.value(flag);
    else if (flag == "--no-cuda-graphs") { args.no_value(flag); f.graph_modes = {false}; }
    else if (flag == "--graphs") {
      const std::string v = args.value(flag);
      if (v == "on") f.graph_modes = {true};
      else if (v == "off") f.graph_modes = {false};
      else if (v == "both") f.graph_modes = {true, false};
      else throw UsageError{"bench: --graphs expects on, off or both, got '" + v + "'"};
    } else if (flag == "-o" || flag == "--output") {
      output = args.value(flag);
    } else if (flag == "--target" || flag == "--sym" || flag == "--backend" || flag == "--pipeline" ||
               flag == "--passes" || flag == "--frontend" || flag == "--plugin-path") {
      f.compile_args.push_back(flag);
      f.compile_args.push_back(args.value(flag));
    } else {
      args.unknown(flag);
    }
  }
  if (f.model.empty()) throw UsageError{"bench: no model given"};
  const bool is_artifact = f.model.size() > 5 && f.model.ends_with(".kiln");
  if (is_artifact && (!f.compile_args.empty() || !output.empty()))
    throw UsageError{"bench: '" + f.model + "' is already an artifact; compile options apply to other models only"};
  if (!is_artifact && !output.empty()) f.compile_args.insert(f.compile_args.end(), {"-o", output});
  return f;
}

// ---- inputs ---------------------------------------------------------------------------------

/// Fills one input's bytes with seeded values of its dtype: floats in about [-1, 1) (finite for
/// every float format), integers in [0, int_max), bools 0 or 1.
void fill_random(const kiln_tensor_info& info, std::mt19937_64& rng, int64_t int_max, std::vector<unsigned char>& out) {
  out.assign(info.bytes, 0);
  uint64_t count = 1;
  for (int i = 0; i < info.rank; ++i) count *= static_cast<uint64_t>(info.dims[i]);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  std::uniform_int_distribution<int64_t> integer(0, int_max - 1);
  auto put = [&out](uint64_t i, const auto& v) {
    if ((i + 1) * sizeof v <= out.size()) std::memcpy(out.data() + i * sizeof v, &v, sizeof v);
  };
  for (uint64_t i = 0; i < count; ++i) {
    switch (info.dtype) {
      case KILN_DTYPE_F64: put(i, real(rng)); break;
      case KILN_DTYPE_F32: put(i, static_cast<float>(real(rng))); break;
      case KILN_DTYPE_BF16: {
        const float v = static_cast<float>(real(rng));
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        put(i, static_cast<uint16_t>(bits >> 16));
        break;
      }
      case KILN_DTYPE_F16: {
        // Sign, an exponent for [2^-5, 1), a random mantissa: always finite and normal.
        const uint64_t r = rng();
        put(i, static_cast<uint16_t>(((r & 1) << 15) | ((10 + (r >> 1) % 5) << 10) | ((r >> 8) & 0x3ff)));
        break;
      }
      case KILN_DTYPE_F8E4M3FN:
      case KILN_DTYPE_F8E5M2: {
        // Bytes below 0x78 (either sign) are finite in both formats.
        const uint64_t r = rng();
        put(i, static_cast<uint8_t>(((r & 1) << 7) | ((r >> 1) % 0x78)));
        break;
      }
      case KILN_DTYPE_I64: put(i, static_cast<int64_t>(integer(rng))); break;
      case KILN_DTYPE_I32: put(i, static_cast<int32_t>(integer(rng))); break;
      case KILN_DTYPE_I16: put(i, static_cast<int16_t>(integer(rng))); break;
      case KILN_DTYPE_I8: put(i, static_cast<int8_t>(integer(rng))); break;
      case KILN_DTYPE_U8: put(i, static_cast<uint8_t>(integer(rng))); break;
      case KILN_DTYPE_BOOL: put(i, static_cast<uint8_t>(rng() & 1)); break;
      case KILN_DTYPE_I4: i = count; break;  // packed two per byte: filled below
    }
  }
  if (info.dtype == KILN_DTYPE_I4)
    for (auto& b : out) b = static_cast<unsigned char>(rng() & 0x77);  // two values in [0, 8)
}

const char* dtype_name(kiln_dtype d) {
  static const char* const kNames[] = {"f64", "f32", "f16", "bf16", "f8e4m3fn", "f8e5m2", "i64",
                                       "i32", "i16", "i8",  "u8",  "i4",   "bool"};
  return static_cast<size_t>(d) < std::size(kNames) ? kNames[d] : "?";
}

std::string type_str(const kiln_tensor_info& info) {
  std::string s = std::string(dtype_name(info.dtype)) + "[";
  for (int i = 0; i < info.rank; ++i) s += (i ? ", " : "") + std::to_string(info.dims[i]);
  return s + "]";
}

// ---- statistics and reporting ----------------------------------------------------------------

struct Summary {
  double min = 0, median = 0, mean = 0, p90 = 0, p99 = 0, max = 0;
};

/// Nearest-rank percentiles of `v` (not empty).
Summary summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto pct = [&v](double p) {
    const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
    return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
  };
  Summary s;
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  s.p90 = pct(90);
  s.p99 = pct(99);
  return s;
}

std::string fixed(double v, int digits = 4) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}


std::string json_summary(const Summary& s) {
  return "{\"min\": " + fixed(s.min, 6) + ", \"median\": " + fixed(s.median, 6) + ", \"mean\": " + fixed(s.mean, 6) +
         ", \"p90\": " + fixed(s.p90, 6) + ", \"p99\": " + fixed(s.p99, 6) + ", \"max\": " + fixed(s.max, 6) + "}";
}

/// One mode's measurements, or the error that stopped it.
struct ModeResult {
  std::string error, note;
  std::vector<double> step_ms;  // --profile: mean device ms of each plan step
  Summary latency, enqueue, device;
  bool has_device = false;
  double runs_per_s = 0;
};

/// The message of a failed status, which it releases ("" for success).
std::string take(kiln_status* st) { return take_status(st); }

/// Loads f.model on a fresh runtime (CUDA graphs as asked, device timing or not). Returns "" or
/// the failure; *fatal is set when no other runtime could do better: the runtime itself failed
/// (no device, ...) or the model was refused as invalid (a bad file, or a KILN_TIMING_* value).
std::string load_for_bench(const BenchFlags& f, bool graphs, bool timing, LoadedModel* l, std::string* device_name,
                           bool* fatal) {
  kiln_runtime_options o;
  kiln_runtime_options_initialize(&o);
  o.device_ordinal = f.device;
  o.use_cuda_graphs = graphs ? 1 : 0;
  o.enable_timing = timing ? 1 : 0;
  if (kiln_status* st = kiln_runtime_create(&o, &l->rt)) {
    *fatal = true;  // NO_DEVICE and friends: the runtime's own message
    return take(st);
  }
  *device_name = kiln_runtime_device_name(l->rt);
  std::cerr << "bench: " << (graphs ? "graphs on" : "graphs off") << ": loading " << f.model << " on " << *device_name
            << (timing ? " (device timing)" : "") << "\n";
  kiln_status* st = nullptr;
  if (f.distributed) {
    kiln_distributed_options d;
    kiln_distributed_options_initialize(&d);
    d.collective_timeout_s = f.collective_timeout_s;
    st = kiln_model_load_file_distributed(l->rt, f.model.c_str(), &d, &l->m);
  } else {
    st = kiln_model_load_file(l->rt, f.model.c_str(), &l->m);
  }
  if (!st) return "";
  *fatal = kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT;
  return take(st);
}

/// Warm-up runs, then f.iterations timed runs: host latency and enqueue time of each, and with
/// `device` (a timing runtime) the plan's device time. Returns "" or the error that stopped them.
std::string time_runs(const BenchFlags& f, kiln_model* m, const std::vector<kiln_host_tensor>& ins,
                      std::vector<kiln_host_tensor>& outs, std::vector<double>* latency,
                      std::vector<double>* enqueue, std::vector<double>* device, std::string* note) {
  using clock = std::chrono::steady_clock;
  auto ms = [](clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  for (int i = 0; i < f.warmup; ++i)
    if (std::string e = take(kiln_model_run(m, ins.data(), ins.size(), outs.data(), outs.size())); !e.empty()) return e;
  for (int i = 0; i < f.iterations; ++i) {
    const auto t0 = clock::now();
    if (std::string e = take(kiln_model_enqueue(m, ins.data(), ins.size(), outs.data(), outs.size())); !e.empty()) return e;
    const auto t1 = clock::now();
    if (std::string e = take(kiln_model_synchronize(m)); !e.empty()) return e;
    const auto t2 = clock::now();
    if (latency) latency->push_back(ms(t2 - t0)), enqueue->push_back(ms(t1 - t0));
    double dev = 0;
    if (!device) continue;
    if (std::string e = take(kiln_model_device_time(m, &dev)); e.empty()) {
      device->push_back(dev);
    } else {
      *note += (note->empty() ? "" : "; ") + std::string("device timing unavailable: ") + e;
      device->clear();
      device = nullptr;
    }
  }
  return "";
}

/// Times one graph mode in two passes, each on a fresh runtime: device time of the plan on a
/// timing runtime (whose runs start behind its device lead-in and copy outside the graph), then
/// latency, enqueue time and throughput on a normal one, as a host program would run the model.
/// When the timing runtime cannot load the model, the second pass alone runs (noted). The infos'
/// names are copied into `names` (whose elements never move): the runtime's own name strings are
/// freed with the model.
ModeResult measure(const BenchFlags& f, bool graphs, std::string* device_name, std::vector<kiln_tensor_info>* inputs_out,
                   std::vector<kiln_tensor_info>* outputs_out, std::deque<std::string>* names) {
  ModeResult r;
  std::vector<std::vector<unsigned char>> in_data, out_data;
  std::vector<kiln_host_tensor> ins, outs;
  // The seeded inputs and the output buffers, from the first model loaded.
  auto prepare_io = [&](kiln_model* m) -> std::string {
    std::mt19937_64 rng(f.seed);
    inputs_out->clear();
    outputs_out->clear();
    in_data.assign(kiln_model_num_inputs(m), {});
    out_data.assign(kiln_model_num_outputs(m), {});
    for (size_t i = 0; i < in_data.size(); ++i) {
      kiln_tensor_info info{};
      if (std::string e = take(kiln_model_input_info(m, i, &info)); !e.empty()) return e;
      fill_random(info, rng, f.int_max, in_data[i]);
      ins.push_back({in_data[i].data(), info.bytes});
      names->push_back(info.name ? info.name : "");
      info.name = names->back().c_str();
      inputs_out->push_back(info);
    }
    for (size_t i = 0; i < out_data.size(); ++i) {
      kiln_tensor_info info{};
      if (std::string e = take(kiln_model_output_info(m, i, &info)); !e.empty()) return e;
      out_data[i].assign(info.bytes, 0);
      outs.push_back({out_data[i].data(), info.bytes});
      names->push_back(info.name ? info.name : "");
      info.name = names->back().c_str();
      outputs_out->push_back(info);
    }
    return "";
  };

  std::vector<double> latency, enqueue, device;
  bool timing_loaded = false, timed = false;
  const bool profile = f.profile_top > 0 && graphs == f.graph_modes.front();
  auto profile_steps = [&](kiln_model* m) -> std::string {
    r.step_ms.assign(kiln_model_num_steps(m), 0.0);
    return take(kiln_model_profile_steps(m, 10, r.step_ms.data(), r.step_ms.size()));
  };
  {
    LoadedModel l;
    bool fatal = false;
    std::string err = load_for_bench(f, graphs, true, &l, device_name, &fatal);
    if (fatal) {
      r.error = err;
      return r;
    }
    timing_loaded = err.empty();
    if (!timing_loaded) {
      r.note = "device timing unavailable: " + err;
      std::cerr << "bench: loading with device timing failed (" << err << "); timing without it\n";
    } else {
      r.error = prepare_io(l.m);
      if (r.error.empty()) r.error = time_runs(f, l.m, ins, outs, nullptr, nullptr, &device, &r.note);
      timed = r.error.empty() && device.size() == static_cast<size_t>(f.iterations);
      if (r.error.empty() && profile) r.error = profile_steps(l.m);
      if (!r.error.empty()) return r;
    }
  }
  LoadedModel l;
  bool fatal = false;
  r.error = load_for_bench(f, graphs, false, &l, device_name, &fatal);
  if (r.error.empty() && !timing_loaded) r.error = prepare_io(l.m);
  if (r.error.empty()) r.error = time_runs(f, l.m, ins, outs, &latency, &enqueue, nullptr, &r.note);
  if (r.error.empty() && profile && !timing_loaded) r.error = profile_steps(l.m);
  if (!r.error.empty()) return r;
  r.latency = summarize(latency);
  r.enqueue = summarize(enqueue);
  if (timed) {
    r.device = summarize(device);
    r.has_device = true;
  }
  r.runs_per_s = 1000.0 / r.latency.mean;
  return r;
}

/// What a plan step is, for the profile: "gemm 4096x4096x4096 bf16", "launch k12_softmax".
std::string step_label(const artifact::PlanStep& s) {
  auto attr = [&](const char* k) { auto it = s.attrs.find(k); return it == s.attrs.end() ? std::string("?") : it->second; };
  switch (s.kind) {
    case artifact::PlanStep::Kind::kLaunch: return "launch " + s.kernel;
    case artifact::PlanStep::Kind::kGemm:
      return "gemm " + attr("m") + "x" + attr("n") + "x" + attr("k") + " batch " + attr("batch") + " " + attr("dtype") +
             " " + attr("epilogue");
    case artifact::PlanStep::Kind::kCopy: return "copy " + attr("bytes") + " bytes";
    case artifact::PlanStep::Kind::kMemset: return "memset " + attr("bytes") + " bytes";
    case artifact::PlanStep::Kind::kConv:
      return "conv " + attr("n") + "x" + attr("c") + "x" + attr("spatial") + " k " + attr("k") + " kernel " +
             attr("kernel") + " " + attr("dtype") + " " + attr("activation");
    case artifact::PlanStep::Kind::kCollective:
      return "collective " + attr("op") + " " + attr("count") + " " + attr("dtype") +
             (s.attrs.count("axis") ? " over " + attr("axis") : " peer " + attr("peer"));
  }
  return "?";
}

/// The kind a step is totalled under: the op of a generated kernel ("k12_softmax" → "softmax"), else the step kind.
std::string step_kind(const artifact::PlanStep& s) {
  if (s.kind != artifact::PlanStep::Kind::kLaunch) return step_label(s).substr(0, step_label(s).find(' '));
  const size_t u = s.kernel.find('_');
  return u == std::string::npos ? s.kernel : s.kernel.substr(u + 1);
}

/// Prints the slowest steps and the totals by kind; returns the same as JSON.
std::string profile_report(const BenchFlags& f, const std::vector<artifact::PlanStep>& steps,
                           const std::vector<double>& ms, std::ostringstream& text) {
  double total = 0;
  for (double v : ms) total += v;
  std::vector<size_t> order(ms.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return ms[x] > ms[y]; });
  std::map<std::string, std::pair<double, int>> by_kind;
  for (size_t i = 0; i < ms.size() && i < steps.size(); ++i) {
    auto& k = by_kind[step_kind(steps[i])];
    k.first += ms[i];
    ++k.second;
  }
  std::vector<std::pair<std::string, std::pair<double, int>>> kinds(by_kind.begin(), by_kind.end());
  std::stable_sort(kinds.begin(), kinds.end(), [](const auto& x, const auto& y) { return x.second.first > y.second.first; });
  auto pct = [&](double v) { return fixed(total > 0 ? 100.0 * v / total : 0.0, 1); };
  text << "profile (each step alone, mean of 10 runs): " << fixed(total) << " ms in " << ms.size() << " steps\n  by kind:\n";
  std::ostringstream json;
  json << "{\"total_ms\": " << fixed(total) << ", \"by_kind\": [";
  for (size_t i = 0; i < kinds.size(); ++i) {
    text << "    " << fixed(kinds[i].second.first) << " ms " << pct(kinds[i].second.first) << "%  " << kinds[i].first << " ("
         << kinds[i].second.second << " steps)\n";
    json << (i ? ", " : "") << "{\"kind\": " << json_string(kinds[i].first) << ", \"ms\": " << fixed(kinds[i].second.first)
         << ", \"steps\": " << kinds[i].second.second << "}";
  }
  text << "  slowest steps:\n";
  json << "], \"steps\": [";
  for (size_t j = 0; j < order.size() && j < static_cast<size_t>(f.profile_top); ++j) {
    const size_t i = order[j];
    const std::string label = i < steps.size() ? step_label(steps[i]) : "?";
    text << "    #" << i << "  " << fixed(ms[i]) << " ms " << pct(ms[i]) << "%  " << label << "\n";
    json << (j ? ", " : "") << "{\"step\": " << i << ", \"ms\": " << fixed(ms[i]) << ", \"what\": " << json_string(label) << "}";
  }
  json << "]}";
  return json.str();
}

}  // namespace

std::string bench_usage_text() { return std::string(kBench); }

int cmd_bench(Args& args) {
  BenchFlags f = parse_bench(args);
  const bool is_artifact = f.model.ends_with(".kiln");
  if (!is_artifact) {
    // Compile first, exactly as `kiln compile` would; it names the artifact it writes.
    std::string artifact;
    std::vector<std::string> cargs = {f.model};
    cargs.insert(cargs.end(), f.compile_args.begin(), f.compile_args.end());
    for (size_t i = 0; i + 1 < f.compile_args.size(); i += 2)
      if (f.compile_args[i] == "-o") artifact = f.compile_args[i + 1];
    if (artifact.empty()) {
      const size_t dot = f.model.find_last_of('.'), slash = f.model.find_last_of('/');
      artifact = (dot != std::string::npos && (slash == std::string::npos || dot > slash) ? f.model.substr(0, dot) : f.model) + ".kiln";
      cargs.insert(cargs.end(), {"-o", artifact});
    }
    Args compile_args(std::move(cargs), "compile");
    if (int rc = cmd_compile(compile_args); rc != kExitOk) return rc;
    f.model = artifact;
  }

  // Checked without a GPU first, so a damaged file is reported as such on any machine.
  std::string error;
  // Kept: the profile labels its steps from the plan.
  std::unique_ptr<artifact::Artifact> checked = artifact::read_artifact_file(f.model, &error);
  if (!checked) return report(invalid_argument(error));
  dist::LaunchInfo launch;
  const dist::LaunchFound launched = dist::find_launch(&launch, &error);
  if (launched == dist::LaunchFound::kError) return report(invalid_argument(error));
  if (launched != dist::LaunchFound::kFound) launch = dist::LaunchInfo{};
  // A pipeline's artifact holds every rank's program: this rank's is the one to run.
  if (!artifact::select_rank_program(checked, launch.rank, launch.world_size, launch.launcher, f.model, &error))
    return report(invalid_argument(error));
  f.distributed = !checked->plan.mesh.empty() || launched == dist::LaunchFound::kFound;
  f.rank = launched == dist::LaunchFound::kFound ? launch.rank : 0;
  if (launched == dist::LaunchFound::kFound && !f.device_given) {
    f.device = dist::launch_device(&error);
    if (f.device < 0) return report(invalid_argument(error));
  }

  std::string device = "?";
  std::vector<kiln_tensor_info> inputs, outputs;
  std::deque<std::string> names;
  std::vector<std::pair<bool, ModeResult>> results;
  for (bool graphs : f.graph_modes) {
    results.emplace_back(graphs, measure(f, graphs, &device, &inputs, &outputs, &names));
    // Without a device no mode can run: one message is enough.
    if (!results.back().second.error.empty() && results.back().second.error.starts_with("no CUDA device")) break;
  }

  int64_t batch = f.batch;
  if (batch < 0) batch = !inputs.empty() && inputs[0].rank >= 2 ? inputs[0].dims[0] : 0;

  std::ostringstream text, json;
  text << "model: " << f.model << "\ndevice: " << device << " (ordinal " << f.device << ")\n";
  for (const auto& i : inputs) text << "input " << i.name << ": " << type_str(i) << "\n";
  for (const auto& o : outputs) text << "output " << o.name << ": " << type_str(o) << "\n";
  text << "iterations: " << f.iterations << ", warmup: " << f.warmup << "\n";
  json << "{\"model\": " << json_string(f.model) << ", \"device\": " << json_string(device)
       << ", \"device_ordinal\": " << f.device << ", \"iterations\": " << f.iterations << ", \"warmup\": " << f.warmup
       << ", \"seed\": " << f.seed << ", \"batch\": " << batch << ",\n \"inputs\": [";
  auto json_infos = [&json](const std::vector<kiln_tensor_info>& v) {
    for (size_t i = 0; i < v.size(); ++i) {
      json << (i ? ", " : "") << "{\"name\": " << json_string(v[i].name) << ", \"dtype\": \"" << dtype_name(v[i].dtype)
           << "\", \"shape\": [";
      for (int d = 0; d < v[i].rank; ++d) json << (d ? ", " : "") << v[i].dims[d];
      json << "], \"bytes\": " << v[i].bytes << "}";
    }
  };
  json_infos(inputs);
  json << "], \"outputs\": [";
  json_infos(outputs);
  json << "],\n \"graphs\": {";
  bool failed = false;
  for (size_t k = 0; k < results.size(); ++k) {
    const auto& [graphs, r] = results[k];
    const std::string key = graphs ? "on" : "off";
    json << (k ? ",\n  " : "\n  ") << "\"" << key << "\": {";
    if (!r.note.empty()) json << "\"note\": " << json_string(r.note) << ", ";
    if (!r.error.empty()) {
      failed = true;
      json << "\"error\": " << json_string(r.error) << "}";
      continue;
    }
    json << "\"latency_ms\": " << json_summary(r.latency) << ",\n   \"enqueue_ms\": " << json_summary(r.enqueue)
         << ",\n   \"device_ms\": " << (r.has_device ? json_summary(r.device) : "null")
         << ",\n   \"runs_per_s\": " << fixed(r.runs_per_s, 3)
         << ", \"samples_per_s\": " << (batch > 0 ? fixed(r.runs_per_s * static_cast<double>(batch), 3) : "null") << "}";
    text << "graphs " << key << ":\n  latency ms: min " << fixed(r.latency.min) << "  median " << fixed(r.latency.median)
         << "  mean " << fixed(r.latency.mean) << "  p90 " << fixed(r.latency.p90) << "  p99 " << fixed(r.latency.p99)
         << "  max " << fixed(r.latency.max) << "\n";
    if (r.has_device)
      text << "  device ms (plan only): min " << fixed(r.device.min) << "  median " << fixed(r.device.median) << "  p99 "
           << fixed(r.device.p99) << "\n";
    text << "  host enqueue ms: median " << fixed(r.enqueue.median) << "  p99 " << fixed(r.enqueue.p99) << "\n"
         << "  throughput: " << fixed(r.runs_per_s, 1) << " runs/s";
    if (batch > 0) text << ", " << fixed(r.runs_per_s * static_cast<double>(batch), 1) << " samples/s (batch " << batch << ")";
    text << "\n";
    if (!r.note.empty()) text << "  note: " << r.note << "\n";
  }
  json << "\n }";
  for (const auto& [graphs, r] : results)
    if (!r.step_ms.empty()) json << ",\n \"profile\": " << profile_report(f, checked->plan.steps, r.step_ms, text);
  json << "}\n";

  // Rank 0 speaks for a distributed run; the other ranks report only their failures.
  if (f.rank == 0) std::cout << text.str();
  std::cout.flush();
  if (!f.report_json.empty() && f.rank == 0) {
    std::ofstream out(f.report_json, std::ios::binary);
    out << json.str();
    out.close();
    if (!out) return report(io_error("cannot write '" + f.report_json + "'"));
  }
  if (failed) {
    std::vector<std::string> seen;
    for (const auto& [graphs, r] : results) {
      if (r.error.empty()) continue;
      // The same error for both modes (a missing device, a refused image) is reported once.
      if (std::find(seen.begin(), seen.end(), r.error) == seen.end())
        report(failed_precondition((results.size() > 1 ? std::string(graphs ? "graphs on: " : "graphs off: ") : "") + r.error));
      seen.push_back(r.error);
    }
    return kExitError;
  }
  return std::cout ? kExitOk : report(io_error("cannot write to stdout"));
}

}  // namespace kiln::cli
