"""A checkpoint on the requeue signal: the step in progress finishes, the run is checkpointed at
it, then the process exits the way whoever sent the signal expects.

SLURM signals a job before it ends it: `--signal=USR2@120` (the launcher's `signal_delay_s`,
depthbench.launch.executors.slurm_parameters) 120 s before the time limit, and SIGTERM on
preemption, `scontrol requeue` or `scancel` (SIGKILL follows after the cluster's KillWait).
Without this hook a requeued job loses everything since the last periodic checkpoint (up to
`checkpoint_every` steps).

`RequeueHook` replaces the handlers of SIGUSR2 and SIGTERM for the duration of the loop (not one
that was ignored: SIG_IGN stays). The handler only records the signal. After each step (after
the periodic checkpoint hook) the ranks agree, with one small all-reduce on a CPU (gloo) group,
whether any of them was signalled, so that all stop at the same step, since SLURM signals each
task at its own moment. Then, unless that step is the last one (the run simply finishes and
writes its outputs), every rank writes its part of a checkpoint at that step and waits for it
to be complete; then the signal is handed to the handler that was installed before:

- under submitit (the `local` and `slurm` backends) SIGUSR2 goes to submitit's handler, which on
  rank 0 requeues the job (`scontrol requeue`; the local executor restarts it) and exits; the
  requeued job resumes from this checkpoint (TrainingJob is idempotent). SIGTERM goes to
  submitit's, which only logs it: SLURM has requeued (preemption) or cancelled the job itself;
- any other Python handler (the inline dispatcher's: cancel and exit) is called likewise;
- the process then exits with status 128 + the signal number (the shell's convention for
  "ended by that signal"; 140 for SIGUSR2, 143 for SIGTERM) by SystemExit, so that no summary is
  written and Snakemake, submitit and SLURM all see an unfinished run.
"""

from __future__ import annotations

import signal
import sys
import threading

import torch

from depthbench.train.hook_base import Hook

REQUEUE_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class RequeueHook(Hook):
    def __init__(self, total: int, signals=REQUEUE_SIGNALS):
        self.total, self.signals = total, tuple(signals)
        self.previous: dict[int, object] = {}
        self.received = 0  # the signal number caught, 0 for none
        self.group = None

    # ---- handlers
    def _record(self, signum, frame) -> None:
        self.received = signum  # only this: the loop acts at the end of the step

    def on_fit_start(self, trainer):
        import torch.distributed as dist

        if trainer.ctx.enabled:  # the agreement runs on the main thread, on a CPU group
            self.group = (
                dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            )
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for s in self.signals:
            current = signal.getsignal(s)
            if current is not signal.SIG_IGN:
                self.previous[s] = current
                signal.signal(s, self._record)

    def _restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}

    def close(self, trainer):
        self._restore()

    # ---- the step boundary
    def _agreed(self, trainer) -> int:
        """The largest signal number any rank caught (0: none), the same on every rank."""
        if self.group is None:
            return self.received
        import torch.distributed as dist

        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def on_step_logged(self, trainer, step):
        signum = self._agreed(trainer)
        if not signum or step >= self.total:
            return
        signum = self.received or signum  # each rank hands over the signal it got
        name = signal.Signals(signum).name
        trainer.snapshot(blocking=True)
        if trainer.ctx.is_main:
            print(
                f"[{trainer.spec.run_id}] {name}: checkpointed step {step}; exiting to be requeued",
                file=sys.stderr,
            )
        handler = self.previous.get(signum)
        self._restore()  # a second signal during the hand-over takes its usual course
        if callable(handler):
            handler(signum, None)  # submitit: requeue and exit on rank 0
        raise SystemExit(128 + signum)
