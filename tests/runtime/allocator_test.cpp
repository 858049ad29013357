// The caching allocator over fake device calls: size classes, reuse, accounting, limits, OOM.
#include <doctest/doctest.h>

#include <set>
#include <string>

#include "allocator.h"

using kiln::rt::CachingAllocator;
using kiln::rt::MemoryCategory;

namespace {

/// A pretend device of `capacity` bytes with 16 GiB of total memory.
struct FakeDevice {
  uint64_t capacity = 0;
  uint64_t used = 0;
  uint64_t next = 0x100000;
  std::map<void*, uint64_t> blocks;
  int mallocs = 0, frees = 0;
  cudaError_t fail_with = cudaSuccess;

  kiln::rt::DeviceMemoryOps ops() {
    kiln::rt::DeviceMemoryOps o;
    o.malloc = [this](void** p, uint64_t bytes) {
      ++mallocs;
      if (fail_with != cudaSuccess) return fail_with;
      if (used + bytes > capacity) return cudaErrorMemoryAllocation;
      *p = reinterpret_cast<void*>(next);
      next += bytes;
      used += bytes;
      blocks[*p] = bytes;
      return cudaSuccess;
    };
    o.free = [this](void* p) {
      ++frees;
      used -= blocks.at(p);
      blocks.erase(p);
    };
    o.mem_info = [this](uint64_t* free, uint64_t* total) {
      *total = 16ull << 30;
      *free = capacity - used;
      return cudaSuccess;
    };
    return o;
  }
};

constexpr uint64_t kMiB = 1 << 20;

std::string take_message(kiln_status* st) {
  std::string m = st ? kiln_status_get_message(st) : "";
  kiln_status_release(st);
  return m;
}

}  // namespace

TEST_CASE("size classes: 512-byte steps up to 1 MiB, then 2 MiB steps") {
  CHECK(CachingAllocator::size_class(1) == 512);
  CHECK(CachingAllocator::size_class(512) == 512);
  CHECK(CachingAllocator::size_class(513) == 1024);
  CHECK(CachingAllocator::size_class(kMiB) == kMiB);
  CHECK(CachingAllocator::size_class(kMiB + 1) == 2 * kMiB);
  CHECK(CachingAllocator::size_class(3 * kMiB) == 4 * kMiB);
}

TEST_CASE("freed blocks are reused without device calls; accounting splits allocated and reserved") {
  FakeDevice dev;
  dev.capacity = 64 * kMiB;
  CachingAllocator alloc(dev.ops(), 0);
  void *a = nullptr, *b = nullptr, *c = nullptr;
  REQUIRE(alloc.allocate(1000, MemoryCategory::kWeights, &a) == nullptr);
  REQUIRE(alloc.allocate(3 * kMiB, MemoryCategory::kActivations, &b) == nullptr);
  CHECK(a != b);
  CachingAllocator::Stats s = alloc.stats();
  CHECK(s.allocated == 1024 + 4 * kMiB);
  CHECK(s.reserved == 1024 + 4 * kMiB);
  CHECK(s.by_category[0] == 1024);
  CHECK(s.by_category[1] == 4 * kMiB);
  CHECK(s.by_category[2] == 0);

  alloc.release(b);
  s = alloc.stats();
  CHECK(s.allocated == 1024);
  CHECK(s.reserved == 1024 + 4 * kMiB);  // cached, not returned
  CHECK(s.by_category[1] == 0);
  // Same size class (4 MiB), another category: the cached block comes back.
  REQUIRE(alloc.allocate(4 * kMiB - 5, MemoryCategory::kWorkspace, &c) == nullptr);
  CHECK(c == b);
  CHECK(dev.mallocs == 2);
  CHECK(alloc.stats().by_category[2] == 4 * kMiB);

  void* z = reinterpret_cast<void*>(1);
  REQUIRE(alloc.allocate(0, MemoryCategory::kActivations, &z) == nullptr);
  CHECK(z == nullptr);
  CHECK(dev.mallocs == 2);
  alloc.release(nullptr);
}

TEST_CASE("empty_cache and destruction give memory back to the device") {
  FakeDevice dev;
  dev.capacity = 64 * kMiB;
  {
    CachingAllocator alloc(dev.ops(), 0);
    void *a, *b;
    REQUIRE(alloc.allocate(kMiB, MemoryCategory::kActivations, &a) == nullptr);
    REQUIRE(alloc.allocate(6 * kMiB, MemoryCategory::kActivations, &b) == nullptr);
    alloc.release(a);
    alloc.empty_cache();
    CHECK(dev.frees == 1);
    CHECK(alloc.stats().reserved == 6 * kMiB);
    CHECK(alloc.stats().device_frees == 1);
  }
  CHECK(dev.frees == 2);
  CHECK(dev.used == 0);
}

TEST_CASE("a failing cudaMalloc first frees the cache, then reports out of memory with the numbers") {
  FakeDevice dev;
  dev.capacity = 8 * kMiB;
  CachingAllocator alloc(dev.ops(), 0);
  void *a, *b, *c;
  REQUIRE(alloc.allocate(4 * kMiB, MemoryCategory::kActivations, &a) == nullptr);
  alloc.release(a);
  // 4 MiB cached + 6 MiB does not fit in 8: the cached block must go first.
  REQUIRE(alloc.allocate(6 * kMiB, MemoryCategory::kWeights, &b) == nullptr);
  CHECK(dev.frees == 1);
  CHECK(alloc.stats().reserved == 6 * kMiB);

  kiln_status* st = alloc.allocate(3 * kMiB, MemoryCategory::kActivations, &c);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_OUT_OF_MEMORY);
  CHECK(c == nullptr);
  CHECK(take_message(st) ==
        "out of memory: cannot allocate 3.00 MiB (3145728 bytes) for activations (cudaMalloc failed); "
        "device total 16.00 GiB (17179869184 bytes), free 2.00 MiB (2097152 bytes); "
        "kiln allocated 6.00 MiB (6291456 bytes), reserved 6.00 MiB (6291456 bytes)");
}

TEST_CASE("device_memory_limit caps reserved memory") {
  FakeDevice dev;
  dev.capacity = 64 * kMiB;
  CachingAllocator alloc(dev.ops(), 4 * kMiB);
  void *a, *b, *c;
  REQUIRE(alloc.allocate(2 * kMiB, MemoryCategory::kActivations, &a) == nullptr);
  alloc.release(a);
  // The cached 2 MiB block is dropped to make room within the limit.
  REQUIRE(alloc.allocate(4 * kMiB, MemoryCategory::kActivations, &b) == nullptr);
  CHECK(alloc.stats().reserved == 4 * kMiB);
  kiln_status* st = alloc.allocate(512, MemoryCategory::kWorkspace, &c);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_OUT_OF_MEMORY);
  CHECK(take_message(st) ==
        "out of memory: cannot allocate 512 bytes for workspace (it would exceed device_memory_limit "
        "4.00 MiB (4194304 bytes)); device total 16.00 GiB (17179869184 bytes), free 60.00 MiB (62914560 bytes); "
        "kiln allocated 4.00 MiB (4194304 bytes), reserved 4.00 MiB (4194304 bytes)");
}

TEST_CASE("other cudaMalloc errors are device errors naming the call") {
  FakeDevice dev;
  dev.capacity = 64 * kMiB;
  dev.fail_with = cudaErrorInvalidValue;
  CachingAllocator alloc(dev.ops(), 0);
  void* a;
  kiln_status* st = alloc.allocate(100, MemoryCategory::kWeights, &a);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_DEVICE_ERROR);
  CHECK(take_message(st) == "cudaMalloc failed: cudaErrorInvalidValue (invalid argument)");
  CHECK(alloc.stats().reserved == 0);
}

TEST_CASE("an absurd request is refused before any device call") {
  FakeDevice dev;
  CachingAllocator alloc(dev.ops(), 0);
  void* a;
  kiln_status* st = alloc.allocate(~0ull, MemoryCategory::kActivations, &a);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_OUT_OF_MEMORY);
  CHECK(take_message(st).rfind("out of memory: cannot allocate 16777216.00 TiB (18446744073709551615 bytes) for "
                               "activations (the request is larger than any device)", 0) == 0);
  CHECK(dev.mallocs == 0);
}
