// `kiln quant-report`: per-layer and end-to-end SQNR of a quantized pipeline against the fp32
// model on the reference interpreter, and top-1 agreement of logits.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <set>

#include "kiln/ir/op.h"
#include "quant_cli.h"

namespace kiln::cli {

namespace {

constexpr std::string_view kUsage = R"(usage: kiln quant-report MODEL --pipeline FILE.toml [--inputs DIR | --random-inputs N]
                         [--seed N] [--sym NAME=VALUE]... [--floor DB] [--vocab-min N]

Run MODEL in fp32 and as the pipeline quantizes it (its passes up to the last quantize-* or
convert-* pass), both on the reference interpreter, and print:
  - per layer: SQNR of each contraction's output (scaled_matmul, matmul_int4, matmul, ...)
    against the fp32 value of the same name;
  - end to end: SQNR of every graph output;
  - top-1 agreement of the argmax over the last dim, for outputs that look like logits
    (last dim >= --vocab-min, default 1000);
  - first, how many contractions of each op the quantized graph has (named or not).
SQNR = 10 log10(sum ref^2 / sum (ref - quant)^2) in dB, over all input sets.

  --inputs DIR          input sets as for kiln calibrate (default: --random-inputs 1)
  --random-inputs N     N seeded pseudo-random input sets
  --floor DB            exit 1 when an end-to-end SQNR is below DB
  --vocab-min N         smallest last dim treated as logits (default 1000)
)";

struct Acc {
  double signal = 0, noise = 0;
  int64_t agree = 0, rows = 0;
  double sqnr() const {
    if (noise == 0) return signal == 0 ? 0 : INFINITY;
    return 10 * std::log10(signal / noise);
  }
};

void add(Acc& a, const Tensor& ref, const Tensor& q, int64_t vocab_min) {
  const std::vector<double> r = ref.to_f64(), x = q.to_f64();
  for (size_t i = 0; i < r.size() && i < x.size(); ++i) {
    a.signal += r[i] * r[i];
    a.noise += (r[i] - x[i]) * (r[i] - x[i]);
  }
  const int64_t v = ref.rank() > 0 ? ref.shape().back() : 0;
  if (v < vocab_min || v == 0) return;
  for (int64_t row = 0; row * v < static_cast<int64_t>(r.size()); ++row) {
    int64_t br = 0, bx = 0;
    for (int64_t j = 1; j < v; ++j) {
      if (r[static_cast<size_t>(row * v + j)] > r[static_cast<size_t>(row * v + br)]) br = j;
      if (x[static_cast<size_t>(row * v + j)] > x[static_cast<size_t>(row * v + bx)]) bx = j;
    }
    a.agree += br == bx;
    ++a.rows;
  }
}

std::string db(double v) {
  char b[32];
  std::snprintf(b, sizeof b, std::isinf(v) ? "inf" : "%.2f", v);
  return b;
}

}  // namespace

std::string quant_report_usage() { return std::string(kUsage); }

int cmd_quant_report(Args& args) {
  QuantFlags f;
  double floor = -INFINITY;
  int64_t vocab_min = 1000;
  while (!args.done()) {
    if (!args.at_option()) {
      if (!f.model.empty()) throw UsageError{"quant-report: more than one input model"};
      f.model = args.positional();
      continue;
    }
    const std::string flag = args.option();
    if (quant_flag(flag, args, f)) continue;
    if (flag == "--floor") {
      const std::string v = args.value(flag);
      char* end = nullptr;
      floor = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0') throw UsageError{"--floor must be a number of dB, got '" + v + "'"};
    } else if (flag == "--vocab-min") {
      const std::string v = args.value(flag);
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), vocab_min);
      if (ec != std::errc() || p != v.data() + v.size() || vocab_min < 1)
        throw UsageError{"--vocab-min must be a positive integer, got '" + v + "'"};
    } else {
      args.unknown(flag);
    }
  }
  if (f.model.empty()) throw UsageError{"quant-report: no input model given"};
  if (f.pipeline_file.empty() && !f.passes) throw UsageError{"quant-report: give --pipeline FILE.toml or --passes LIST"};
  if (!f.inputs_dir.empty() && f.random_samples > 0)
    throw UsageError{"quant-report: give --inputs DIR or --random-inputs N, not both"};
  if (f.inputs_dir.empty() && f.random_samples == 0) f.random_samples = 1;

  std::unique_ptr<Graph> ref, quant;
  if (Status s = prepare_graphs(f, &ref, &quant); !s.ok()) return report(s);
  if (ref->num_outputs() != quant->num_outputs())
    return report(failed_precondition("quant-report: the quantized graph has " + std::to_string(quant->num_outputs()) +
                                      " outputs, the fp32 one " + std::to_string(ref->num_outputs())));
  // Layers: contraction outputs of the quantized graph that the fp32 graph also has by name
  // (convert-bf16 names a graph output's bf16 producer NAME.bf16: it is matched with NAME).
  std::set<std::string> ref_names;
  for (const auto& n : ref->nodes())
    for (const Value* v : n->results()) ref_names.insert(v->name());
  std::vector<std::string> layers, ref_layers;
  std::vector<std::string> layer_ops;
  const std::string bf16_suffix = ".bf16";
  // Every contraction by op, named or not (a layer below needs a name to be matched): shows
  // how much the pipeline quantized.
  std::map<std::string, int> by_op;
  for (const auto& n : quant->nodes()) {
    if (!n->op() || !n->op()->has(kTraitContraction)) continue;
    ++by_op[n->op_name()];
    if (n->num_results() != 1) continue;
    const std::string& name = n->result()->name();
    std::string ref_name = name;
    if (!ref_names.count(ref_name) && name.size() > bf16_suffix.size() &&
        name.compare(name.size() - bf16_suffix.size(), bf16_suffix.size(), bf16_suffix) == 0)
      ref_name = name.substr(0, name.size() - bf16_suffix.size());
    if (name.empty() || !ref_names.count(ref_name)) continue;
    layers.push_back(name);
    ref_layers.push_back(ref_name);
    layer_ops.push_back(n->op_name());
  }
  auto sets = sample_inputs(*ref, f);
  if (!sets.ok()) return report(sets.status());
  std::vector<Acc> layer_acc(layers.size()), out_acc(static_cast<size_t>(ref->num_outputs()));
  for (const auto& in : *sets) {
    auto r = run_with_values(*ref, ref_layers, in);
    if (!r.ok()) return report(r.status().with_context("fp32 run"));
    auto q = run_with_values(*quant, layers, in);
    if (!q.ok()) return report(q.status().with_context("quantized run"));
    const size_t outs = out_acc.size();
    for (size_t i = 0; i < outs; ++i) add(out_acc[i], (*r)[i], (*q)[i], vocab_min);
    for (size_t i = 0; i < layers.size(); ++i) add(layer_acc[i], (*r)[outs + i], (*q)[outs + i], INT64_MAX);
  }

  std::cout << "quant-report: " << f.model << ", " << sets->size() << " input set(s)\n";
  std::cout << "contractions by op:";
  const char* sep = " ";
  for (const auto& [op, count] : by_op) {
    std::cout << sep << op << " " << count;
    sep = ", ";
  }
  std::cout << (by_op.empty() ? " none\n" : "\n");
  std::cout << "per layer (" << layers.size() << "):\n";
  for (size_t i = 0; i < layers.size(); ++i)
    std::cout << "  " << db(layer_acc[i].sqnr()) << " dB  " << layer_ops[i] << " %" << layers[i] << "\n";
  std::cout << "end to end:\n";
  bool below = false;
  for (size_t i = 0; i < out_acc.size(); ++i) {
    const double s = out_acc[i].sqnr();
    below |= s < floor;
    std::cout << "  " << db(s) << " dB  output " << graph_output_name(*ref, static_cast<int>(i));
    if (out_acc[i].rows > 0) {
      char b[64];
      std::snprintf(b, sizeof b, "  top-1 agreement %.2f%% (%lld/%lld)", 100.0 * out_acc[i].agree / out_acc[i].rows,
                    static_cast<long long>(out_acc[i].agree), static_cast<long long>(out_acc[i].rows));
      std::cout << b;
    }
    std::cout << "\n";
  }
  std::cout.flush();
  if (below) return report(failed_precondition("quant-report: an end-to-end SQNR is below the floor of " + db(floor) + " dB"));
  return kExitOk;
}

}  // namespace kiln::cli
