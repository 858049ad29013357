// The NVRTC driver: one compile of generated source for one target, cached on disk.
#include "kiln/cuda/nvrtc.h"

#include <nvrtc.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "kiln/core/kernel_cache.h"

namespace kiln::cuda {

std::string nvrtc_version() {
  int major = 0, minor = 0;
  if (nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) return "unknown";
  return std::to_string(major) + "." + std::to_string(minor);
}

std::string cuda_include_dir() {
  const char* env = std::getenv("KILN_CUDA_INCLUDE");
  return env != nullptr && *env != '\0' ? env : KILN_CUDA_INCLUDE_DIR;
}

std::string image_form(const std::string& target) {
  return target.rfind("compute_", 0) == 0 ? "ptx" : "cubin";
}

KernelCacheKey nvrtc_cache_key(const std::string& source, const std::string& target,
                               const std::string& producer) {
  return KernelCacheKey{
      source,
      target,
      "nvrtc " + nvrtc_version(),
      {"--gpu-architecture=" + target, "--include-path=" + cuda_include_dir(), "--std=c++17"},
      producer};
}

StatusOr<std::string> compile_cuda(const std::string& source, const std::string& target,
                                   const std::string& producer, bool* cache_hit) {
  const bool ptx = image_form(target) == "ptx";
  if (!ptx && target.rfind("sm_", 0) != 0)
    return invalid_argument("nvrtc: unknown target '" + target + "' (expected sm_XX or compute_XX)");
  const KernelCacheKey key = nvrtc_cache_key(source, target, producer);
  const std::vector<std::string>& options = key.options;
  KernelCache cache;
  if (cache_hit != nullptr) *cache_hit = false;
  if (std::optional<std::string> hit = cache.lookup(key)) {
    if (cache_hit != nullptr) *cache_hit = true;
    return *hit;
  }

  nvrtcProgram prog = nullptr;
  if (nvrtcCreateProgram(&prog, source.c_str(), "kiln.cu", 0, nullptr, nullptr) != NVRTC_SUCCESS)
    return internal_error("nvrtc: cannot create a program for " + target);
  std::unique_ptr<nvrtcProgram, void (*)(nvrtcProgram*)> guard(&prog, [](nvrtcProgram* p) {
    nvrtcDestroyProgram(p);
  });
  std::vector<const char*> argv;
  for (const std::string& o : options) argv.push_back(o.c_str());
  const nvrtcResult rc = nvrtcCompileProgram(prog, static_cast<int>(argv.size()), argv.data());
  if (rc != NVRTC_SUCCESS) {
    size_t n = 0;
    nvrtcGetProgramLogSize(prog, &n);
    std::string log(n, '\0');
    if (n > 0) nvrtcGetProgramLog(prog, log.data());
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
    return internal_error("nvrtc: compiling for " + target + " failed (" +
                          nvrtcGetErrorString(rc) + "):\n" + log);
  }
  size_t n = 0;
  std::string image;
  if (ptx) {
    nvrtcGetPTXSize(prog, &n);
    image.resize(n);
    nvrtcGetPTX(prog, image.data());
    while (!image.empty() && image.back() == '\0') image.pop_back();
  } else {
    nvrtcGetCUBINSize(prog, &n);
    image.resize(n);
    nvrtcGetCUBIN(prog, image.data());
  }
  if (image.empty()) return internal_error("nvrtc: empty " + image_form(target) + " for " + target);
  (void)cache.store(key, image);  // a cache that cannot be written only costs time
  return image;
}

}  // namespace kiln::cuda
