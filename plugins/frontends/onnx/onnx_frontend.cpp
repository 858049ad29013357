// The onnx front end plugin: registers "onnx" (.onnx files) with its import limits as options.
#include <charconv>

#include "importer.h"
#include "kiln/plugin.h"

namespace kiln::onnx_fe {

bool needs_constant_input(const std::string& op, int opset, int index) {
  // Operands that decide a result's shape (or which values are computed at all): Kiln
  // graphs have static shapes, so these must be known when the model is imported.
  if (op == "Reshape" || op == "Expand" || op == "Tile" || op == "OneHot" || op == "CumSum" ||
      op == "Trilu" || op == "Compress" || op == "CenterCropPad")
    return index == 1;
  if (op == "ConstantOfShape" || op == "If" || op == "HannWindow" || op == "HammingWindow" ||
      op == "BlackmanWindow")
    return index == 0;
  if (op == "Range") return index <= 2;
  if (op == "MelWeightMatrix") return true;
  if (op == "DFT") return index >= 1;
  if (op == "STFT") return index == 1 || index == 3;
  if (op == "MaxUnpool") return index == 2;
  if (op == "Loop") return index <= 1;
  if (op == "Slice") return opset >= 10 && index >= 1;
  if (op == "Squeeze" || op == "Unsqueeze" || op == "Split") return opset >= 13 && index == 1;
  if (op == "ReduceSum") return opset >= 13 && index == 1;
  if (op.rfind("Reduce", 0) == 0) return opset >= 18 && index == 1;
  if (op == "Pad") return opset >= 11 && index >= 1;
  if (op == "TopK") return opset >= 10 && index == 1;
  if (op == "Resize") return opset >= 11 ? index >= 1 : index == 1;
  if (op == "Upsample") return opset >= 9 && index == 1;
  if (op == "Dropout") return opset >= 12 && index >= 1;
  return false;
}

namespace {

const std::vector<OptionSpec>& option_specs() {
  static const std::vector<OptionSpec> specs = {
      {"max-tensor-bytes", OptionType::kInt, int64_t{1} << 34, "largest tensor (initializer or result) in bytes"},
      {"max-rank", OptionType::kInt, int64_t{32}, "largest tensor rank"},
      {"max-nodes", OptionType::kInt, int64_t{1'000'000}, "most nodes in the model, subgraphs included"},
      {"max-nesting", OptionType::kInt, int64_t{16}, "deepest subgraph nesting (If/Loop/Scan bodies)"},
      {"max-unroll", OptionType::kInt, int64_t{4096}, "most Loop/Scan iterations unrolled at import"},
      {"fold-limit-bytes", OptionType::kInt, int64_t{1} << 28, "largest constant made by folding at import"},
      {"dims", OptionType::kStringList, std::vector<std::string>{},
       "NAME=SIZE pairs: static sizes for symbolic input dims (onnx dim_param)"},
      {"input-values", OptionType::kStringList, std::vector<std::string>{},
       "NAME=FILE.pb pairs: values for graph inputs kiln needs at import (shapes, axes, counts); those become constants"},
  };
  return specs;
}

StatusOr<std::unique_ptr<Graph>> import(const std::string& path, const Options& o) {
  ImportOptions opts;
  opts.limits.max_tensor_bytes = o.get_int("max-tensor-bytes");
  opts.limits.max_rank = o.get_int("max-rank");
  opts.limits.max_nodes = o.get_int("max-nodes");
  opts.limits.max_nesting = o.get_int("max-nesting");
  opts.limits.max_unroll = o.get_int("max-unroll");
  opts.fold_limit_bytes = o.get_int("fold-limit-bytes");
  for (const std::string& kv : o.get_strings("dims")) {
    const size_t eq = kv.find('=');
    int64_t v = -1;
    if (eq != std::string::npos && eq > 0) {
      const std::string n = kv.substr(eq + 1);
      auto [p, ec] = std::from_chars(n.data(), n.data() + n.size(), v);
      if (ec != std::errc() || p != n.data() + n.size()) v = -1;
    }
    if (v < 0) return invalid_argument("onnx: dims entry '" + kv + "' is not NAME=SIZE with a size >= 0");
    opts.dim_values[kv.substr(0, eq)] = v;
  }
  for (const std::string& kv : o.get_strings("input-values")) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      return invalid_argument("onnx: input-values entry '" + kv + "' is not NAME=FILE");
    KILN_ASSIGN_OR_RETURN(TensorFile f, read_tensor_file(kv.substr(eq + 1), opts.limits));
    opts.input_values[kv.substr(0, eq)] = f.tensor;
  }
  return import_onnx(path, opts);
}

Status register_onnx_frontend(Registry& r) {
  // The ops this plugin adds must exist as soon as it is loaded: a .kir written by
  // `kiln import` may use them, and reading it back needs them registered.
  KILN_RETURN_IF_ERROR(register_extra_ops());
  FrontendInfo info;
  info.name = "onnx";
  info.version = "0.1.0";
  info.summary = "ONNX models (.onnx): IR 3-10, opsets 7-21, external data checked";
  info.options = option_specs();
  info.extensions = {".onnx"};
  info.import = import;
  return r.add_frontend(std::move(info));
}

}  // namespace
}  // namespace kiln::onnx_fe

KILN_PLUGIN("kiln-frontend-onnx", "0.1.0", kiln::onnx_fe::register_onnx_frontend)
