// The C API's version-2 additions without a GPU: the grown table, enqueue/synchronize and
// device-time argument checks, the enable_timing default.
#include <doctest/doctest.h>

#include <string>

#include "kiln/runtime.h"

namespace {

/// {code, message} of a status, which it releases.
std::pair<kiln_status_code, std::string> outcome(kiln_status* st) {
  std::pair<kiln_status_code, std::string> r{kiln_status_get_code(st), st ? kiln_status_get_message(st) : ""};
  kiln_status_release(st);
  return r;
}

}  // namespace

TEST_CASE("the version-2 table ends with enqueue, synchronize and device time; version 1 still served") {
  CHECK(KILN_RUNTIME_API_VERSION >= 3);
  const kiln_api* v2 = kiln_get_api(2);
  REQUIRE(v2 != nullptr);
  CHECK((v2->model_enqueue == &kiln_model_enqueue));
  CHECK((v2->model_synchronize == &kiln_model_synchronize));
  CHECK((v2->model_device_time == &kiln_model_device_time));
  // A version-1 host gets a table whose prefix is the version-1 layout.
  const kiln_api* v1 = kiln_get_api(1);
  REQUIRE(v1 != nullptr);
  CHECK((v1->model_run == &kiln_model_run));
  CHECK((v1->model_memory_report == &kiln_model_memory_report));
  // Version 3 appends the per-step profile after them.
  const kiln_api* v3 = kiln_get_api(3);
  REQUIRE(v3 != nullptr);
  CHECK((v3->model_num_steps == &kiln_model_num_steps));
  CHECK((v3->model_profile_steps == &kiln_model_profile_steps));
  CHECK(kiln_get_api(KILN_RUNTIME_API_VERSION + 1) == nullptr);
}

TEST_CASE("enable_timing defaults to off") {
  kiln_runtime_options o;
  o.enable_timing = 5;
  kiln_runtime_options_initialize(&o);
  CHECK(o.enable_timing == 0);
}

TEST_CASE("enqueue, synchronize and device time refuse NULL arguments with a message") {
  auto r = outcome(kiln_model_enqueue(nullptr, nullptr, 0, nullptr, 0));
  CHECK(r.first == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(r.second == "kiln_model_enqueue: model is NULL");
  r = outcome(kiln_model_synchronize(nullptr));
  CHECK(r.first == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(r.second == "kiln_model_synchronize: model is NULL");
  double ms = -1;
  r = outcome(kiln_model_device_time(nullptr, &ms));
  CHECK(r.second == "kiln_model_device_time: model is NULL");
  CHECK(ms == -1);
  r = outcome(kiln_model_device_time(reinterpret_cast<const kiln_model*>(8), nullptr));
  CHECK(r.first == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(r.second == "kiln_model_device_time: out_ms is NULL");
}
