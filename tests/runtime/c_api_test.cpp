// The C API without a GPU: statuses, the function table, options, argument checks, NO_DEVICE.
#include <doctest/doctest.h>

#include <string>

#include "kiln/runtime.h"
#include "model.h"
#include "status.h"

TEST_CASE("kiln_get_api returns a table for known versions only") {
  const kiln_api* api = kiln_get_api(1);
  REQUIRE(api != nullptr);
  CHECK(api->version == KILN_RUNTIME_API_VERSION);
  CHECK((api->runtime_create == &kiln_runtime_create));
  CHECK((api->model_run == &kiln_model_run));
  CHECK((api->model_memory_report == &kiln_model_memory_report));
  CHECK((api->status_release == &kiln_status_release));
  CHECK((api->model_profile_steps == &kiln_model_profile_steps));
  CHECK((api->model_run_device == &kiln_model_run_device));
  CHECK(kiln_get_api(0) == nullptr);
  CHECK(kiln_get_api(KILN_RUNTIME_API_VERSION + 1) == nullptr);
}

TEST_CASE("statuses carry a code and a message") {
  CHECK(kiln_status_get_code(nullptr) == KILN_STATUS_OK);
  CHECK(std::string(kiln_status_get_message(nullptr)) == "ok");
  kiln_status* st = kiln::rt::make_status(KILN_STATUS_NOT_FOUND, "no such thing");
  CHECK(kiln_status_get_code(st) == KILN_STATUS_NOT_FOUND);
  CHECK(std::string(kiln_status_get_message(st)) == "no such thing");
  kiln_status_release(st);
  kiln_status_release(nullptr);
}

TEST_CASE("CUDA and cuBLASLt errors become statuses naming the call") {
  CHECK(kiln::rt::cuda_status(cudaSuccess, "cudaMalloc(p, n)") == nullptr);
  kiln_status* st = kiln::rt::cuda_status(cudaErrorMemoryAllocation, "cudaMalloc(&p, bytes)");
  CHECK(kiln_status_get_code(st) == KILN_STATUS_OUT_OF_MEMORY);
  CHECK(std::string(kiln_status_get_message(st)) == "cudaMalloc failed: cudaErrorMemoryAllocation (out of memory)");
  kiln_status_release(st);
  st = kiln::rt::cuda_status(cudaErrorIllegalAddress, "cudaStreamSynchronize");
  CHECK(kiln_status_get_code(st) == KILN_STATUS_DEVICE_ERROR);
  CHECK(std::string(kiln_status_get_message(st)) ==
        "cudaStreamSynchronize failed: cudaErrorIllegalAddress (an illegal memory access was encountered)");
  kiln_status_release(st);
  CHECK(kiln::rt::cublas_status(CUBLAS_STATUS_SUCCESS, "cublasLtMatmul") == nullptr);
  st = kiln::rt::cublas_status(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmul(h, ...)");
  CHECK(kiln_status_get_code(st) == KILN_STATUS_DEVICE_ERROR);
  CHECK(std::string(kiln_status_get_message(st)).rfind("cublasLtMatmul failed: CUBLAS_STATUS_NOT_SUPPORTED (", 0) == 0);
  kiln_status_release(st);
}

TEST_CASE("format_bytes is readable and exact") {
  CHECK(kiln::rt::format_bytes(512) == "512 bytes");
  CHECK(kiln::rt::format_bytes(1536) == "1.50 KiB (1536 bytes)");
  CHECK(kiln::rt::format_bytes(3ull << 30) == "3.00 GiB (3221225472 bytes)");
}

TEST_CASE("runtime options have documented defaults") {
  kiln_runtime_options o;
  o.device_ordinal = 7;
  o.use_cuda_graphs = 0;
  o.device_memory_limit = 99;
  kiln_runtime_options_initialize(&o);
  CHECK(o.struct_size == sizeof(kiln_runtime_options));
  CHECK(o.device_ordinal == 0);
  CHECK(o.use_cuda_graphs == 1);
  CHECK(o.device_memory_limit == 0);
  kiln_runtime_options_initialize(nullptr);  // harmless
}

TEST_CASE("kiln_runtime_create checks its arguments") {
  kiln_status* st = kiln_runtime_create(nullptr, nullptr);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_runtime_create: out_runtime is NULL");
  kiln_status_release(st);

  kiln_runtime_options o{};  // struct_size 0: never initialized
  kiln_runtime* rt = reinterpret_cast<kiln_runtime*>(1);
  st = kiln_runtime_create(&o, &rt);
  CHECK(rt == nullptr);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kiln_status_get_message(st)) ==
        "kiln_runtime_create: options.struct_size is 0; fill the options with kiln_runtime_options_initialize first");
  kiln_status_release(st);
}

TEST_CASE("kiln_runtime_create without a GPU fails with NO_DEVICE, with one it names the device") {
  kiln_runtime* rt = nullptr;
  kiln_status* st = kiln_runtime_create(nullptr, &rt);
  if (st == nullptr) {
    REQUIRE(rt != nullptr);
    CHECK(std::string(kiln_runtime_device_name(rt)).rfind("sm_", 0) == 0);
    kiln_runtime_release(rt);
    return;
  }
  CHECK(rt == nullptr);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_NO_DEVICE);
  std::string msg = kiln_status_get_message(st);
  INFO(msg);
  bool known = msg == "no CUDA device: cudaGetDeviceCount returned cudaErrorInsufficientDriver (CUDA driver "
                      "version is insufficient for CUDA runtime version)" ||
               msg == "no CUDA device: cudaGetDeviceCount returned cudaErrorNoDevice (no CUDA-capable device "
                      "is detected)";
  CHECK(known);
  kiln_status_release(st);
}

TEST_CASE("model functions refuse NULL handles with a message") {
  kiln_model* m = reinterpret_cast<kiln_model*>(1);
  kiln_status* st = kiln_model_load_file(nullptr, "x.kiln", &m);
  CHECK(m == nullptr);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_model_load_file: runtime is NULL");
  kiln_status_release(st);
  st = kiln_model_load_memory(nullptr, "", 0, nullptr);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_model_load_memory: out_model is NULL");
  kiln_status_release(st);
  st = kiln_model_run(nullptr, nullptr, 0, nullptr, 0);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_model_run: model is NULL");
  kiln_status_release(st);
  st = kiln_model_run_device(nullptr, nullptr, 0, nullptr, 0, nullptr);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_model_run_device: model is NULL");
  kiln_status_release(st);
  kiln_tensor_info info;
  st = kiln_model_input_info(nullptr, 0, &info);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_model_input_info: model is NULL");
  kiln_status_release(st);
  kiln_memory_report report{};
  st = kiln_model_memory_report(nullptr, &report);
  CHECK(std::string(kiln_status_get_message(st)) == "kiln_model_memory_report: model is NULL");
  kiln_status_release(st);
  CHECK(kiln_model_num_inputs(nullptr) == 0);
  CHECK(std::string(kiln_runtime_device_name(nullptr)).empty());
  kiln_model_release(nullptr);
  kiln_runtime_release(nullptr);
}

TEST_CASE("dtype names map to kiln_dtype in Kiln's order") {
  kiln_dtype d;
  REQUIRE(kiln::rt::dtype_from_name("f32", &d));
  CHECK(d == KILN_DTYPE_F32);
  REQUIRE(kiln::rt::dtype_from_name("bf16", &d));
  CHECK(d == KILN_DTYPE_BF16);
  REQUIRE(kiln::rt::dtype_from_name("f8e5m2", &d));
  CHECK(d == KILN_DTYPE_F8E5M2);
  REQUIRE(kiln::rt::dtype_from_name("bool", &d));
  CHECK(d == KILN_DTYPE_BOOL);
  CHECK_FALSE(kiln::rt::dtype_from_name("f128", &d));
}

TEST_CASE("kiln_model_profile_steps checks its arguments") {
  CHECK(kiln_model_num_steps(nullptr) == 0);
  kiln_status* st = kiln_model_profile_steps(nullptr, 1, nullptr, 0);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kiln_status_get_message(st)).find("model") != std::string::npos);
  kiln_status_release(st);
}
