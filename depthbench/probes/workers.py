"""Sharing a probe's passes among workers, each with its own copy of the model.

Probes swap weights in place, so two passes at once need two copies of the model. With workers > 1
(CPU only) the items are shared among that many workers, each running torch with one intra-op
thread. At probe shapes (d = 32, 2 048 tokens) the kernels are small, so one stream of them is
bound by Python and dispatch overhead rather than by arithmetic, and two single-threaded streams
do more work than one two-threaded stream. On Linux the workers are forked processes (the copy is
the fork's copy-on-write image, and no GIL is shared). Elsewhere, where forking a process that has
loaded torch is not safe, and inside a daemonic process, which may not start children, they are
threads with deep copies (the GIL is released inside kernels but serialises the Python between
them).
"""

from __future__ import annotations

import copy
import multiprocessing
import multiprocessing.connection
import pickle
import sys
import threading
import traceback
from typing import Callable

import torch


def _on_cpu(model) -> bool:
    params = model.parameters() if hasattr(model, "parameters") else iter(())
    first = next(params, None)
    return first is None or first.device.type == "cpu"


def map_over_model_copies(model, items: list, fn: Callable, workers: int = 1) -> list:
    """[fn(m, item) for item in items], where m is `model` or a private copy of it (see the
    module docstring). Items are taken in the given order from a shared counter (put the longest
    first); results come back in item order."""
    workers = max(1, min(workers, len(items)))
    if workers == 1 or not _on_cpu(model):
        return [fn(model, item) for item in items]
    # a daemonic process (a multiprocessing pool's worker, say) may not start children
    if sys.platform.startswith("linux") and not multiprocessing.current_process().daemon:
        return _map_in_forked_processes(model, items, fn, workers)
    return _map_in_threads(model, items, fn, workers)


def _map_in_threads(model, items: list, fn: Callable, workers: int) -> list:
    results: list = [None] * len(items)
    queue = iter(enumerate(items))
    lock, errors = threading.Lock(), []

    def work(m) -> None:
        while not errors:
            with lock:
                nxt = next(queue, None)
            if nxt is None:
                return
            try:
                results[nxt[0]] = fn(m, nxt[1])
            except BaseException as exc:  # re-raised in the calling thread
                errors.append(exc)

    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = [
            threading.Thread(target=work, args=(model if i == 0 else copy.deepcopy(model),))
            for i in range(workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(intra_op)
    if errors:
        raise errors[0]
    return results


def _forked_worker(model, items: list, fn: Callable, counter, conn) -> None:
    """Runs in a forked child: take the next item index from the shared counter until none is
    left; send (index, result) pickled with plain pickle (torch's multiprocessing reductions
    would pass tensors as shared-memory handles that must outlive this process)."""
    torch.set_num_threads(1)
    i = -1
    try:
        while True:
            with counter.get_lock():
                i = counter.value
                counter.value += 1
            if i >= len(items):
                break
            conn.send_bytes(pickle.dumps(("ok", i, fn(model, items[i]))))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", i, traceback.format_exc())))
    finally:
        conn.send_bytes(pickle.dumps(("done", -1, None)))
        conn.close()


def _map_in_forked_processes(model, items: list, fn: Callable, workers: int) -> list:
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("q", 0)
    procs, readers = [], {}
    for _ in range(workers):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_forked_worker, args=(model, items, fn, counter, writer), daemon=True
        )
        proc.start()
        writer.close()  # the child holds the only write end: EOF here means it is gone
        procs.append(proc)
        readers[reader] = proc
    results: list = [None] * len(items)
    received = [False] * len(items)
    failure = None
    try:
        while readers and failure is None:
            for reader in multiprocessing.connection.wait(list(readers)):
                try:
                    kind, i, payload = pickle.loads(reader.recv_bytes())
                except EOFError:
                    proc = readers.pop(reader)
                    proc.join()
                    failure = (
                        failure
                        or f"a probe worker process exited with code {proc.exitcode} "
                        "before finishing"
                    )
                    continue
                if kind == "ok":
                    results[i], received[i] = payload, True
                elif kind == "error":
                    failure = f"a probe worker failed on item {items[i]!r}:\n{payload}"
                else:  # done
                    readers.pop(reader).join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    if failure is None and not all(received):
        failure = f"probe workers returned {sum(received)} of {len(items)} results"
    if failure is not None:
        raise RuntimeError(failure)
    return results
