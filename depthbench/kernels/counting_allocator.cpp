// A CPU allocator that counts (counting_allocator_*, below): the bytes of the blocks it has handed
// out and not yet taken back, and their high-water mark, over every thread of the process. It is
// installed over torch's CPU allocator for one measurement (depthbench.train.measured_memory, the
// CPU's counterpart of the CUDA caching allocator's counters) and removed after it; the blocks
// come from the allocator it replaced, and each goes back to it through that allocator's own
// deleter. A block made before the installation is freed by the deleter it was made with and
// never counted; a block made while installed is uncounted when freed, on whichever thread that
// happens (gloo's and the autograd engine's included), unless a later installation has started
// counting again: a block of an earlier measurement freed during this one (its garbage collected
// late) does not lower this one's counts. Storages keep the allocator that made them and resize
// through it, after the measurement too: once removed, it hands out the replaced allocator's blocks
// unchanged and counts nothing. Torch's CPU allocator slot keeps the priority of the installation
// (255), so that a later lower-priority SetCPUAllocator does not take.
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <unordered_map>

namespace {

// A block as the replaced allocator made it: its own context and deleter free it.
struct Block {
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;
  int64_t nbytes;
  int64_t installation;  // the installation that counted it
};

std::atomic<int64_t> alive_bytes{0};
std::atomic<int64_t> peak_bytes{0};
std::atomic<int64_t> installation{0};
std::atomic<bool> installed{false};
// the replaced allocator, kept after the removal for the storages made while installed
std::atomic<c10::Allocator*> replaced{nullptr};

// The blocks out, by address. On the heap and never destroyed: a tensor freed during the
// interpreter's shutdown, after static destructors ran, must still find them.
std::mutex& blocks_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::unordered_map<void*, Block>& blocks() {
  static auto* map = new std::unordered_map<void*, Block>;
  return *map;
}

void count(int64_t nbytes) {
  const int64_t now = alive_bytes.fetch_add(nbytes) + nbytes;
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
}

void release(void* ptr) {
  Block block;
  {
    std::lock_guard<std::mutex> lock(blocks_mutex());
    auto found = blocks().find(ptr);
    if (found == blocks().end()) {
      // raw_deallocate asks the allocator installed now for its raw deleter: a raw block of the
      // replaced allocator goes back to it
      const c10::DeleterFnPtr raw = replaced.load()->raw_deleter();
      if (raw != nullptr) raw(ptr);
      return;
    }
    block = found->second;
    blocks().erase(found);
  }
  if (block.installation == installation.load()) alive_bytes.fetch_sub(block.nbytes);
  if (block.inner_deleter != nullptr) block.inner_deleter(block.inner_context);
}

// The data pointer is its own context, as torch's CPU allocator makes it: raw_allocate (oneDNN's
// scratchpads, under bf16) asserts that, and raw_deallocate frees through raw_deleter.
class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr data = replaced.load()->allocate(nbytes);
    void* ptr = data.get();
    if (ptr == nullptr || !installed.load()) return data;  // zero bytes, or not counting
    const c10::DeleterFnPtr deleter = data.get_deleter();
    void* context = data.release_context();
    {
      std::lock_guard<std::mutex> lock(blocks_mutex());
      blocks()[ptr] = {context, deleter, static_cast<int64_t>(nbytes), installation.load()};
    }
    count(static_cast<int64_t>(nbytes));
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCPUAllocator counting;

}  // namespace

// Install the counting allocator (the counts start at 0); false if it already is.
bool counting_allocator_install() {
  if (installed.load()) return false;
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != &counting) replaced = current;
  installation.fetch_add(1);
  alive_bytes = 0;
  peak_bytes = 0;
  installed = true;
  c10::SetCPUAllocator(&counting, /*priority=*/255);
  return true;
}

// Put the replaced allocator back; the blocks still out are uncounted as they are freed.
void counting_allocator_remove() {
  if (!installed.load()) return;
  c10::SetCPUAllocator(replaced.load(), /*priority=*/255);
  installed = false;
}

// (bytes alive, their high-water mark since the installation or the last reset).
std::tuple<int64_t, int64_t> counting_allocator_counts() {
  return {alive_bytes.load(), peak_bytes.load()};
}

// Start the high-water mark again from the bytes alive now.
void counting_allocator_reset_peak() { peak_bytes = alive_bytes.load(); }
