// The CUDA backend shared by every NVIDIA generation; each plugin registers it with its own
// capability table.
#pragma once

#include "kiln/core/registry.h"
#include "kiln/cuda/lowering.h"

namespace kiln::cuda {

/// Registers a backend named caps.plugin with options allow-tf32 (and -matmul, -conv), autotune,
/// keep-source, conv, depthwise, conv1x1, images and int4-exact-zeros.
Status register_backend(Registry& r, const Capabilities& caps);

/// How a backend with these capabilities and (resolved) options lowers graphs.
LoweringOptions lowering_options(const Capabilities& caps, const Options& o);

}  // namespace kiln::cuda
