// Private to the kiln-quantize-fp8 plugin: the factories of the passes it registers.
#pragma once

#include <map>
#include <string>

#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"

namespace kiln::fp8 {

/// Registry entry of quantize-fp8 (quantize_fp8.cpp).
PassInfo quantize_fp8_pass_info();
/// Registry entry of convert-bf16 (convert_bf16.cpp).
PassInfo convert_bf16_pass_info();
/// Reads the "amax" object of a scales file written by `kiln calibrate`: value name -> max |x|.
StatusOr<std::map<std::string, double>> read_scales(const std::string& path);

}  // namespace kiln::fp8
