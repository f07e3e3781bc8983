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
//
// The weight arena. A page's first touch is the kernel zeroing it, and in a virtual machine whose
// host backs guest memory only when it is first touched (and takes freed memory back) it is also
// the host's fault: on the VMs we measure, faulting in 700 MiB of fresh huge pages took 1.9-2.3 s
// when the host had not backed them (0.07 s when it had), and a Q8_0 load spent 1-3.5 s of system
// time so. engine/heap.py's prefault_weights maps a file's size and faults it in from a thread
// while the engine process still imports (on a core the imports leave idle), and
// set_huge_page_arena hands that mapping over: from then on each large allocation is the arena's
// next 4 KiB-aligned piece until it runs out (then a mapping of its own again). Each piece is
// freed like a mapping of its own (munmap of its range); close_huge_page_arena unmaps what no
// allocation took.
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

// The open arena's untaken range [next, end) (both null when none is open); under regions().mutex.
struct Arena {
  char* next = nullptr;
  char* end = nullptr;
  int64_t taken = 0;   // bytes handed out from the open arena
};
Arena arena;

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

// The arena's next length bytes (a multiple of 4 KiB), registered as a region, or nullptr when
// no arena is open or it has fewer left.
void* take_from_arena(size_t length) {
  Regions& r = regions();
  std::lock_guard<std::mutex> guard(r.mutex);
  if (arena.next == nullptr || static_cast<size_t>(arena.end - arena.next) < length) return nullptr;
  char* p = arena.next;
  arena.next += length;
  arena.taken += static_cast<int64_t>(length);
  mapped_bytes += static_cast<int64_t>(length);
  r.length.emplace(p, length);
  return p;
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
      void* p = take_from_arena(length);
      if (p == nullptr) p = map_aligned(length);
      if (p != nullptr) return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
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

// Bytes the huge-page allocator has mapped (or taken from arenas) since the process started.
int64_t huge_page_bytes() { return mapped_bytes.load(); }

// Closes the open arena, if any: unmaps the part no allocation took. Returns the bytes taken from
// it (0 with none open).
int64_t close_huge_page_arena() {
  Regions& r = regions();
  std::lock_guard<std::mutex> guard(r.mutex);
  if (arena.next == nullptr) return 0;
  if (arena.end > arena.next) munmap(arena.next, arena.end - arena.next);
  const int64_t taken = arena.taken;
  arena = Arena();
  return taken;
}

// Takes over the mapping [address, address + length) (anonymous, read-write, page-aligned; made by
// heap.prefault_weights): large allocations come from it, in order, until it is closed or runs
// out. An arena still open is closed first. This library unmaps the whole range in the end, piece
// by piece with the tensors and the rest at close_huge_page_arena: the caller must not.
void set_huge_page_arena(int64_t address, int64_t length) {
  TORCH_CHECK(address % static_cast<int64_t>(kPage) == 0 && length > 0 && length % static_cast<int64_t>(kPage) == 0,
              "set_huge_page_arena: a page-aligned range, got ", address, " + ", length);
  close_huge_page_arena();
  Regions& r = regions();
  std::lock_guard<std::mutex> guard(r.mutex);
  arena.next = reinterpret_cast<char*>(address);
  arena.end = arena.next + length;
  arena.taken = 0;
}
