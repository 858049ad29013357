// Entry point of the kiln-transforms plugin: registers canonicalize, cse and dce.
#include "kiln/plugin.h"
#include "transforms.h"

namespace {

kiln::Status register_transforms(kiln::Registry& r) {
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::transforms::canonicalize_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::transforms::cse_pass_info()));
  return r.add_pass(kiln::transforms::dce_pass_info());
}

}  // namespace

KILN_PLUGIN("kiln-transforms", "0.1.0", register_transforms)
