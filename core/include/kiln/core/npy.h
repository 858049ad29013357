// Reading and writing NumPy .npy files for every Kiln dtype.
//
// NumPy has no bf16, f8 or i4. Kiln writes bf16/f8e4m3fn/f8e5m2 as '<f4' and i4 as '|i1'
// (exact widening). When reading into a tensor of such a dtype, values are narrowed (round
// to nearest even for floats; out-of-range ints are an error).
#pragma once

#include <optional>
#include <string>

#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

/// Reads a .npy file (little- or big-endian, C order; Fortran order is refused). When `want`
/// is given the data is converted to that dtype.
StatusOr<Tensor> read_npy(const std::string& path, std::optional<DType> want = std::nullopt);
StatusOr<Tensor> parse_npy(std::string_view bytes, const std::string& name,
                           std::optional<DType> want = std::nullopt);
Status write_npy(const std::string& path, const Tensor& t);
std::string serialize_npy(const Tensor& t);

}  // namespace kiln
