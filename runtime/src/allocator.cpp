// The caching device allocator.
#include "allocator.h"

namespace kiln::rt {

const char* category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::kWeights: return "weights";
    case MemoryCategory::kActivations: return "activations";
    case MemoryCategory::kWorkspace: return "workspace";
  }
  return "unknown";
}

DeviceMemoryOps cuda_memory_ops(int ordinal) {
  DeviceMemoryOps ops;
  // The calling thread may have another current device: set ours before each call.
  ops.malloc = [ordinal](void** ptr, uint64_t bytes) {
    cudaError_t err = cudaSetDevice(ordinal);
    if (err == cudaSuccess) err = cudaMalloc(ptr, bytes);
    if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky: clear it
    return err;
  };
  ops.free = [ordinal](void* ptr) {
    if (cudaSetDevice(ordinal) == cudaSuccess) (void)cudaFree(ptr);
  };
  ops.mem_info = [ordinal](uint64_t* free, uint64_t* total) {
    size_t f = 0, t = 0;
    cudaError_t err = cudaSetDevice(ordinal);
    if (err == cudaSuccess) err = cudaMemGetInfo(&f, &t);
    *free = f;
    *total = t;
    return err;
  };
  return ops;
}

CachingAllocator::CachingAllocator(DeviceMemoryOps ops, uint64_t limit)
    : ops_(std::move(ops)), limit_(limit) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard lock(mutex_);
  empty_cache_locked();
  for (auto& [ptr, block] : live_) ops_.free(ptr);
}

uint64_t CachingAllocator::size_class(uint64_t bytes) {
  constexpr uint64_t kSmallStep = 512, kSmallMax = 1 << 20, kLargeStep = 2 << 20;
  uint64_t step = bytes <= kSmallMax ? kSmallStep : kLargeStep;
  return (bytes + step - 1) / step * step;
}

kiln_status* CachingAllocator::allocate(uint64_t bytes, MemoryCategory category, void** out) {
  *out = nullptr;
  if (bytes == 0) return nullptr;
  std::lock_guard lock(mutex_);
  if (bytes > (uint64_t{1} << 62))
    return out_of_memory(bytes, category, "the request is larger than any device");
  uint64_t size = size_class(bytes);
  void* ptr = nullptr;
  if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
    ptr = it->second.back();
    it->second.pop_back();
  } else {
    if (limit_ != 0 && stats_.reserved + size > limit_) empty_cache_locked();
    if (limit_ != 0 && stats_.reserved + size > limit_)
      return out_of_memory(bytes, category,
                           "it would exceed device_memory_limit " + format_bytes(limit_));
    cudaError_t err = ops_.malloc(&ptr, size);
    if (err == cudaErrorMemoryAllocation) {
      // Cached blocks of other sizes may be what stands in the way.
      empty_cache_locked();
      err = ops_.malloc(&ptr, size);
    }
    if (err == cudaErrorMemoryAllocation)
      return out_of_memory(bytes, category, "cudaMalloc failed");
    KILN_RT_TRY(cuda_status(err, "cudaMalloc"));
    stats_.reserved += size;
    ++stats_.device_allocations;
  }
  live_.emplace(ptr, Block{size, category});
  stats_.allocated += size;
  stats_.by_category[static_cast<int>(category)] += size;
  *out = ptr;
  return nullptr;
}

void CachingAllocator::release(void* ptr) {
  if (!ptr) return;
  std::lock_guard lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return;
  stats_.allocated -= it->second.size;
  stats_.by_category[static_cast<int>(it->second.category)] -= it->second.size;
  free_[it->second.size].push_back(ptr);
  live_.erase(it);
}

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mutex_);
  empty_cache_locked();
}

void CachingAllocator::empty_cache_locked() {
  for (auto& [size, blocks] : free_) {
    for (void* ptr : blocks) {
      ops_.free(ptr);
      stats_.reserved -= size;
      ++stats_.device_frees;
    }
  }
  free_.clear();
}

CachingAllocator::Stats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

kiln_status* CachingAllocator::out_of_memory(uint64_t bytes, MemoryCategory category,
                                             const std::string& why) {
  uint64_t free = 0, total = 0;
  std::string device;
  if (ops_.mem_info(&free, &total) == cudaSuccess)
    device = "device total " + format_bytes(total) + ", free " + format_bytes(free);
  else
    device = "device memory unknown (cudaMemGetInfo failed)";
  return make_status(KILN_STATUS_OUT_OF_MEMORY,
                     "out of memory: cannot allocate " + format_bytes(bytes) + " for " +
                         category_name(category) + " (" + why + "); " + device +
                         "; kiln allocated " + format_bytes(stats_.allocated) + ", reserved " +
                         format_bytes(stats_.reserved));
}

}  // namespace kiln::rt
