// A small NVRTC driver: compiles generated CUDA C++ to a cubin or PTX, through the kernel cache.
#pragma once

#include <string>

#include "kiln/core/kernel_cache.h"
#include "kiln/ir/status.h"

namespace kiln::cuda {

/// "13.0"
std::string nvrtc_version();
/// The CUDA include folder: $KILN_CUDA_INCLUDE, else the toolkit's found at configure time.
std::string cuda_include_dir();
/// "cubin" for "sm_XX[a]" targets, "ptx" for "compute_XX[a]".
std::string image_form(const std::string& target);

/// The kernel cache key of compiling `source` for `target`: the source (and with it every
/// option that changed the generated code), the target, NVRTC's version and options, `producer`.
KernelCacheKey nvrtc_cache_key(const std::string& source, const std::string& target,
                               const std::string& producer);

/// Compiles `source` for `target` ("sm_90a" gives a cubin, "compute_90" PTX). Results are
/// cached in the kernel cache (keyed by source, target, NVRTC version, options and
/// `producer`); `cache_hit`, when given, says whether this call was served from it.
/// On failure the status names the target and carries the NVRTC log.
StatusOr<std::string> compile_cuda(const std::string& source, const std::string& target,
                                   const std::string& producer, bool* cache_hit = nullptr);

}  // namespace kiln::cuda
