"""`python -m depthbench.kernels`: build the CPU kernels now (scripts/setup.sh runs it while pip
installs the other packages) rather than in the first workflow job or test that uses them.

Prints where the build is cached, or why the kernels are unavailable; exits 1 in that case (the
workflow still runs, on the PyTorch code)."""

from __future__ import annotations

import logging
import sys
import time

from depthbench import kernels


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    start = time.perf_counter()
    if kernels.cpu_kernels() is None:
        print(f"CPU kernels unavailable: {kernels.unavailable_reason() or 'the build failed'}")
        return 1
    print(f"CPU kernels ready in {time.perf_counter() - start:.0f} s: {kernels.build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
