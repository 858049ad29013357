// Reading ONNX protobuf files safely: models with import limits, TensorProtos, external data.
#include "onnx_tensor.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <climits>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string_view>
#include <type_traits>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

static_assert(std::endian::native == std::endian::little,
              "onnx raw_data is little-endian; this reader wraps it as is");

namespace kiln::onnx_fe {
namespace fs = std::filesystem;
namespace {

// ONNX TensorProto.DataType values (Debian's onnx 1.12 headers stop at BFLOAT16).
enum OnnxType : int {
  kFloat = 1, kUint8 = 2, kInt8 = 3, kUint16 = 4, kInt16 = 5, kInt32 = 6, kInt64 = 7,
  kString = 8, kBool = 9, kFloat16 = 10, kDouble = 11, kUint32 = 12, kUint64 = 13,
  kComplex64 = 14, kComplex128 = 15, kBfloat16 = 16, kF8E4M3FN = 17, kF8E4M3FNUZ = 18,
  kF8E5M2 = 19, kF8E5M2FNUZ = 20, kUint4 = 21, kInt4 = 22, kFloat4E2M1 = 23,
};

/// Bytes per element in ONNX's own little-endian layout (0 for packed 4-bit types).
int onnx_elem_bytes(int t) {
  switch (t) {
    case kUint8: case kInt8: case kBool: case kF8E4M3FN: case kF8E5M2: return 1;
    case kUint16: case kInt16: case kFloat16: case kBfloat16: return 2;
    case kFloat: case kInt32: case kUint32: return 4;
    case kInt64: case kDouble: case kUint64: return 8;
    default: return 0;
  }
}

bool is_packed4(int t) { return t == kUint4 || t == kInt4; }

/// Bytes of `numel` elements in ONNX's layout.
int64_t onnx_storage_bytes(int t, int64_t numel) {
  return is_packed4(t) ? (numel + 1) / 2 : numel * onnx_elem_bytes(t);
}

/// Whether ONNX bytes can be used as Kiln bytes unchanged.
bool same_layout(int t) {
  switch (t) {
    case kUint16: case kUint32: case kUint64: case kUint4: case kBool: return false;
    default: return true;
  }
}

StatusOr<int64_t> parse_decimal(const std::string& s, const std::string& what) {
  if (s.empty() || s.size() > 19) return invalid_argument(what + " is not a valid size: '" + s + "'");
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return invalid_argument(what + " is not a valid size: '" + s + "'");
    if (v > (std::numeric_limits<int64_t>::max() - (c - '0')) / 10)
      return invalid_argument(what + " overflows int64: '" + s + "'");
    v = v * 10 + (c - '0');
  }
  return v;
}

/// Converts ONNX bytes (`n` elements of ONNX type `t`) into a freshly allocated Kiln tensor,
/// widening unsigned types and normalizing bools.
StatusOr<Tensor> convert_bytes(int t, DType dt, std::vector<int64_t> shape, int64_t n,
                               const std::byte* src, const std::string& what) {
  Tensor out(dt, std::move(shape));
  if (n == 0) return out;
  auto load = [&](auto tag, int64_t i) {
    decltype(tag) v;
    std::memcpy(&v, src + i * static_cast<int64_t>(sizeof(v)), sizeof(v));
    return v;
  };
  switch (t) {
    case kUint16:
      for (int64_t i = 0; i < n; ++i) out.set_i64(i, load(uint16_t{}, i));
      break;
    case kUint32:
      for (int64_t i = 0; i < n; ++i) out.set_i64(i, load(uint32_t{}, i));
      break;
    case kUint64:
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t v = load(uint64_t{}, i);
        if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          return out_of_range(what + ": uint64 value " + std::to_string(v) +
                              " does not fit kiln's i64");
        out.set_i64(i, static_cast<int64_t>(v));
      }
      break;
    case kUint4:
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t b = static_cast<uint8_t>(src[i / 2]);
        out.set_i64(i, (i % 2 == 0) ? (b & 0xF) : (b >> 4));
      }
      break;
    case kBool:
      for (int64_t i = 0; i < n; ++i) out.set_i64(i, src[i] != std::byte{0} ? 1 : 0);
      break;
    default:
      std::memcpy(out.mutable_data(), src, static_cast<size_t>(onnx_storage_bytes(t, n)));
  }
  return out;
}

/// Turns a typed repeated field into ONNX little-endian bytes of type `t`.
template <typename Field>
std::string field_bytes(const Field& f, int t, int64_t n) {
  std::string bytes(static_cast<size_t>(onnx_storage_bytes(t, n)), '\0');
  const int eb = onnx_elem_bytes(t);
  for (int64_t i = 0; i < static_cast<int64_t>(f.size()); ++i) {
    const auto v = f.Get(static_cast<int>(i));
    if constexpr (std::is_floating_point_v<decltype(v)>) {
      if (t == kFloat) {
        const float x = static_cast<float>(v);
        std::memcpy(&bytes[static_cast<size_t>(i * eb)], &x, 4);
      } else {
        const double x = static_cast<double>(v);
        std::memcpy(&bytes[static_cast<size_t>(i * eb)], &x, 8);
      }
    } else if (is_packed4(t)) {
      bytes[static_cast<size_t>(i)] = static_cast<char>(v & 0xFF);
    } else {
      // Integers (and the bit patterns of 16- and 8-bit floats) keep their low `eb` bytes.
      const uint64_t u = static_cast<uint64_t>(v);
      std::memcpy(&bytes[static_cast<size_t>(i * eb)], &u, static_cast<size_t>(eb));
    }
  }
  return bytes;
}

struct ExternalRef {
  std::string location;
  int64_t offset = 0;
  int64_t length = -1;
};

StatusOr<ExternalRef> read_external_ref(const onnx::TensorProto& t, const std::string& what) {
  ExternalRef ref;
  bool has_location = false;
  for (const auto& kv : t.external_data()) {
    if (kv.key() == "location") {
      ref.location = kv.value();
      has_location = true;
    } else if (kv.key() == "offset") {
      KILN_ASSIGN_OR_RETURN(ref.offset, parse_decimal(kv.value(), what + ": external data offset"));
    } else if (kv.key() == "length") {
      KILN_ASSIGN_OR_RETURN(ref.length, parse_decimal(kv.value(), what + ": external data length"));
    } else if (kv.key() != "checksum") {
      return invalid_argument(what + ": unknown external data key '" + kv.key() + "'");
    }
  }
  if (!has_location || ref.location.empty())
    return invalid_argument(what + ": external data has no location");
  return ref;
}

/// Resolves an external data location inside `base_dir`, refusing anything that could leave
/// it: absolute paths, "..", and symbolic links whose target lies outside.
StatusOr<std::string> resolve_location(const std::string& base_dir, const std::string& location,
                                       const std::string& what) {
  const std::string where = what + ": external data location '" + location + "'";
  if (location.find('\0') != std::string::npos) return invalid_argument(where + " contains a nul byte");
  if (location[0] == '/' || location[0] == '\\' ||
      (location.size() > 1 && location[1] == ':'))
    return invalid_argument(where + " is an absolute path");
  size_t start = 0;
  while (start <= location.size()) {
    size_t end = location.find_first_of("/\\", start);
    if (end == std::string::npos) end = location.size();
    if (location.compare(start, end - start, "..") == 0 && end - start == 2)
      return invalid_argument(where + " contains '..'");
    start = end + 1;
  }
  std::error_code ec;
  const fs::path base = fs::canonical(base_dir, ec);
  if (ec) return io_error(what + ": cannot resolve the model folder '" + base_dir + "'");
  const fs::path full = fs::canonical(base / location, ec);
  if (ec) return not_found(where + " does not exist");
  const std::string b = base.string(), f = full.string();
  if (f.size() <= b.size() || f.compare(0, b.size(), b) != 0 || f[b.size()] != '/')
    return invalid_argument(where + " resolves outside the model folder (to '" + f + "')");
  return f;
}

}  // namespace

std::string onnx_type_name(int t) {
  static const char* const names[] = {
      "UNDEFINED", "FLOAT", "UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "STRING",
      "BOOL", "FLOAT16", "DOUBLE", "UINT32", "UINT64", "COMPLEX64", "COMPLEX128", "BFLOAT16",
      "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "UINT4", "INT4",
      "FLOAT4E2M1"};
  if (t >= 0 && t < static_cast<int>(std::size(names))) return names[t];
  return "type " + std::to_string(t);
}

StatusOr<DType> kiln_dtype(int t, const std::string& what) {
  switch (t) {
    case kFloat: return DType::kF32;
    case kUint8: return DType::kU8;
    case kInt8: return DType::kI8;
    case kUint16: return DType::kI32;
    case kInt16: return DType::kI16;
    case kInt32: return DType::kI32;
    case kInt64: return DType::kI64;
    case kBool: return DType::kBool;
    case kFloat16: return DType::kF16;
    case kDouble: return DType::kF64;
    case kUint32: return DType::kI64;
    case kUint64: return DType::kI64;
    case kBfloat16: return DType::kBF16;
    case kF8E4M3FN: return DType::kF8E4M3FN;
    case kF8E5M2: return DType::kF8E5M2;
    case kUint4: return DType::kU8;
    case kInt4: return DType::kI4;
    default:
      return unimplemented(what + " has element type " + onnx_type_name(t) +
                           ", which kiln does not support");
  }
}

StatusOr<int64_t> checked_numel(const std::vector<int64_t>& dims, const std::string& what) {
  int64_t n = 1;
  for (int64_t d : dims) {
    if (d < 0) return invalid_argument(what + " has negative dim " + std::to_string(d));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d)
      return out_of_range(what + ": element count of shape " + shape_str(shape_of(dims)) +
                          " overflows int64");
    n *= d;
  }
  return n;
}

StatusOr<std::shared_ptr<const std::byte>> MappedFiles::map_model(const std::string& path, int64_t& size) {
  return map_file(path, size, false);
}

StatusOr<std::shared_ptr<const std::byte>> MappedFiles::map(const std::string& path, int64_t& size) {
  return map_file(path, size, true);
}

StatusOr<std::shared_ptr<const std::byte>> MappedFiles::map_file(const std::string& path, int64_t& size,
                                                                 bool external) {
  if (auto it = files_.find(path); it != files_.end()) {
    size = it->second.size;
    return it->second.base;
  }
  const std::string what = external ? "external data file '" + path + "'" : "onnx model '" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (external ? O_NOFOLLOW : 0));
  if (fd < 0) return io_error("cannot open " + what + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(what + " is not a regular file");
  }
  // A second name for the same bytes may live anywhere on the file system: a hard link is
  // how a file outside the model folder gets smuggled in (CVE-2026-34446 pattern).
  if (external && st.st_nlink > 1) {
    ::close(fd);
    return invalid_argument(what + " has " + std::to_string(st.st_nlink) +
                            " hard links; kiln refuses hard-linked external data");
  }
  Entry e;
  e.size = static_cast<int64_t>(st.st_size);
  if (e.size > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(e.size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return io_error("cannot map " + what + ": " + std::strerror(errno));
    }
    const size_t len = static_cast<size_t>(e.size);
    e.base = std::shared_ptr<const std::byte>(static_cast<const std::byte*>(p),
                                              [len](const std::byte* q) {
                                                ::munmap(const_cast<std::byte*>(q), len);
                                              });
  } else {
    e.base = std::make_shared<const std::byte>();
  }
  ::close(fd);
  size = e.size;
  files_[path] = e;
  return e.base;
}

StatusOr<Tensor> tensor_from_proto(const onnx::TensorProto& t, const TensorSource& src,
                                   const std::string& what) {
  const int type = t.data_type();
  KILN_ASSIGN_OR_RETURN(DType dt, kiln_dtype(type, what));
  if (t.dims_size() > src.limits.max_rank)
    return out_of_range(what + " has rank " + std::to_string(t.dims_size()) +
                        ", above the limit of " + std::to_string(src.limits.max_rank));
  if (t.has_segment()) return unimplemented(what + " is segmented, which kiln does not support");
  std::vector<int64_t> dims(t.dims().begin(), t.dims().end());
  KILN_ASSIGN_OR_RETURN(int64_t n, checked_numel(dims, what));
  if (!is_packed4(type) && n > std::numeric_limits<int64_t>::max() / 8)
    return out_of_range(what + ": shape " + shape_str(shape_of(dims)) + " is too large");
  const int64_t onnx_bytes = onnx_storage_bytes(type, n);
  const int64_t kiln_bytes = dtype_storage_bytes(dt, n);
  if (std::max(onnx_bytes, kiln_bytes) > src.limits.max_tensor_bytes)
    return out_of_range(what + ": " + std::to_string(std::max(onnx_bytes, kiln_bytes)) +
                        " bytes exceed the tensor limit of " +
                        std::to_string(src.limits.max_tensor_bytes));

  // Wraps `bytes` (owned by `owner`) when the layout matches, else converts into new storage.
  auto from_bytes = [&](const std::byte* bytes, std::shared_ptr<const void> owner) -> StatusOr<Tensor> {
    if (same_layout(type) && owner) return Tensor::wrap(dt, dims, bytes, std::move(owner));
    return convert_bytes(type, dt, dims, n, bytes, what);
  };

  if (t.data_location() == onnx::TensorProto_DataLocation_EXTERNAL) {
    if (src.base_dir.empty() || src.mapped == nullptr)
      return invalid_argument(what + " uses external data, which is not allowed here");
    KILN_ASSIGN_OR_RETURN(ExternalRef ref, read_external_ref(t, what));
    KILN_ASSIGN_OR_RETURN(std::string path, resolve_location(src.base_dir, ref.location, what));
    int64_t size = 0;
    auto base = src.mapped->map(path, size);
    if (!base.ok()) return base.status().with_context(what);
    if (ref.offset > size)
      return out_of_range(what + ": external data offset " + std::to_string(ref.offset) +
                          " is past the end of '" + ref.location + "' (" + std::to_string(size) +
                          " bytes)");
    const int64_t length = ref.length < 0 ? size - ref.offset : ref.length;
    if (length > size - ref.offset)
      return out_of_range(what + ": external data range [" + std::to_string(ref.offset) + ", +" +
                          std::to_string(length) + ") runs past the end of '" + ref.location +
                          "' (" + std::to_string(size) + " bytes)");
    if (length != onnx_bytes)
      return invalid_argument(what + ": external data length " + std::to_string(length) +
                              " does not match the " + std::to_string(onnx_bytes) +
                              " bytes of shape " + shape_str(shape_of(dims)));
    const std::byte* p = base->get() + ref.offset;
    return from_bytes(p, std::shared_ptr<const void>(*base, p));
  }

  if (t.has_raw_data()) {
    const std::string& raw = t.raw_data();
    if (static_cast<int64_t>(raw.size()) != onnx_bytes)
      return invalid_argument(what + ": raw_data has " + std::to_string(raw.size()) +
                              " bytes, shape " + shape_str(shape_of(dims)) + " of " +
                              onnx_type_name(type) + " needs " + std::to_string(onnx_bytes));
    const std::byte* p = reinterpret_cast<const std::byte*>(raw.data());
    return from_bytes(p, src.owner ? std::shared_ptr<const void>(src.owner, p) : nullptr);
  }

  // Typed fields: check the count first, so that a short field cannot be read past its end.
  auto typed = [&](const auto& field, int64_t want) -> StatusOr<Tensor> {
    if (static_cast<int64_t>(field.size()) != want)
      return invalid_argument(what + " has " + std::to_string(field.size()) +
                              " values, shape " + shape_str(shape_of(dims)) + " needs " +
                              std::to_string(want));
    const std::string bytes = field_bytes(field, type, n);
    return convert_bytes(type, dt, dims, n, reinterpret_cast<const std::byte*>(bytes.data()), what);
  };
  switch (type) {
    case kFloat: return typed(t.float_data(), n);
    case kDouble: return typed(t.double_data(), n);
    case kInt64: return typed(t.int64_data(), n);
    case kUint32: case kUint64: return typed(t.uint64_data(), n);
    case kUint4: case kInt4: return typed(t.int32_data(), (n + 1) / 2);
    default: return typed(t.int32_data(), n);
  }
}

namespace {

/// Reads a whole file into memory, refusing ones protobuf cannot parse (2 GiB and above).
StatusOr<std::string> read_file(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found(what + " '" + path + "' cannot be opened: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(what + " '" + path + "' is not a regular file");
  }
  if (st.st_size >= INT_MAX) {
    ::close(fd);
    return out_of_range(what + " '" + path + "' is " + std::to_string(st.st_size) +
                        " bytes; protobuf files must be under 2 GiB (use external data)");
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (r <= 0) {
      ::close(fd);
      return io_error("cannot read " + what + " '" + path + "'");
    }
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  return bytes;
}

template <typename Message>
bool parse_bounded(Message& m, std::string_view bytes) {
  google::protobuf::io::ArrayInputStream in(bytes.data(), static_cast<int>(bytes.size()));
  google::protobuf::io::CodedInputStream coded(&in);
  coded.SetRecursionLimit(100);
  return m.ParseFromCodedStream(&coded) && coded.ConsumedEntireMessage();
}

}  // namespace

StatusOr<TensorFile> read_tensor_file(const std::string& path, const ImportLimits& limits) {
  KILN_ASSIGN_OR_RETURN(std::string bytes, read_file(path, "tensor file"));
  auto proto = std::make_shared<onnx::TensorProto>();
  if (!parse_bounded(*proto, bytes))
    return invalid_argument("tensor file '" + path + "' is not a valid TensorProto");
  TensorSource src;
  src.owner = proto;
  src.limits = limits;
  KILN_ASSIGN_OR_RETURN(Tensor t, tensor_from_proto(*proto, src, "tensor file '" + path + "'"));
  return TensorFile{proto, std::move(t)};
}

StatusOr<std::shared_ptr<onnx::ModelProto>> read_model_file(const std::string& path,
                                                            const ImportLimits& limits) {
  (void)limits;
  // Parsed straight from a read-only mapping: the only copy of the weights is the one
  // protobuf makes, which the importer's tensors then wrap.
  MappedFiles files;
  int64_t size = 0;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return not_found("onnx model '" + path + "' does not exist or is not a regular file");
  auto mapped = files.map_model(path, size);
  if (!mapped.ok()) return mapped.status();
  if (size == 0) return invalid_argument("onnx model '" + path + "' is empty");
  if (size >= INT_MAX)
    return out_of_range("onnx model '" + path + "' is " + std::to_string(size) +
                        " bytes; protobuf files must be under 2 GiB (use external data)");
  const std::string_view bytes(reinterpret_cast<const char*>(mapped->get()), static_cast<size_t>(size));
  auto model = std::make_shared<onnx::ModelProto>();
  if (!parse_bounded(*model, bytes))
    return invalid_argument("onnx model '" + path +
                            "' cannot be parsed: truncated, corrupt or not an onnx file");
  if (!model->has_ir_version())
    return invalid_argument("onnx model '" + path + "' has no ir_version: not an onnx model");
  if (model->ir_version() < 3 || model->ir_version() > 10)
    return unimplemented("onnx model '" + path + "' has ir_version " +
                         std::to_string(model->ir_version()) + "; kiln reads 3 to 10");
  if (!model->has_graph()) return invalid_argument("onnx model '" + path + "' has no graph");
  if (model->opset_import_size() == 0)
    return invalid_argument("onnx model '" + path + "' declares no opset_import");
  return model;
}

}  // namespace kiln::onnx_fe
