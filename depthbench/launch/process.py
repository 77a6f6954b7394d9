"""How a workflow job's process ends.

`exit_without_teardown()` is the last line of every Snakemake entry script (scripts/*.py): it
flushes the standard streams and the job's log and leaves with os._exit, skipping the
interpreter's finalisation. Why: tearing down an interpreter that imported torch (freeing its
modules and extension state) takes over a second per job on a laptop's core
(docs/benchmarks.md), and the default workflow runs over a hundred jobs. Nothing is lost by
skipping it: every output is written atomically and fsynced before the script's last statement
(depthbench.util.io), the trackers are closed by the trainer, and an exception still ends the job
the normal way (this is reached only on success). atexit handlers are run first, so a library
that registered one still gets to finish.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_without_teardown(code: int = 0) -> None:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):  # closed or absent
            pass
    os._exit(code)
