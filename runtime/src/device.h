// Device discovery and the choice of kernel image for a device (pure, testable without a GPU).
#pragma once

#include <string>
#include <vector>

#include "status.h"

namespace kiln::rt {

/// A compute capability, e.g. {9, 0}.
struct ComputeCapability {
  int major = 0;
  int minor = 0;
};

/// "sm_90" for {9, 0}.
std::string device_name(ComputeCapability cc);

/// A parsed image name: "sm_90a.cubin" → {sass, 9, 0, 'a'}; "compute_80.ptx" → {ptx, 8, 0}.
struct ImageTarget {
  bool sass = false;   ///< cubin (SASS) rather than PTX
  ComputeCapability cc;
  char suffix = 0;     ///< 'a' (arch-specific), 'f' (family-specific) or 0
  std::string target;  ///< "sm_90a", "compute_90a"
};
/// False when `name` is not "<sm|compute>_<digits>[a|f].<cubin|ptx>" with a consistent form.
bool parse_image_name(const std::string& name, ImageTarget* out);

/// Whether an image runs on a device of capability `cc`. SASS runs on its own major only:
/// sm_XYa needs X.Y exactly, sm_XYf and sm_XY any X.Z with Z >= Y; PTX compute_XY is
/// JIT-compiled by the driver for any device >= X.Y (compute_XYa only for X.Y, compute_XYf
/// only within major X).
bool image_runs_on(const ImageTarget& image, ComputeCapability cc);

/// The result of select_image: the image name, or an UNSUPPORTED message.
struct ImageChoice {
  std::string image;  ///< key into Artifact::images; empty when none fits
  std::string error;  ///< "artifact has sm_90a, sm_100a; device is sm_80"
};

/// Picks the best image for `cc` among `names` (Artifact::images keys): SASS for the exact
/// capability (arch-specific first), else SASS of the same major and the highest lower minor,
/// else the newest PTX the device can JIT. Names that do not parse are ignored.
ImageChoice select_image(const std::vector<std::string>& names, ComputeCapability cc);

/// The device facts the runtime needs.
struct DeviceInfo {
  int ordinal = 0;
  ComputeCapability cc;
  std::string name;       ///< "sm_90"
  int max_smem_optin = 0; ///< per-block dynamic shared memory limit with opt-in
};

/// Finds device `ordinal`: NO_DEVICE when there is no usable GPU or driver, INVALID_ARGUMENT
/// for an ordinal out of range.
kiln_status* query_device(int ordinal, DeviceInfo* out);

}  // namespace kiln::rt
