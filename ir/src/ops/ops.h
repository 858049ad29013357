// Registration entry points of the core op set, one per file in ir/src/ops/.
#pragma once

#include "kiln/ir/op.h"

namespace kiln {

void register_elementwise_ops(OpRegistry& r);  ///< elementwise.cpp: unary, binary, compare, logical, cast, where, clip
void register_reduction_ops(OpRegistry& r);    ///< reduction.cpp: reduce_*, arg*, softmax, log_softmax
void register_creation_ops(OpRegistry& r);     ///< creation.cpp: constant, range
void register_linalg_ops(OpRegistry& r);       ///< linalg.cpp: matmul, linear, conv, pooling
void register_norm_ops(OpRegistry& r);         ///< norm.cpp: layer_norm, rms_norm, batch_norm
void register_shape_ops(OpRegistry& r);        ///< shape.cpp: reshape, transpose, slice, concat, split, gather, expand, pad, ...
void register_structural_ops(OpRegistry& r);   ///< structural.cpp: fused
void register_attention_ops(OpRegistry& r);    ///< attention.cpp: attention
void register_int4_ops(OpRegistry& r);         ///< int4.cpp: matmul_int4 (packed 4-bit weights)
void register_quant_ops(OpRegistry& r);        ///< quant.cpp: quantize, dequantize, scaled_matmul, amax (FP8)
void register_state_ops(OpRegistry& r);        ///< state.cpp: variable, assign (persistent state)
void register_collective_ops(OpRegistry& r);   ///< collective.cpp: all_reduce, all_gather, ..., send, recv
void register_loss_ops(OpRegistry& r);         ///< loss.cpp: cross_entropy, cross_entropy_grad, cross_entropy_with_grad, mse_loss
/// Graph-wide checks of variable/assign (state.cpp): unique names, one assign per variable with
/// its type, none inside regions. Run by verify() on a top-level graph.
Status verify_state(const Graph& g);

}  // namespace kiln
