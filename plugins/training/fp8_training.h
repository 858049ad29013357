// Private to the kiln-training plugin: FP8 training with delayed scaling (fp8_training.cpp): the
// recipe, the state update both the forward and the backward build, and the FP8 ops' rules.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../quantize/delayed_scaling.h"
#include "autodiff.h"

namespace kiln::training {

/// The op fp8-training puts after each FP8 GEMM: the identity in the forward, whose gradient
/// rule quantizes the gradient (autodiff removes it once the backward is built).
inline constexpr const char* kQuantizeGradOp = "quantize_grad";

/// Registers quantize_grad (idempotent).
Status register_fp8_training_ops();

/// Adds the delayed-scaling update of `x`'s state (build_delayed_scaling with a Builder): rolls
/// amax(x) into variable `history_name` (made here) and assigns the next scale to the variable
/// `scale` reads. Returns the scale x is quantized with this step; throws BuildError.
Value* delayed_scale_update(Builder& b, Value* x, Value* scale, const std::string& history_name,
                            const DelayedScaling& recipe, DType format);

std::vector<Value*> quantize_grad_rule(GradContext& c);
std::vector<Value*> quantize_rule(GradContext& c);
std::vector<Value*> requantize_rule(GradContext& c);
std::vector<Value*> dequantize_rule(GradContext& c);
std::vector<Value*> scaled_matmul_rule(GradContext& c);

}  // namespace kiln::training
