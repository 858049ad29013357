// NumPy .npy reading and writing (format versions 1.0, 2.0 and 3.0) for every Kiln dtype.
#include "kiln/core/npy.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

namespace kiln {

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
/// NumPy itself refuses headers above 10000 bytes by default; anything near this is garbage.
constexpr size_t kMaxHeaderBytes = 1 << 16;

/// An element type as stored in the file. NumPy's unsigned 16/32/64-bit types have no Kiln
/// dtype; they are read into the smallest signed type holding them (or converted to `want`).
struct FileType {
  DType dtype;
  int itemsize;
  bool big_endian = false;
  bool unsigned_wide = false;  ///< u2/u4/u8 held in dtype (i32/i64/i64)
};

Status npy_error(const std::string& name, const std::string& msg) {
  return invalid_argument("npy " + name + ": " + msg);
}

StatusOr<FileType> parse_descr(const std::string& descr, const std::string& name) {
  if (descr.size() < 3) return npy_error(name, "unsupported dtype '" + descr + "'");
  const char order = descr[0];
  if (order != '<' && order != '>' && order != '|' && order != '=')
    return npy_error(name, "unsupported dtype '" + descr + "'");
  const std::string kind = descr.substr(1);
  FileType t{DType::kF32, 0, order == '>' || (order == '=' && std::endian::native == std::endian::big)};
  if (kind == "f8") t = {DType::kF64, 8, t.big_endian};
  else if (kind == "f4") t = {DType::kF32, 4, t.big_endian};
  else if (kind == "f2") t = {DType::kF16, 2, t.big_endian};
  else if (kind == "i8") t = {DType::kI64, 8, t.big_endian};
  else if (kind == "i4") t = {DType::kI32, 4, t.big_endian};
  else if (kind == "i2") t = {DType::kI16, 2, t.big_endian};
  else if (kind == "i1") t = {DType::kI8, 1, false};
  else if (kind == "u1") t = {DType::kU8, 1, false};
  else if (kind == "b1") t = {DType::kBool, 1, false};
  else if (kind == "u2") t = {DType::kI32, 2, t.big_endian, true};
  else if (kind == "u4") t = {DType::kI64, 4, t.big_endian, true};
  else if (kind == "u8") t = {DType::kI64, 8, t.big_endian, true};
  else return npy_error(name, "unsupported dtype '" + descr + "'");
  return t;
}

/// The header is a Python dict literal: {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& name) : s_(text), name_(name) {}

  Status parse(std::string& descr, bool& fortran, std::vector<int64_t>& shape) {
    bool have_descr = false, have_fortran = false, have_shape = false;
    skip();
    if (!eat('{')) return fail("expected '{'");
    for (;;) {
      skip();
      if (eat('}')) break;
      std::string key;
      KILN_RETURN_IF_ERROR(string_literal(key));
      skip();
      if (!eat(':')) return fail("expected ':' after '" + key + "'");
      skip();
      if (key == "descr") {
        if (peek() == '[') return fail("structured dtypes are not supported");
        KILN_RETURN_IF_ERROR(string_literal(descr));
        have_descr = true;
      } else if (key == "fortran_order") {
        if (word("True")) fortran = true;
        else if (word("False")) fortran = false;
        else return fail("fortran_order must be True or False");
        have_fortran = true;
      } else if (key == "shape") {
        KILN_RETURN_IF_ERROR(tuple(shape));
        have_shape = true;
      } else {
        return fail("unknown header key '" + key + "'");
      }
      skip();
      if (eat(',')) continue;
      skip();
      if (eat('}')) break;
      return fail("expected ',' or '}'");
    }
    if (!have_descr || !have_fortran || !have_shape)
      return npy_error(name_, "header lacks " + std::string(!have_descr ? "'descr'" : !have_fortran ? "'fortran_order'" : "'shape'"));
    return ok_status();
  }

 private:
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  bool eat(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  bool word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }
  void skip() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n')) ++pos_;
  }
  Status fail(const std::string& msg) const {
    return npy_error(name_, "bad header at byte " + std::to_string(pos_) + ": " + msg);
  }
  Status string_literal(std::string& out) {
    const char q = peek();
    if (q != '\'' && q != '"') return fail("expected a quoted string");
    ++pos_;
    const size_t end = s_.find(q, pos_);
    if (end == std::string_view::npos) return fail("unterminated string");
    out = std::string(s_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return ok_status();
  }
  Status tuple(std::vector<int64_t>& out) {
    if (!eat('(')) return fail("shape must be a tuple");
    for (;;) {
      skip();
      if (eat(')')) return ok_status();
      size_t start = pos_;
      while (peek() >= '0' && peek() <= '9') ++pos_;
      if (start == pos_) return fail("shape entries must be non-negative integers");
      if (pos_ - start > 18) return fail("shape entry too large");
      out.push_back(std::stoll(std::string(s_.substr(start, pos_ - start))));
      skip();
      if (eat(')')) return ok_status();
      if (!eat(',')) return fail("expected ',' or ')' in shape");
    }
  }

  std::string_view s_;
  const std::string& name_;
  size_t pos_ = 0;
};

uint64_t load_le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

struct IntRange { int64_t lo, hi; };
IntRange int_range(DType t) {
  switch (t) {
    case DType::kI32: return {INT32_MIN, INT32_MAX};
    case DType::kI16: return {INT16_MIN, INT16_MAX};
    case DType::kI8: return {INT8_MIN, INT8_MAX};
    case DType::kU8: return {0, 255};
    case DType::kI4: return {-8, 7};
    case DType::kBool: return {0, 1};
    default: return {INT64_MIN, INT64_MAX};
  }
}

/// Converts `src` to `want`, refusing values that do not fit (ints out of range, fractional or
/// non-finite floats into ints, anything but 0/1 into bool).
StatusOr<Tensor> convert(const Tensor& src, DType want, const std::string& name) {
  if (src.dtype() == want) return src;
  Tensor out(want, src.shape());
  const int64_t n = src.numel();
  if (is_float(want)) {
    for (int64_t i = 0; i < n; ++i)
      out.set_f64(i, is_float(src.dtype()) ? src.get_f64(i) : static_cast<double>(src.get_i64(i)));
    return out;
  }
  const IntRange r = int_range(want);
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = 0;
    std::string shown;
    bool fits;
    if (is_float(src.dtype())) {
      const double d = src.get_f64(i);
      // 2^63 as a double is just out of the int64 range.
      fits = std::isfinite(d) && d == std::trunc(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0;
      if (fits) v = static_cast<int64_t>(d);
      fits = fits && v >= r.lo && v <= r.hi;
      std::ostringstream os;
      os << d;
      shown = os.str();
    } else {
      v = src.get_i64(i);
      fits = v >= r.lo && v <= r.hi;
      shown = std::to_string(v);
    }
    if (!fits)
      return npy_error(name, "value " + shown + " at index " + std::to_string(i) + " does not fit " +
                                 std::string(dtype_name(want)));
    out.set_i64(i, v);
  }
  return out;
}

}  // namespace

StatusOr<Tensor> parse_npy(std::string_view bytes, const std::string& name, std::optional<DType> want) {
  if (bytes.empty()) return npy_error(name, "empty file");
  if (bytes.substr(0, 6) != kMagic.substr(0, std::min<size_t>(6, bytes.size())))
    return npy_error(name, "not a .npy file (bad magic)");
  if (bytes.size() < 10) return npy_error(name, "truncated header");
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  const int major = u[6], minor = u[7];
  if (!((major == 1 || major == 2 || major == 3) && minor == 0))
    return npy_error(name, "unsupported format version " + std::to_string(major) + "." + std::to_string(minor));
  const size_t len_bytes = major == 1 ? 2 : 4;
  if (bytes.size() < 8 + len_bytes) return npy_error(name, "truncated header");
  const uint64_t header_len = load_le(u + 8, static_cast<int>(len_bytes));
  if (header_len > kMaxHeaderBytes)
    return npy_error(name, "header of " + std::to_string(header_len) + " bytes is too large");
  const size_t data_start = 8 + len_bytes + header_len;
  if (bytes.size() < data_start) return npy_error(name, "truncated header");
  const std::string_view header = bytes.substr(8 + len_bytes, header_len);

  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
  KILN_RETURN_IF_ERROR(HeaderParser(header, name).parse(descr, fortran, shape));
  KILN_ASSIGN_OR_RETURN(FileType ft, parse_descr(descr, name));
  int64_t numel = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(numel, d, &numel)) return npy_error(name, "shape overflows");
  if (fortran && shape.size() > 1) return npy_error(name, "fortran order is not supported");
  int64_t data_bytes = 0;
  if (__builtin_mul_overflow(numel, int64_t{ft.itemsize}, &data_bytes))
    return npy_error(name, "shape overflows");
  const size_t have = bytes.size() - data_start;
  if (have < static_cast<uint64_t>(data_bytes))
    return npy_error(name, "truncated file: shape needs " + std::to_string(data_bytes) +
                               " data bytes, found " + std::to_string(have));
  if (have > static_cast<uint64_t>(data_bytes))
    return npy_error(name, std::to_string(have - static_cast<uint64_t>(data_bytes)) +
                               " bytes of unexpected trailing data");

  const unsigned char* src = u + data_start;
  const bool swap = ft.big_endian != (std::endian::native == std::endian::big);
  Tensor t(ft.dtype, shape);
  unsigned char* dst = reinterpret_cast<unsigned char*>(t.mutable_data());
  if (ft.unsigned_wide) {
    for (int64_t i = 0; i < numel; ++i) {
      const unsigned char* p = src + i * ft.itemsize;
      uint64_t v = 0;
      for (int b = 0; b < ft.itemsize; ++b)
        v = ft.big_endian ? (v << 8) | p[b] : v | (uint64_t{p[b]} << (8 * b));
      if (v > static_cast<uint64_t>(INT64_MAX))
        return npy_error(name, "value " + std::to_string(v) + " at index " + std::to_string(i) +
                                   " does not fit i64");
      t.set_i64(i, static_cast<int64_t>(v));
    }
  } else if (numel > 0) {
    std::memcpy(dst, src, static_cast<size_t>(data_bytes));
    if (swap && ft.itemsize > 1)
      for (int64_t i = 0; i < numel; ++i) std::reverse(dst + i * ft.itemsize, dst + (i + 1) * ft.itemsize);
    if (ft.dtype == DType::kBool)
      for (int64_t i = 0; i < numel; ++i) dst[i] = dst[i] != 0;
  }
  if (want && *want != t.dtype()) return convert(t, *want, name);
  return t;
}

StatusOr<Tensor> read_npy(const std::string& path, std::optional<DType> want) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot open '" + path + "': " + std::strerror(errno));
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return io_error("cannot read '" + path + "': it is a directory");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) return io_error("cannot read '" + path + "'");
  return parse_npy(bytes.str(), path, want);
}

std::string serialize_npy(const Tensor& t) {
  // NumPy has no bf16, f8 or i4: those widen exactly to f32 and i8.
  DType file_dtype = t.dtype();
  const char* descr = "<f4";
  switch (t.dtype()) {
    case DType::kF64: descr = "<f8"; break;
    case DType::kF32: descr = "<f4"; break;
    case DType::kF16: descr = "<f2"; break;
    case DType::kBF16: case DType::kF8E4M3FN: case DType::kF8E5M2: descr = "<f4"; file_dtype = DType::kF32; break;
    case DType::kI64: descr = "<i8"; break;
    case DType::kI32: descr = "<i4"; break;
    case DType::kI16: descr = "<i2"; break;
    case DType::kI8: descr = "|i1"; break;
    case DType::kU8: descr = "|u1"; break;
    case DType::kI4: descr = "|i1"; file_dtype = DType::kI8; break;
    case DType::kBool: descr = "|b1"; break;
  }
  std::string shape = "(";
  for (size_t i = 0; i < t.shape().size(); ++i)
    shape += (i ? ", " : "") + std::to_string(t.shape()[i]);
  shape += t.shape().size() == 1 ? ",)" : ")";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  // Version 1.0 stores the header length in 2 bytes; the whole preamble is 64-byte aligned.
  const int major = header.size() + 1 + 10 <= 65535 ? 1 : 2;
  const size_t preamble = major == 1 ? 10 : 12;
  const size_t total = (preamble + header.size() + 1 + 63) / 64 * 64;
  header.append(total - preamble - header.size() - 1, ' ');
  header += '\n';

  std::string out(kMagic);
  out += static_cast<char>(major);
  out += '\0';
  const size_t hl = header.size();
  for (size_t b = 0; b < preamble - 8; ++b) out += static_cast<char>((hl >> (8 * b)) & 0xff);
  out += header;

  Tensor data = t;
  if (file_dtype != t.dtype()) {
    Tensor wide(file_dtype, t.shape());
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (file_dtype == DType::kF32) wide.set_f64(i, t.get_f64(i));
      else wide.set_i64(i, t.get_i64(i));
    }
    data = wide;
  }
  const size_t n = data.nbytes();
  const size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, data.data(), n);
  if (std::endian::native == std::endian::big) {
    const int item = dtype_bits(file_dtype) / 8;
    for (size_t i = 0; item > 1 && i < n; i += static_cast<size_t>(item))
      std::reverse(out.begin() + static_cast<std::ptrdiff_t>(at + i), out.begin() + static_cast<std::ptrdiff_t>(at + i + static_cast<size_t>(item)));
  }
  return out;
}

Status write_npy(const std::string& path, const Tensor& t) {
  const std::string bytes = serialize_npy(t);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return io_error("cannot write '" + path + "': " + std::strerror(errno));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return io_error("cannot write '" + path + "'");
  return ok_status();
}

}  // namespace kiln
