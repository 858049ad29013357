// Reading ONNX protobuf files safely: models with import limits, TensorProtos, external data.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <onnx/onnx_pb.h>

#include "kiln/ir/status.h"
#include "kiln/ir/tensor.h"

namespace kiln::onnx_fe {

/// Caps that turn hostile files into errors instead of exhausted memory or overflow.
struct ImportLimits {
  int64_t max_tensor_bytes = int64_t{1} << 34;  ///< one tensor's bytes (16 GiB)
  int64_t max_rank = 32;
  int64_t max_nodes = 1'000'000;                ///< nodes in the model, subgraphs included
  int64_t max_nesting = 16;                     ///< subgraph depth (If/Loop/Scan bodies)
  int64_t max_unroll = 4096;                    ///< Loop/Scan iterations unrolled at import
};

/// The Kiln dtype of an ONNX TensorProto data type. Unsigned types Kiln lacks are widened to
/// a signed type that holds every value (uint16 → i32, uint32 → i64, uint4 → u8); uint64
/// becomes i64 and values above 2^63 - 1 are refused where they are seen (initializers).
/// `what` names the thing in the error ("input 'x'").
StatusOr<DType> kiln_dtype(int onnx_type, const std::string& what);
/// "FLOAT", "UINT16", ... ("type 99" when unknown).
std::string onnx_type_name(int onnx_type);

/// Memory maps of external data files, shared by every tensor that points into them.
class MappedFiles {
 public:
  /// An external data file, mapped read-only; the map lives as long as any tensor wrapping
  /// it. Refuses anything but a regular file with a single link.
  StatusOr<std::shared_ptr<const std::byte>> map(const std::string& canonical_path, int64_t& size);
  /// A model file, mapped read-only for parsing.
  StatusOr<std::shared_ptr<const std::byte>> map_model(const std::string& path, int64_t& size);

 private:
  StatusOr<std::shared_ptr<const std::byte>> map_file(const std::string& path, int64_t& size, bool external);
  struct Entry {
    std::shared_ptr<const std::byte> base;
    int64_t size = 0;
  };
  std::map<std::string, Entry> files_;
};

/// Where tensors' bytes come from and how much is allowed.
struct TensorSource {
  /// The folder external data must stay inside ("" = external data refused).
  std::string base_dir;
  /// Keeps protobuf-owned raw_data alive for tensors that wrap it without copying
  /// (null: always copy).
  std::shared_ptr<const void> owner;
  MappedFiles* mapped = nullptr;  ///< required when base_dir is set
  ImportLimits limits;
};

/// Converts a TensorProto (raw_data, typed fields or external data) into a Tensor. raw_data
/// and external data are wrapped without copying when the dtype needs no widening.
/// `what` names the tensor in errors ("initializer 'w'").
StatusOr<Tensor> tensor_from_proto(const onnx::TensorProto& t, const TensorSource& src,
                                   const std::string& what);

/// A TensorProto read from its own file, and the tensor wrapping its bytes.
struct TensorFile {
  std::shared_ptr<onnx::TensorProto> proto;
  Tensor tensor;
};

/// Reads a serialized TensorProto file (the conformance suite's input_0.pb, ...).
StatusOr<TensorFile> read_tensor_file(const std::string& path, const ImportLimits& limits);

/// Checked product of dims; an error naming `what` when it overflows int64 or a dim is
/// negative.
StatusOr<int64_t> checked_numel(const std::vector<int64_t>& dims, const std::string& what);

/// Parses a model file: size and recursion limits, IR version 3 to 10, a graph, opsets.
StatusOr<std::shared_ptr<onnx::ModelProto>> read_model_file(const std::string& path,
                                                             const ImportLimits& limits);

}  // namespace kiln::onnx_fe
