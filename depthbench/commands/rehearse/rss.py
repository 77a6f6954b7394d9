"""Host memory, measured and available: the process's resident-set high-water mark over a region
of code, and what the machine can still give (used by `depthbench rehearse`).

Measured: the peak resident set size (RSS) of this process while the region runs, minus the RSS
on entry, so memory held before (Python, torch's libraries, an earlier model not yet returned
to the OS) is not counted. On Linux >= 4.0 writing "5" to /proc/self/clear_refs resets the
kernel's high-water mark (VmHWM in /proc/self/status) to the current RSS, and VmHWM on exit is
the exact peak: no sampling can miss a short spike. Where that file is not writable (other
systems), a thread samples psutil's RSS every `interval` seconds; the peak can then be missed
by up to one interval's growth. Either way RSS counts pages touched, not bytes requested: a
tensor allocated but never written (torch.empty) is not counted until it is filled.

glibc keeps freed memory for reuse: with its dynamic mmap threshold, once a large block has
been freed, blocks of that size come from the heap and stay resident after `free`, so a second
model built in the same process reuses the first one's pages and shows no growth at all.
`release_freed_memory` therefore
pins the threshold at 128 KiB (mallopt M_MMAP_THRESHOLD, which also turns the dynamic threshold
off: every tensor above 128 KiB is its own mapping, returned to the OS when freed) and returns
the freed heap with malloc_trim(0). Without glibc (macOS, musl) it only collects garbage, and a
measurement after an earlier model may read low.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time
from pathlib import Path

import psutil

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm() -> int | None:
    """VmHWM in bytes (Linux), or None."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return _vm_hwm() is not None
    except OSError:
        return False


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_MMAP_THRESHOLD = 128 * 1024  # glibc's default static threshold


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Return freed memory to the OS before a measurement (see the module docstring); True
    where glibc did it."""
    gc.collect()
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    libc.malloc_trim(0)
    return True


def current_rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def available_memory() -> int:
    """Bytes the machine can give now without swapping (MemAvailable: free plus reclaimable
    cache)."""
    return int(psutil.virtual_memory().available)


class PeakRSS:
    """`with PeakRSS() as m: ...` (or `m.begin()` ... `m.end()`), then `m.peak` (bytes above
    the RSS on entry), `m.start`, `m.method` ("vmhwm" exact, or "sampled")."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.start = self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> "PeakRSS":
        return self.begin()

    def __exit__(self, *exc) -> None:
        self.end()

    def begin(self) -> "PeakRSS":
        release_freed_memory()
        self.start = current_rss()
        if _reset_hwm():
            self.method = "vmhwm"
        else:
            self.method = "sampled"
            self._sampled = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, current_rss())
            time.sleep(self.interval)

    def end(self) -> None:
        """Record the peak; later calls keep the first record."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            top = max(self._sampled, current_rss())
        else:
            top = _vm_hwm() or current_rss()
        self.peak = max(0, top - self.start)
