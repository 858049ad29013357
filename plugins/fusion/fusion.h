// Private to the kiln-fusion plugin: the factories of the passes it registers.
#pragma once

#include "kiln/core/registry.h"
#include "kiln/ir/graph.h"
#include "kiln/ir/op.h"

namespace kiln::fusion {

/// Registry entry of fuse-pointwise (registered by register.cpp).
PassInfo fuse_pointwise_pass_info();

}  // namespace kiln::fusion
