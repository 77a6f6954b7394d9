// A CPU allocator that counts (counting_allocator_*, below): the bytes of the blocks it has handed
// out and not yet taken back, and their high-water mark, over every thread of the process. It is
// installed over torch's CPU allocator for one measurement (depthbench.train.measured_memory, the
// CPU's counterpart of the CUDA caching allocator's counters) and removed after it; the blocks
// come from the allocator it replaced, and each goes back to it through that allocator's own
// deleter. A block made before the installation is freed by the deleter it was made with and
// never counted; a block made while installed is uncounted when freed, on whichever thread that
// happens (gloo's and the autograd engine's included), unless a later installation has started
// counting again: a block of an earlier measurement freed during this one (its garbage collected
// late) does not lower this one's counts.
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <tuple>
#include <utility>

namespace {

struct Block {
  c10::DataPtr inner;  // the replaced allocator's block, freed when this is deleted
  int64_t nbytes;
  int64_t installation;  // the installation that counted it
};

std::atomic<int64_t> alive_bytes{0};
std::atomic<int64_t> peak_bytes{0};
std::atomic<int64_t> installation{0};

void count(int64_t nbytes) {
  const int64_t now = alive_bytes.fetch_add(nbytes) + nbytes;
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
}

void release(void* context) {
  auto* block = static_cast<Block*>(context);
  if (block->installation == installation.load()) alive_bytes.fetch_sub(block->nbytes);
  delete block;
}

class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::Allocator* inner = nullptr;

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr data = inner->allocate(nbytes);
    void* ptr = data.get();
    count(static_cast<int64_t>(nbytes));
    return {ptr, new Block{std::move(data), static_cast<int64_t>(nbytes), installation.load()}, &release,
            c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCPUAllocator counting;

}  // namespace

// Install the counting allocator (the counts start at 0); false if it already is.
bool counting_allocator_install() {
  if (counting.inner != nullptr) return false;
  counting.inner = c10::GetCPUAllocator();
  installation.fetch_add(1);
  alive_bytes = 0;
  peak_bytes = 0;
  c10::SetCPUAllocator(&counting, /*priority=*/255);
  return true;
}

// Put the replaced allocator back; the blocks still out are uncounted as they are freed.
void counting_allocator_remove() {
  if (counting.inner == nullptr) return;
  c10::SetCPUAllocator(counting.inner, /*priority=*/255);
  counting.inner = nullptr;
}

// (bytes alive, their high-water mark since the installation or the last reset).
std::tuple<int64_t, int64_t> counting_allocator_counts() {
  return {alive_bytes.load(), peak_bytes.load()};
}

// Start the high-water mark again from the bytes alive now.
void counting_allocator_reset_peak() { peak_bytes = alive_bytes.load(); }
