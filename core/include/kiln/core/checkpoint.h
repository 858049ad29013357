// Training checkpoints: named tensors (weights, optimizer state, the step count) in one
// checksummed file.
//
// Layout (little-endian): "KILNCKPT", u32 version (1), u32 entry count, then per entry u32 name
// length, the name, u8 dtype (kiln::DType), u64 length and a .npy image of the tensor; last a u64
// FNV-1a hash of every byte before it.
#pragma once

#include <map>
#include <string>

#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln {

/// Writes `tensors` to `path` (through a temporary file renamed into place).
Status write_checkpoint(const std::string& path, const std::map<std::string, Tensor>& tensors);
/// Reads a checkpoint; a truncated or altered file is an error naming the file.
StatusOr<std::map<std::string, Tensor>> read_checkpoint(const std::string& path);

}  // namespace kiln
