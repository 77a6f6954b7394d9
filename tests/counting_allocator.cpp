// A CPU allocator that counts (counting_allocator_*, below): the bytes of the blocks it has handed
// out and not yet taken back, and their high-water mark, over every thread of the process. It is
// installed over torch's CPU allocator for one measurement (tests/cpu_memory.py, the CPU's
// counterpart of the CUDA caching allocator's counters) and removed after it; the blocks
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
#include <torch/extension.h>

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

// The counts and the blocks out, by address, all changed under one mutex (an installation resets
// the counts while other threads free blocks). On the heap and never destroyed: a tensor freed
// during the interpreter's shutdown, after static destructors ran, must still find them.
struct State {
  std::mutex mutex;
  std::unordered_map<void*, Block> blocks;
  int64_t alive_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t installation = 0;
  bool installed = false;
};

State& state() {
  static auto* shared = new State;
  return *shared;
}

// the replaced allocator, kept after the removal for the storages made while installed
std::atomic<c10::Allocator*> replaced{nullptr};

c10::Allocator* replaced_allocator() {
  c10::Allocator* allocator = replaced.load();
  return allocator != nullptr ? allocator : c10::GetDefaultCPUAllocator();
}

void release(void* ptr) {
  Block block{};
  bool found = false;
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.blocks.find(ptr);
    if (it != s.blocks.end()) {
      found = true;
      block = it->second;
      s.blocks.erase(it);
      if (block.installation == s.installation) s.alive_bytes -= block.nbytes;
    }
  }
  // the deleters run outside the lock: one that frees through this allocator again must not wait
  // on it
  if (!found) {
    // raw_deallocate asks the allocator installed now for its raw deleter: a raw block of the
    // replaced allocator goes back to it
    const c10::DeleterFnPtr raw = replaced_allocator()->raw_deleter();
    if (raw != nullptr) raw(ptr);
    return;
  }
  if (block.inner_deleter != nullptr) block.inner_deleter(block.inner_context);
}

// The data pointer is its own context, as torch's CPU allocator makes it: raw_allocate (oneDNN's
// scratchpads, under bf16) asserts that, and raw_deallocate frees through raw_deleter.
class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr data = replaced_allocator()->allocate(nbytes);
    void* ptr = data.get();
    if (ptr == nullptr) return data;  // zero bytes: nothing to count
    State& s = state();
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (!s.installed) return data;  // removed: the replaced allocator's block, uncounted
      const c10::DeleterFnPtr deleter = data.get_deleter();
      void* context = data.release_context();
      s.blocks[ptr] = {context, deleter, static_cast<int64_t>(nbytes), s.installation};
      s.alive_bytes += static_cast<int64_t>(nbytes);
      if (s.alive_bytes > s.peak_bytes) s.peak_bytes = s.alive_bytes;
    }
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
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.installed) return false;
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != &counting) replaced = current;
    s.installation += 1;
    s.alive_bytes = 0;
    s.peak_bytes = 0;
    s.installed = true;
  }
  c10::SetCPUAllocator(&counting, /*priority=*/255);
  return true;
}

// Put the replaced allocator back; the blocks still out are uncounted as they are freed.
void counting_allocator_remove() {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.installed) return;
    s.installed = false;
  }
  c10::SetCPUAllocator(replaced_allocator(), /*priority=*/255);
}

// (bytes alive, their high-water mark since the installation or the last reset).
std::tuple<int64_t, int64_t> counting_allocator_counts() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return {s.alive_bytes, s.peak_bytes};
}

// Start the high-water mark again from the bytes alive now.
void counting_allocator_reset_peak() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.peak_bytes = s.alive_bytes;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("counting_allocator_install", &counting_allocator_install, "count the CPU's allocations from now on");
  module.def("counting_allocator_remove", &counting_allocator_remove, "put the CPU allocator it replaced back");
  module.def("counting_allocator_counts", &counting_allocator_counts, "(bytes alive, their high-water mark)");
  module.def("counting_allocator_reset_peak", &counting_allocator_reset_peak, "the high-water mark from now");
}
