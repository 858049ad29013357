// Device discovery (cudart) and kernel image selection.
#include "device.h"

#include <algorithm>
#include <cctype>

namespace kiln::rt {

std::string device_name(ComputeCapability cc) {
  return "sm_" + std::to_string(cc.major * 10 + cc.minor);
}

bool parse_image_name(const std::string& name, ImageTarget* out) {
  size_t dot = name.rfind('.');
  if (dot == std::string::npos) return false;
  std::string target = name.substr(0, dot), form = name.substr(dot + 1);
  ImageTarget t;
  std::string digits;
  if (target.rfind("sm_", 0) == 0 && form == "cubin") {
    t.sass = true;
    digits = target.substr(3);
  } else if (target.rfind("compute_", 0) == 0 && form == "ptx") {
    digits = target.substr(8);
  } else {
    return false;
  }
  if (!digits.empty() && (digits.back() == 'a' || digits.back() == 'f')) {
    t.suffix = digits.back();
    digits.pop_back();
  }
  if (digits.size() < 2 || digits.size() > 4 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(c); }))
    return false;
  int v = std::stoi(digits);
  t.cc = {v / 10, v % 10};
  t.target = target;
  *out = t;
  return true;
}

bool image_runs_on(const ImageTarget& image, ComputeCapability cc) {
  bool same = image.cc.major == cc.major && image.cc.minor == cc.minor;
  if (image.suffix == 'a') return same;
  if (image.sass || image.suffix == 'f') return image.cc.major == cc.major && image.cc.minor <= cc.minor;
  return image.cc.major < cc.major || (image.cc.major == cc.major && image.cc.minor <= cc.minor);
}

ImageChoice select_image(const std::vector<std::string>& names, ComputeCapability cc) {
  // Rank: exact SASS (arch-specific first), same-major SASS by minor, then PTX by version
  // (exact arch-specific first). Larger is better.
  auto rank = [&](const ImageTarget& t) {
    int version = t.cc.major * 10 + t.cc.minor;
    bool exact = t.cc.major == cc.major && t.cc.minor == cc.minor;
    int tier = t.sass ? (exact ? 3 : 2) : 1;
    return tier * 100000 + version * 10 + (t.suffix == 'a' ? 2 : t.suffix == 'f' ? 1 : 0);
  };
  ImageChoice choice;
  int best = -1;
  std::vector<std::pair<int, std::string>> targets;  // (version, target) for the message
  for (const std::string& name : names) {
    ImageTarget t;
    if (!parse_image_name(name, &t)) continue;
    int version = t.cc.major * 10 + t.cc.minor;
    if (std::find(targets.begin(), targets.end(), std::pair{version, t.target}) == targets.end())
      targets.emplace_back(version, t.target);
    if (image_runs_on(t, cc) && rank(t) > best) {
      best = rank(t);
      choice.image = name;
    }
  }
  if (!choice.image.empty()) return choice;
  std::sort(targets.begin(), targets.end());
  std::string list;
  for (const auto& [version, target] : targets) list += (list.empty() ? "" : ", ") + target;
  choice.error = (list.empty() ? std::string("artifact has no kernel images")
                               : "artifact has " + list) +
                 "; device is " + device_name(cc);
  return choice;
}

kiln_status* query_device(int ordinal, DeviceInfo* out) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    (void)cudaGetLastError();
    return make_status(KILN_STATUS_NO_DEVICE, std::string("no CUDA device: cudaGetDeviceCount "
                                                          "returned ") +
                                                  cudaGetErrorName(err) + " (" +
                                                  cudaGetErrorString(err) + ")");
  }
  KILN_RT_TRY(cuda_status(err, "cudaGetDeviceCount"));
  if (count == 0) return make_status(KILN_STATUS_NO_DEVICE, "no CUDA device: none found");
  if (ordinal < 0 || ordinal >= count)
    return make_status(KILN_STATUS_INVALID_ARGUMENT,
                       "device_ordinal " + std::to_string(ordinal) + " out of range: " +
                           std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s"));
  DeviceInfo info;
  info.ordinal = ordinal;
  KILN_CUDA_TRY(cudaSetDevice(ordinal));
  KILN_CUDA_TRY(cudaDeviceGetAttribute(&info.cc.major, cudaDevAttrComputeCapabilityMajor, ordinal));
  KILN_CUDA_TRY(cudaDeviceGetAttribute(&info.cc.minor, cudaDevAttrComputeCapabilityMinor, ordinal));
  KILN_CUDA_TRY(cudaDeviceGetAttribute(&info.max_smem_optin,
                                       cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal));
  info.name = device_name(info.cc);
  *out = info;
  return nullptr;
}

}  // namespace kiln::rt
