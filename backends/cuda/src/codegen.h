// Helpers for writing CUDA C++: dtype spellings, literals, index arithmetic, the prelude.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kiln/ir/dtype.h"

namespace kiln::cuda {

using Sizes = std::vector<int64_t>;

/// The C++ type a dtype is stored as in device memory; nullopt when the lowering cannot hold it.
std::optional<std::string> storage_type(DType t);
/// The type arithmetic on a dtype happens in (float for f16/bf16, long long for integers);
/// nullopt when the lowering computes nothing in that dtype.
std::optional<std::string> reg_type(DType t);
/// Reads storage `expr` into the register type, and back.
std::string load_expr(DType t, const std::string& expr);
std::string store_expr(DType t, const std::string& expr);
/// Rounds a register value to what the dtype can hold (f16, bf16, narrow integers).
std::string round_expr(DType t, const std::string& expr);
/// `x / scale` of a quantize to f8, an f32 division as the reference computes it (an f64 `x`,
/// of dtype `xt`, is converted first); store_expr of the f8 dtype then rounds it.
std::string quantize_quotient(DType xt, const std::string& x, const std::string& scale);
/// A literal of the register type of `t`.
std::string literal(DType t, double v);
std::string int_literal(int64_t v);
/// The unsigned type (or CUDA vector type) that moves `bytes` (1, 2, 4, 8 or 16) in one access.
std::string vector_type(int64_t bytes);

int64_t product(const Sizes& s);
Sizes contiguous_strides(const Sizes& s);
/// "4x784", or "scalar" for rank 0.
std::string dims_text(const Sizes& s);

/// Code computing `names[k] = bases[k] + sum_d c_d * strides[k][d]` for the row-major
/// multi-index c of `idx` over `dims` (declares the `names` as long long).
std::string index_code(const std::string& idx, const Sizes& dims, const std::vector<Sizes>& strides,
                       const std::vector<std::string>& names, const Sizes& bases = {});

/// Strides of `in` broadcast (numpy, right-aligned) against `out`: 0 on broadcast dims.
Sizes broadcast_strides(const Sizes& in, const Sizes& out);

/// Device helpers every generated file starts with.
std::string prelude(bool fp16, bool bf16);

}  // namespace kiln::cuda
