"""The CPU's memory measurement (depthbench.train.measured_memory): the counting allocator of
DepthBench's C++ extension counts every block alive and their high-water mark, whichever thread
frees them, and a training step measured with it equals the running sum of torch's profiler's
allocation events (counted apart from it) on one process, where the profiler sees every
thread that allocates. A settled read waits for the frees other threads make late."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
import torch

from depthbench import kernels
from depthbench.models.config import ModelConfig
from depthbench.train.measured_memory import (
    SETTLE_S,
    allocator_step_memory,
    counted_cpu_allocations,
    settled_alive,
)
from depthbench.train.memory import estimate_memory

reason = kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    reason is not None, reason=f"the C++ extension cannot be built here: {reason}"
)

KIB = 1024


def test_it_counts_the_bytes_alive_and_their_high_water_mark():
    with counted_cpu_allocations() as counter:
        a = torch.empty(KIB, dtype=torch.float32)
        b = torch.empty(2 * KIB, dtype=torch.float64)
        assert counter.alive() == 4 * KIB + 16 * KIB
        del a
        assert counter.alive() == 16 * KIB
        assert counter.peak() == 20 * KIB
        counter.reset_peak()
        assert counter.peak() == 16 * KIB
        c = torch.empty(KIB, dtype=torch.uint8)
        assert counter.peak() == 17 * KIB
        del b, c
        assert (counter.alive(), counter.peak()) == (0, 17 * KIB)


def test_a_block_freed_on_another_thread_is_uncounted():
    """gloo's threads and the autograd engine's free tensors the measured thread made."""
    with counted_cpu_allocations() as counter:
        held = [torch.empty(8 * KIB, dtype=torch.uint8)]
        assert counter.alive() == 8 * KIB
        thread = threading.Thread(target=held.clear)
        thread.start()
        thread.join()
        assert counter.alive() == 0


def _settled_while_another_thread_frees(counter, before_the_free) -> int:
    """`settled_alive` read as another thread frees a block once `before_the_free` returns."""
    held = [torch.empty(8 * KIB, dtype=torch.uint8)]
    start = threading.Event()

    def free_later():
        start.wait()
        before_the_free()
        held.clear()

    thread = threading.Thread(target=free_later)
    thread.start()
    assert counter.alive() == 8 * KIB
    start.set()
    try:
        return settled_alive(counter)
    finally:
        thread.join()


def test_a_settled_count_waits_for_a_late_free():
    """A block another thread frees a while after the measured thread reads (as gloo's worker
    frees a reduce-scatter's scratch): an immediate read still counts it, a settled one does not;
    with nothing freed in the background the settled read is the immediate one."""
    with counted_cpu_allocations() as counter:
        assert _settled_while_another_thread_frees(counter, lambda: time.sleep(SETTLE_S / 5)) == 0
        kept = torch.empty(KIB, dtype=torch.uint8)
        assert settled_alive(counter) == counter.alive() == KIB
        del kept


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's thread states")
def test_a_settled_count_waits_for_a_thread_that_runs():
    """A block freed by a thread once it has run for several times SETTLE_S (as gloo's worker
    frees a scratch once it gets a core): while it runs, the count holds still but the thread is
    not asleep, so the settled read waits for the free."""
    seconds = 6 * SETTLE_S
    rounds, took = 1000, 0.0
    while took < seconds / 10:  # hashlib's rounds per second on this CPU
        rounds *= 2
        begin = time.perf_counter()
        hashlib.pbkdf2_hmac("sha256", b"p", b"s", rounds)
        took = time.perf_counter() - begin

    def run():  # one call that runs without the GIL for `seconds`: state R throughout
        hashlib.pbkdf2_hmac("sha256", b"p", b"s", int(rounds * seconds / took))

    with counted_cpu_allocations() as counter:
        assert _settled_while_another_thread_frees(counter, run) == 0


def test_blocks_of_an_earlier_measurement_leave_a_later_ones_counts_alone():
    """Garbage of an earlier measurement collected during a later one lowers nothing; blocks made
    before any installation are never counted; after the measurement torch's own allocator
    serves, uncounted."""
    before = torch.empty(KIB, dtype=torch.uint8)
    with counted_cpu_allocations():
        earlier = torch.empty(4 * KIB, dtype=torch.uint8)
    after = torch.empty(KIB, dtype=torch.uint8)
    with counted_cpu_allocations() as counter:
        now = torch.empty(2 * KIB, dtype=torch.uint8)
        del earlier, before
        assert counter.alive() == 2 * KIB
        del now
        assert counter.alive() == 0
    with counted_cpu_allocations() as counter:
        del after
        assert (counter.alive(), counter.peak()) == (0, 0)


def test_blocks_keep_the_shape_torchs_raw_allocation_asks_for():
    """A block's data pointer is its own context, as torch's CPU allocator makes it: oneDNN's
    bf16 products take their scratchpads through `raw_allocate`, which asserts that (and frees
    through `raw_deleter`). A bf16 linear layer forward and backward, counted, gives the result
    it gives uncounted, and leaves nothing alive but what it returns. Where oneDNN runs bf16
    products (AVX512-BF16 or AMX CPUs) this takes the raw path; elsewhere it checks the counts
    and results only."""
    torch.manual_seed(0)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)

    def run():
        y = torch.nn.functional.linear(x, w)
        (dx,) = torch.autograd.grad(y.float().square().sum(), x)
        return y, dx

    expected = run()
    with counted_cpu_allocations() as counter:
        got = run()
        kept = sum(t.untyped_storage().nbytes() for t in got)
        assert counter.alive() == kept
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_storages_made_while_counting_grow_after_the_measurement():
    """A storage keeps the allocator that made it and resizes through it: after the measurement
    that allocator hands out the replaced allocator's blocks, uncounted; during a later one it
    counts them as that measurement's."""
    with counted_cpu_allocations():
        kept = torch.empty(0)
    kept.resize_(1000).fill_(2.0)  # resized through the removed allocator
    assert torch.equal(kept, torch.full((1000,), 2.0))
    with counted_cpu_allocations() as counter:
        kept.resize_(2000)  # a new block of 8000 bytes; the old one was never counted
        assert (counter.alive(), counter.peak()) == (8000, 8000)
    assert torch.equal(kept[:1000], torch.full((1000,), 2.0))


def test_one_measurement_at_a_time():
    with counted_cpu_allocations():
        with pytest.raises(RuntimeError, match="already counting"):
            with counted_cpu_allocations():
                pass
    with counted_cpu_allocations() as counter:  # the failed one removed nothing
        x = torch.empty(KIB, dtype=torch.uint8)
        assert counter.alive() == KIB
        del x


def _profiled_step(cfg, micro_batches) -> tuple[int, int]:
    """(bytes alive between the steps, the measured step's high-water mark) of the same two
    steps, from torch's profiler: the running sum of its allocation events, in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    from depthbench.train.measured_memory import TrainingStep

    step = TrainingStep(cfg, 2, 32, False, torch.device("cpu"), micro_batches=micro_batches)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.build()
        step.run()
        with record_function("measured step"):
            step.run()
    events, start, end = [], None, None
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        elif node.name == "measured step":
            start, end = node.start_time_ns, node.end_time_ns
    alive, static, peak = 0, 0, 0
    for at, size in sorted(events):
        if at > end:
            break
        alive += size
        if at < start:
            static = alive
        else:
            peak = max(peak, alive)
    return static, peak


@pytest.mark.parametrize("arch", ["pre_ln", "hc"])
def test_a_measured_step_equals_the_profilers_allocation_events(arch):
    """Weights, AdamW and the step's peak to the byte, and the estimate an upper bound on it."""
    cfg = ModelConfig(arch=arch, vocab_size=128, d_model=32, n_layer=2, n_head=2, max_seq_len=32)
    got = allocator_step_memory(cfg, 2, 32, False, "cpu", micro_batches=2)
    assert (got.static, got.peak) == _profiled_step(cfg, 2)
    est = estimate_memory(cfg, 2, 32, bf16=False, device="cpu")
    assert est.weights + est.optimizer <= got.static <= 1.01 * (est.weights + est.optimizer)
    assert got.peak <= est.total("none")


def test_the_cpu_measurement_needs_the_extension(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)
    with pytest.raises(RuntimeError, match="C\\+\\+ extension"):
        with counted_cpu_allocations():
            pass
