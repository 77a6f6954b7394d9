"""The CPU's bytes of a training step, for the tests that hold depthbench.train.memory's estimate to
measured memory without a GPU (tests/unit/test_measured_memory.py,
tests/integration/test_distributed_memory.py).

A counting allocator (tests/counting_allocator.cpp) is installed over torch's CPU allocator for a
measurement: it counts each block torch allocates on the CPU while it is installed, as it is
handed out and as it is freed, on any thread (gloo's included, which torch's profiler does not
follow). Not counted: the buffers gloo allocates for itself, outside torch's allocator, and
storages made before the measurement that grow during it. It is compiled here with
torch.utils.cpp_extension (g++ and the pinned ninja, about half a minute; cached under
TORCH_EXTENSIONS_DIR): `python -m tests.cpu_memory` builds it ahead, which
`bash scripts/setup.sh test` does while pip installs.

On a rank of several, gloo's worker thread lets go of a collective it has finished (and with it of
what the collective holds: a reduce-scatter's scratch copy of its whole input, made by
ProcessGroupGloo::reduce_scatter_tensor_coalesced) after it has released the caller: at once where
it has a core, but on a loaded machine a runnable worker waits its turn for tens of milliseconds.
No call waits for it, so the counter's `settled()` reads the count once it has held still for
SETTLE_S while every other thread of the process slept (a waiting runnable thread, however long
it waits, keeps the count from settling).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("counting_allocator.cpp")
SETTLE_S = 0.05
SETTLE_TIMEOUT_S = 10.0
_built: dict = {}


def unavailable_reason() -> str | None:
    """Why the counting allocator cannot be built here, or None."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    try:
        import ninja  # noqa: F401
    except ImportError:
        return "the ninja package is not installed"
    return None


def extension():
    """The compiled counting allocator (built on the first call, cached on disk)."""
    if "module" not in _built:
        from torch.utils.cpp_extension import load

        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
        digest = hashlib.sha256(SOURCE.read_bytes() + str(SOURCE.resolve()).encode()).hexdigest()
        py = "".join(platform.python_version_tuple()[:2])
        build = Path(root) / "depthbench-tests" / f"py{py}-torch{torch.__version__}-{digest[:12]}"
        build.mkdir(parents=True, exist_ok=True)
        _built["module"] = load(
            name="depthbench_counting_allocator",
            sources=[str(SOURCE)],
            extra_cflags=["-O2"],
            build_directory=str(build),
            verbose=False,
        )
    return _built["module"]


def settled_alive(counter) -> int:
    """Bytes alive by `counter` once nothing is freed in the background: read every millisecond
    until it has not changed for SETTLE_S while the process's other threads all slept
    (`_other_threads_asleep`), or after SETTLE_TIMEOUT_S where that never happens."""
    start = since = time.monotonic()
    alive = counter.alive()
    while (now := time.monotonic()) - since < SETTLE_S and now - start < SETTLE_TIMEOUT_S:
        time.sleep(0.001)
        current = counter.alive()
        if current != alive or not _other_threads_asleep():
            alive, since = current, time.monotonic()
    return alive


def _other_threads_asleep() -> bool:
    """Whether no other thread of this process runs or waits for a core (state R, or D: in the
    kernel, uninterruptible) by Linux's /proc/self/task/*/stat; True where there is no /proc."""
    me = threading.get_native_id()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for tid in tasks:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                # "tid (name) state ...": the name may hold spaces and parentheses
                state = stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread has ended
        if state in ("R", "D"):
            return False
    return True


class CpuCounter:
    """The counting allocator's counts while it is installed (depthbench.train.measured_memory's
    counter interface)."""

    def __init__(self, module):
        self.module = module

    def alive(self) -> int:
        return self.module.counting_allocator_counts()[0]

    def peak(self) -> int:
        return self.module.counting_allocator_counts()[1]

    def reset_peak(self) -> None:
        self.module.counting_allocator_reset_peak()

    def settled(self) -> int:
        return settled_alive(self)


@contextmanager
def counted_cpu_allocations():
    """A `CpuCounter` while the counting allocator replaces torch's CPU allocator. Raises when a
    measurement is already counting."""
    module = extension()
    if not module.counting_allocator_install():
        raise RuntimeError("a CPU memory measurement is already counting in this process")
    try:
        yield CpuCounter(module)
    finally:
        module.counting_allocator_remove()


def cpu_step_memory(*args, **kwargs):
    """depthbench.train.measured_memory.allocator_step_memory on the CPU, counted here."""
    # imported here: `python -m tests.cpu_memory` builds the allocator before DepthBench's
    # dependencies are installed (scripts/setup.sh)
    from depthbench.train.measured_memory import allocator_step_memory

    with counted_cpu_allocations() as counter:
        return allocator_step_memory(*args, device="cpu", counter=counter, **kwargs)


if __name__ == "__main__":  # build it ahead (scripts/setup.sh test)
    reason = unavailable_reason()
    if reason:
        sys.exit(f"the counting allocator cannot be built here: {reason}")
    extension()
    print("counting allocator ready")
