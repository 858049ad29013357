// The caching device allocator: size-class free lists, per-category accounting, a memory limit.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "status.h"

namespace kiln::rt {

/// What device memory is for (pinned host staging is host memory and counted by the model).
enum class MemoryCategory { kWeights = 0, kActivations, kWorkspace };
inline constexpr int kNumMemoryCategories = 3;
const char* category_name(MemoryCategory c);

/// The device calls the allocator makes; injectable so the caching logic is testable
/// without a GPU. `malloc` and `mem_info` return cudaError_t values.
struct DeviceMemoryOps {
  std::function<cudaError_t(void** ptr, uint64_t bytes)> malloc;
  std::function<void(void* ptr)> free;
  std::function<cudaError_t(uint64_t* free, uint64_t* total)> mem_info;
};
/// cudaMalloc / cudaFree / cudaMemGetInfo on device `ordinal`.
DeviceMemoryOps cuda_memory_ops(int ordinal);

/// Holds device blocks by size class and reuses them: once a model is loaded, running it
/// never calls cudaMalloc or cudaFree. Thread-safe. Blocks go back to the device only on
/// empty_cache(), when an allocation would otherwise fail, and on destruction.
class CachingAllocator {
 public:
  struct Stats {
    uint64_t allocated = 0;  ///< bytes of blocks handed out (size-class bytes)
    uint64_t reserved = 0;   ///< bytes held from the device, handed out or cached
    uint64_t by_category[kNumMemoryCategories] = {};
    uint64_t device_allocations = 0;  ///< calls to ops.malloc that succeeded
    uint64_t device_frees = 0;
  };

  /// `limit` caps `reserved`; 0 means no limit.
  CachingAllocator(DeviceMemoryOps ops, uint64_t limit);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// A block of at least `bytes` (256-byte aligned as cudaMalloc's). 0 bytes gives nullptr.
  /// OUT_OF_MEMORY names the request, the device's total and free memory and Kiln's
  /// allocated and reserved bytes.
  kiln_status* allocate(uint64_t bytes, MemoryCategory category, void** out);
  /// Returns a block to its free list; nullptr is ignored.
  void release(void* ptr);
  /// Gives every cached (free) block back to the device.
  void empty_cache();
  Stats stats() const;

  /// The size class of a request: multiples of 512 bytes up to 1 MiB, then of 2 MiB.
  static uint64_t size_class(uint64_t bytes);

 private:
  struct Block {
    uint64_t size;
    MemoryCategory category;
  };
  void empty_cache_locked();
  kiln_status* out_of_memory(uint64_t bytes, MemoryCategory category, const std::string& why);

  DeviceMemoryOps ops_;
  uint64_t limit_;
  mutable std::mutex mutex_;
  std::map<uint64_t, std::vector<void*>> free_;  ///< size class → cached blocks
  std::unordered_map<void*, Block> live_;
  Stats stats_;
};

}  // namespace kiln::rt
