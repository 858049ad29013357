// Entry point of the kiln-fusion plugin: registers fuse-pointwise.
#include "fusion.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_fusion(kiln::Registry& r) {
  return r.add_pass(kiln::fusion::fuse_pointwise_pass_info());
}

}  // namespace

KILN_PLUGIN("kiln-fusion", "0.1.0", register_fusion)
