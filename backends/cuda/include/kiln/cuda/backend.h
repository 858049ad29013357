// The CUDA backend shared by every NVIDIA generation; each plugin registers it with its own
// capability table.
#pragma once

#include "kiln/core/registry.h"
#include "kiln/cuda/lowering.h"

namespace kiln::cuda {

/// Registers a backend named caps.plugin with options allow-tf32, autotune, keep-source, conv,
/// images and int4-exact-zeros.
Status register_backend(Registry& r, const Capabilities& caps);

}  // namespace kiln::cuda
