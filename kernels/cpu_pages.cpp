// Weights on transparent huge pages.
//
// A decode step reads every weight once. On 4 KiB pages that is a TLB entry per 4 KiB, far more
// than the TLB holds, so each page's first line waits on a page walk (two-dimensional under a
// hypervisor) and the hardware prefetcher starts again at every page boundary. A one-row product
// read its weight from memory at ~30 GB/s on 4 KiB pages and at ~50 GB/s on 2 MiB ones
// (bench/README.md, "Weights on huge pages"). torch's CPU allocator never asks for huge pages, and
// under the usual THP setting (`madvise`) the kernel gives them only to mappings that ask.
//
// set_huge_page_allocations(min_bytes) makes torch's CPU allocator a HugePageAllocator while a
// model loads: each allocation of at least min_bytes is its own anonymous mapping, starting on a
// 2 MiB boundary and advised MADV_HUGEPAGE, so the packed weights are written straight onto huge
// pages, with no copy. Smaller allocations, and any the kernel refuses to map, go to the allocator
// that was in place (the load's untouched or short-lived large allocations cost a mapping each).
// set_huge_page_allocations(0) sends every allocation to that allocator again; memory already
// handed out stays valid and is unmapped when its tensor goes. Where the kernel has no THP (or it
// is `never`) the mappings get ordinary pages.
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kPage = 4096;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The mappings handed out, by address -> length. torch's raw allocations (oneDNN's buffers, via
// Allocator::raw_allocate) need a DataPtr whose context is its data pointer, so the length is
// kept here rather than in a context object. Never destroyed: tensors are still freed while the
// process exits, after this library's static objects would have been.
struct Regions {
  std::mutex mutex;
  std::unordered_map<void*, size_t> length;
};
Regions& regions() {
  static auto* r = new Regions();
  return *r;
}
std::atomic<int64_t> mapped_bytes{0};
c10::DeleterFnPtr fallback_raw_deleter = nullptr;

// Frees what this allocator handed out: its own mappings, or (through raw_deleter) the raw
// allocations it passed on to the allocator before it.
void release(void* ptr) {
  size_t length = 0;
  {
    Regions& r = regions();
    std::lock_guard<std::mutex> guard(r.mutex);
    auto it = r.length.find(ptr);
    if (it != r.length.end()) {
      length = it->second;
      r.length.erase(it);
    }
  }
  if (length) {
    munmap(ptr, length);
  } else if (fallback_raw_deleter) {
    fallback_raw_deleter(ptr);
  }
}

// length bytes (a multiple of 4 KiB) starting on a 2 MiB boundary, or nullptr.
void* map_aligned(size_t length) {
  const size_t reserve = length + kHuge;
  void* raw = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  char* start = static_cast<char*>(raw);
  char* aligned = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(start), kHuge));
  if (aligned > start) munmap(start, aligned - start);
  char* end = aligned + length;
  if (start + reserve > end) munmap(end, start + reserve - end);
  madvise(aligned, length, MADV_HUGEPAGE);   // advice: refused or ignored, the pages are ordinary ones
  mapped_bytes += static_cast<int64_t>(length);
  Regions& r = regions();
  std::lock_guard<std::mutex> guard(r.mutex);
  r.length.emplace(aligned, length);
  return aligned;
}

class HugePageAllocator final : public c10::Allocator {
 public:
  c10::Allocator* fallback = nullptr;
  std::atomic<size_t> min_bytes{std::numeric_limits<size_t>::max()};

  c10::DataPtr allocate(size_t n) override {
    if (n >= min_bytes) {
      const size_t length = round_up(n, kPage);
      if (void* p = map_aligned(length)) return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
    }
    return fallback->allocate(n);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

// Storages allocated while it was installed keep a pointer to it for life: never destroyed.
HugePageAllocator& huge_allocator = *new HugePageAllocator();

}  // namespace

// min_bytes > 0: allocations of at least min_bytes on huge pages from now on; 0: every allocation
// to the allocator that was in place before. Once installed the huge-page allocator stays torch's
// CPU allocator, passing allocations on: oneDNN frees its raw buffers through whatever allocator is
// installed when they go, so putting the old one back would hand it mappings it cannot free.
// Returns whether large allocations now go onto huge pages (false after a 0, or when an
// allocator of higher priority kept its place).
bool set_huge_page_allocations(int64_t min_bytes) {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != &huge_allocator) {
    if (min_bytes <= 0) return false;
    huge_allocator.fallback = current;
    fallback_raw_deleter = current->raw_deleter();
    c10::SetCPUAllocator(&huge_allocator, 0);
    if (c10::GetCPUAllocator() != &huge_allocator) return false;
  }
  huge_allocator.min_bytes = min_bytes > 0 ? static_cast<size_t>(min_bytes) : std::numeric_limits<size_t>::max();
  return min_bytes > 0;
}

// Bytes the huge-page allocator has mapped since the process started.
int64_t huge_page_bytes() { return mapped_bytes.load(); }
