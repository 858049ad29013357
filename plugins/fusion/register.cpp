// Entry point of the kiln-fusion plugin: registers fuse-pointwise.
#include "fusion.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_fusion(kiln::Registry& r) {
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::fusion::fuse_pointwise_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::fusion::fuse_rows_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::fusion::fuse_horizontal_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::fusion::fold_layout_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::fusion::layout_nhwc_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::fusion::fuse_attention_pass_info()));
  return kiln::ok_status();
}

}  // namespace

KILN_PLUGIN("kiln-fusion", "0.1.0", register_fusion)
