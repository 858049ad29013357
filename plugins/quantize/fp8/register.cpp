// Entry point of the kiln-quantize-fp8 plugin: registers quantize-fp8 and convert-bf16.
#include "fp8.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_fp8(kiln::Registry& r) {
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::fp8::quantize_fp8_pass_info()));
  return r.add_pass(kiln::fp8::convert_bf16_pass_info());
}

}  // namespace

KILN_PLUGIN("kiln-quantize-fp8", "0.1.0", register_fp8)
