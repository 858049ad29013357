// Choosing the kernel image for a device: exact SASS, same-major SASS, PTX JIT, or refusal.
#include <doctest/doctest.h>

#include "device.h"

using kiln::rt::ComputeCapability;
using kiln::rt::select_image;

namespace {
std::string pick(const std::vector<std::string>& names, int major, int minor) {
  kiln::rt::ImageChoice c = select_image(names, ComputeCapability{major, minor});
  return c.image.empty() ? "error: " + c.error : c.image;
}
}  // namespace

TEST_CASE("image names parse into target, capability and form") {
  kiln::rt::ImageTarget t;
  REQUIRE(kiln::rt::parse_image_name("sm_100a.cubin", &t));
  CHECK(t.sass);
  CHECK(t.cc.major == 10);
  CHECK(t.cc.minor == 0);
  CHECK(t.suffix == 'a');
  CHECK(t.target == "sm_100a");
  REQUIRE(kiln::rt::parse_image_name("compute_86.ptx", &t));
  CHECK_FALSE(t.sass);
  CHECK(t.cc.major == 8);
  CHECK(t.cc.minor == 6);
  CHECK(t.suffix == 0);
  CHECK_FALSE(kiln::rt::parse_image_name("sm_90.ptx", &t));       // form and prefix disagree
  CHECK_FALSE(kiln::rt::parse_image_name("compute_90.cubin", &t));
  CHECK_FALSE(kiln::rt::parse_image_name("sm_x0.cubin", &t));
  CHECK_FALSE(kiln::rt::parse_image_name("sm_90", &t));
  CHECK(kiln::rt::device_name({9, 0}) == "sm_90");
  CHECK(kiln::rt::device_name({10, 0}) == "sm_100");
}

TEST_CASE("exact SASS wins, arch-specific first") {
  std::vector<std::string> all = {"sm_80.cubin", "sm_90.cubin", "sm_90a.cubin", "sm_100a.cubin", "compute_80.ptx"};
  CHECK(pick(all, 9, 0) == "sm_90a.cubin");
  CHECK(pick(all, 10, 0) == "sm_100a.cubin");
  CHECK(pick(all, 8, 0) == "sm_80.cubin");
  CHECK(pick({"compute_90a.ptx", "sm_90a.cubin"}, 9, 0) == "sm_90a.cubin");
}

TEST_CASE("SASS of the same major and a lower minor runs, never across majors") {
  CHECK(pick({"sm_80.cubin", "compute_80.ptx"}, 8, 6) == "sm_80.cubin");
  CHECK(pick({"sm_80.cubin", "sm_86.cubin"}, 8, 9) == "sm_86.cubin");
  CHECK(pick({"sm_86.cubin"}, 8, 0) == "error: artifact has sm_86; device is sm_80");
  CHECK(pick({"sm_80.cubin"}, 9, 0) == "error: artifact has sm_80; device is sm_90");
  CHECK(pick({"sm_100f.cubin"}, 10, 3) == "sm_100f.cubin");
}

TEST_CASE("PTX is JIT-compiled for newer devices, the newest fitting PTX first") {
  CHECK(pick({"sm_80.cubin", "compute_80.ptx"}, 12, 0) == "compute_80.ptx");
  CHECK(pick({"compute_80.ptx", "compute_90.ptx", "compute_100.ptx"}, 9, 0) == "compute_90.ptx");
  CHECK(pick({"compute_90a.ptx"}, 9, 0) == "compute_90a.ptx");
  // Arch-specific PTX uses instructions only its own architecture has.
  CHECK(pick({"compute_90a.ptx"}, 10, 0) == "error: artifact has compute_90a; device is sm_100");
}

TEST_CASE("no fitting image is refused naming the artifact's targets and the device") {
  CHECK(pick({"sm_90a.cubin", "sm_100a.cubin"}, 8, 0) == "error: artifact has sm_90a, sm_100a; device is sm_80");
  CHECK(pick({"sm_100a.cubin", "sm_90a.cubin", "compute_90a.ptx"}, 8, 6) ==
        "error: artifact has compute_90a, sm_90a, sm_100a; device is sm_86");
  CHECK(pick({"sm_100a.cubin"}, 10, 3) == "error: artifact has sm_100a; device is sm_103");
  CHECK(pick({}, 9, 0) == "error: artifact has no kernel images; device is sm_90");
  CHECK(pick({"notes.txt", "sm_9.cubin"}, 9, 0) == "error: artifact has no kernel images; device is sm_90");
}
