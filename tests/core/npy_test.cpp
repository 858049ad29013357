// Tests for .npy reading and writing: NumPy's own bytes, every dtype, conversions, bad files.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "kiln/core/npy.h"

using namespace kiln;

namespace {

/// A version 1.0 file laid out as NumPy writes it: header padded with spaces to 64 bytes.
std::string npy(const std::string& descr, const std::string& shape, const std::string& data,
                const std::string& fortran = "False") {
  std::string h = "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
  h.append((10 + h.size() + 1 + 63) / 64 * 64 - 10 - h.size() - 1, ' ');
  h += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\0';
  out += static_cast<char>(h.size() & 0xff);
  out += static_cast<char>(h.size() >> 8);
  return out + h + data;
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s += static_cast<char>(x);
  return s;
}

std::string error_of(std::string_view data, std::optional<DType> want = std::nullopt) {
  auto t = parse_npy(data, "t.npy", want);
  return t.ok() ? "(no error)" : t.status().message();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("npy: bytes identical to NumPy's for f32") {
  // tests/cli/data/x.npy was written by numpy.save(np.array([[1,2,3],[4,5,6]], np.float32)).
  const std::string numpy_bytes = read_file(KILN_SOURCE_DIR "/tests/cli/data/x.npy");
  REQUIRE(numpy_bytes.size() == 152);
  const double v[] = {1, 2, 3, 4, 5, 6};
  const Tensor t = Tensor::from_f64(DType::kF32, {2, 3}, v);
  CHECK(serialize_npy(t) == numpy_bytes);
  auto back = parse_npy(numpy_bytes, "x.npy");
  REQUIRE(back.ok());
  CHECK(back->identical(t));
}

TEST_CASE("npy: reading NumPy files of other layouts") {
  // numpy.save(np.array([1, -2, 300], '>i4')): big-endian.
  auto be = parse_npy(npy(">i4", "(3,)", bytes({0, 0, 0, 1, 0xff, 0xff, 0xff, 0xfe, 0, 0, 1, 0x2c})), "be.npy");
  REQUIRE(be.ok());
  CHECK(be->dtype() == DType::kI32);
  CHECK(be->to_i64() == std::vector<int64_t>{1, -2, 300});
  // numpy.save(np.array(7.5)): a 0-d array.
  auto scalar = parse_npy(npy("<f8", "()", bytes({0, 0, 0, 0, 0, 0, 0x1e, 0x40})), "s.npy");
  REQUIRE(scalar.ok());
  CHECK(scalar->rank() == 0);
  CHECK(scalar->get_f64(0) == 7.5);
  // numpy.save(np.array([[1, 2], [3, 4]], np.float16)).
  auto half = parse_npy(npy("<f2", "(2, 2)", bytes({0, 0x3c, 0, 0x40, 0, 0x42, 0, 0x44})), "h.npy");
  REQUIRE(half.ok());
  CHECK(half->dtype() == DType::kF16);
  CHECK(half->to_f64() == std::vector<double>{1, 2, 3, 4});
  // bools other than 0/1 in the file are normalized.
  auto b = parse_npy(npy("|b1", "(3,)", bytes({1, 0, 7})), "b.npy");
  REQUIRE(b.ok());
  CHECK(b->to_i64() == std::vector<int64_t>{1, 0, 1});
  // Unsigned 16/32/64-bit ints have no Kiln dtype: read into wider signed ints.
  auto u2 = parse_npy(npy("<u2", "(2,)", bytes({0xff, 0xff, 1, 0})), "u.npy");
  REQUIRE(u2.ok());
  CHECK(u2->dtype() == DType::kI32);
  CHECK(u2->to_i64() == std::vector<int64_t>{65535, 1});
  auto u8 = parse_npy(npy(">u8", "(1,)", bytes({0, 0, 0, 1, 0, 0, 0, 2})), "u.npy", DType::kI64);
  REQUIRE(u8.ok());
  CHECK(u8->get_i64(0) == (int64_t{1} << 32) + 2);
  CHECK(error_of(npy("<u8", "(1,)", bytes({0, 0, 0, 0, 0, 0, 0, 0x80}))) ==
        "npy t.npy: value 9223372036854775808 at index 0 does not fit i64");
  // Fortran order is the same as C order for rank <= 1; size-0 arrays need no data.
  CHECK(parse_npy(npy("<i2", "(1,)", bytes({5, 0}), "True"), "f.npy").ok());
  auto empty = parse_npy(npy("<f4", "(0, 3)", ""), "e.npy");
  REQUIRE(empty.ok());
  CHECK(empty->numel() == 0);
  CHECK(empty->shape() == std::vector<int64_t>{0, 3});
  // Format 2.0: a 4-byte header length.
  std::string v2 = npy("|u1", "(2,)", bytes({9, 10}));
  v2[6] = 2;
  v2.insert(10, 2, '\0');
  auto two = parse_npy(v2, "v2.npy");
  REQUIRE(two.ok());
  CHECK(two->to_i64() == std::vector<int64_t>{9, 10});
}

TEST_CASE("npy: every dtype round trips, narrow types through their widened NumPy type") {
  const double values[] = {0, 1, -2, 3, 0.5, -0.25};
  const int64_t ints[] = {0, 1, -2, 3, -8, 7};
  const struct { DType dtype; std::string descr; } cases[] = {
      {DType::kF64, "<f8"}, {DType::kF32, "<f4"}, {DType::kF16, "<f2"}, {DType::kBF16, "<f4"},
      {DType::kF8E4M3FN, "<f4"}, {DType::kF8E5M2, "<f4"}, {DType::kI64, "<i8"}, {DType::kI32, "<i4"},
      {DType::kI16, "<i2"}, {DType::kI8, "|i1"}, {DType::kU8, "|u1"}, {DType::kI4, "|i1"}, {DType::kBool, "|b1"},
  };
  for (const auto& c : cases) {
    CAPTURE(dtype_name(c.dtype));
    Tensor t = is_float(c.dtype) ? Tensor::from_f64(c.dtype, {2, 3}, values) : Tensor(c.dtype, {2, 3});
    if (!is_float(c.dtype))
      for (int64_t i = 0; i < 6; ++i)
        t.set_i64(i, c.dtype == DType::kU8 ? ints[i] + 8 : c.dtype == DType::kBool ? i % 2 : ints[i]);
    const std::string file = serialize_npy(t);
    CHECK(file.substr(0, 128).find("'descr': '" + c.descr + "'") != std::string::npos);
    const size_t header_len = static_cast<unsigned char>(file[8]) | static_cast<size_t>(static_cast<unsigned char>(file[9])) << 8;
    CHECK((10 + header_len) % 64 == 0);
    auto back = parse_npy(file, "rt.npy", c.dtype);
    REQUIRE(back.ok());
    CHECK(back->identical(t));
  }
  // i4 widens to i1 exactly: the values survive as plain int8.
  Tensor i4(DType::kI4, {3});
  i4.set_i64(0, -8);
  i4.set_i64(1, 7);
  i4.set_i64(2, -1);
  auto as_i8 = parse_npy(serialize_npy(i4), "i4.npy");
  REQUIRE(as_i8.ok());
  CHECK(as_i8->dtype() == DType::kI8);
  CHECK(as_i8->to_i64() == std::vector<int64_t>{-8, 7, -1});
}

TEST_CASE("npy: conversion to the wanted dtype") {
  const std::string i32 = npy("<i4", "(3,)", bytes({1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x2c, 1, 0, 0}));  // 1, -1, 300
  auto f = parse_npy(i32, "t.npy", DType::kF32);
  REQUIRE(f.ok());
  CHECK(f->to_f64() == std::vector<double>{1, -1, 300});
  auto i64 = parse_npy(i32, "t.npy", DType::kI64);
  REQUIRE(i64.ok());
  CHECK(i64->to_i64() == std::vector<int64_t>{1, -1, 300});
  CHECK(error_of(i32, DType::kI8) == "npy t.npy: value 300 at index 2 does not fit i8");
  CHECK(error_of(i32, DType::kU8) == "npy t.npy: value -1 at index 1 does not fit u8");
  CHECK(error_of(i32, DType::kBool) == "npy t.npy: value -1 at index 1 does not fit bool");
  const double v[] = {0.1, 2.0, -3.0};
  const std::string f64 = serialize_npy(Tensor::from_f64(DType::kF64, {3}, v));
  auto bf = parse_npy(f64, "t.npy", DType::kBF16);
  REQUIRE(bf.ok());
  CHECK(bf->get_f64(0) == 0.10009765625);  // nearest bf16 to 0.1
  CHECK(error_of(f64, DType::kI32) == "npy t.npy: value 0.1 at index 0 does not fit i32");
  const double w[] = {2.0, -3.0};
  auto ints = parse_npy(serialize_npy(Tensor::from_f64(DType::kF32, {2}, w)), "t.npy", DType::kI4);
  REQUIRE(ints.ok());
  CHECK(ints->to_i64() == std::vector<int64_t>{2, -3});
  const double big[] = {1e30};
  CHECK(error_of(serialize_npy(Tensor::from_f64(DType::kF64, {1}, big)), DType::kI64) ==
        "npy t.npy: value 1e+30 at index 0 does not fit i64");
  const double nan[] = {std::nan("")};
  CHECK(error_of(serialize_npy(Tensor::from_f64(DType::kF64, {1}, nan)), DType::kI64) ==
        "npy t.npy: value nan at index 0 does not fit i64");
}

TEST_CASE("npy: malformed files are refused with a message, never a crash") {
  const std::string good = npy("<f4", "(2,)", bytes({0, 0, 0x80, 0x3f, 0, 0, 0, 0x40}));
  CHECK(error_of("") == "npy t.npy: empty file");
  CHECK(error_of("PK\x03\x04 zip file") == "npy t.npy: not a .npy file (bad magic)");
  std::string v4 = good;
  v4[6] = 4;
  CHECK(error_of(v4) == "npy t.npy: unsupported format version 4.0");
  CHECK(error_of(good.substr(0, 9)) == "npy t.npy: truncated header");
  CHECK(error_of(good.substr(0, 50)) == "npy t.npy: truncated header");
  CHECK(error_of(good.substr(0, 130)) == "npy t.npy: truncated file: shape needs 8 data bytes, found 2");
  CHECK(error_of(good + "xy") == "npy t.npy: 2 bytes of unexpected trailing data");
  std::string huge = "\x93NUMPY\x02";
  huge += '\0';
  huge += bytes({0, 0, 0, 0x10});
  CHECK(error_of(huge) == "npy t.npy: header of 268435456 bytes is too large");
  CHECK(error_of(npy("<f4", "(2, 2)", std::string(16, '\0'), "True")) == "npy t.npy: fortran order is not supported");
  CHECK(error_of(npy("<c8", "(1,)", std::string(8, '\0'))) == "npy t.npy: unsupported dtype '<c8'");
  CHECK(error_of(npy("<f4", "(-1,)", "")) ==
        "npy t.npy: bad header at byte 51: shape entries must be non-negative integers");
  CHECK(error_of(npy("<f4", "(4294967296, 4294967296)", "")).find("overflows") != std::string::npos);
  CHECK(error_of(npy("<f4", "(3037000499, 3037000499)", "")) == "npy t.npy: shape overflows");
  std::string structured = npy("<f4", "(1,)", "1234");
  structured.replace(structured.find("'<f4'"), 5, "[('a', '<f4')]");
  CHECK(error_of(structured).find("structured dtypes are not supported") != std::string::npos);
  std::string no_shape = good;
  no_shape.replace(no_shape.find("'shape': (2,), "), 15, std::string(15, ' '));
  CHECK(error_of(no_shape) == "npy t.npy: header lacks 'shape'");
  std::string extra_key = good;
  extra_key.replace(extra_key.find("'shape'"), 7, "'shapy'");
  CHECK(error_of(extra_key) == "npy t.npy: bad header at byte 50: unknown header key 'shapy'");

  // Every prefix and every single-byte corruption of a valid file: an error or a tensor.
  for (size_t n = 0; n < good.size(); ++n) CHECK_FALSE(parse_npy(good.substr(0, n), "t.npy").ok());
  for (size_t i = 0; i < good.size(); ++i)
    for (int x : {0x00, 0x20, 0x27, 0x28, 0x29, 0x2c, 0x39, 0x7b, 0x7d, 0xff}) {
      std::string bad = good;
      bad[i] = static_cast<char>(x);
      (void)parse_npy(bad, "t.npy");
    }
}

TEST_CASE("npy: files on disk") {
  const std::string path = std::filesystem::temp_directory_path() / ("kiln-npy-test-" + std::to_string(::getpid()) + ".npy");
  const int64_t v[] = {4, -5};
  const Tensor t = Tensor::from_i64(DType::kI16, {2}, v);
  REQUIRE(write_npy(path, t).ok());
  auto back = read_npy(path);
  REQUIRE(back.ok());
  CHECK(back->identical(t));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  CHECK(read_npy(path).status().message() == "npy " + path + ": truncated file: shape needs 4 data bytes, found 3");
  std::filesystem::remove(path);
  CHECK(read_npy(path).status().message() == "cannot open '" + path + "': No such file or directory");
  CHECK(read_npy(path).status().code() == StatusCode::kIoError);
  const std::string dir = std::filesystem::temp_directory_path().string();
  CHECK(read_npy(dir).status().message() == "cannot read '" + dir + "': it is a directory");
  CHECK(write_npy("/nonexistent-dir/x.npy", t).message() == "cannot write '/nonexistent-dir/x.npy': No such file or directory");
}
