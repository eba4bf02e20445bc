"""Stopping cleanly when the cluster or the user asks: SIGTERM (preemption, scancel, a launcher
shutting down), SIGUSR1 (Slurm's `--signal=USR1@T` warning before the time limit) or a first Ctrl-C
(SIGINT; a second one interrupts at once).

A signal may reach one process, or all of them at slightly different moments, so no process acts
on its own signal: at every optimizer step (and every evaluation batch) the processes OR their flags
together and all stop at the same point, save one checkpoint and exit with PREEMPTED_EXIT_CODE.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL from sysexits.h: temporary failure, run it again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STATUS_FILE_ENV = "RECIPE_STATUS_FILE"  # launch.sh reads why the recipe stopped from this file

_received: list[int] = []  # signal numbers, in the order they arrived


def install_stop_handlers() -> None:
    """From here on SIGTERM, SIGUSR1 and a first SIGINT are recorded instead of ending the process."""
    if threading.current_thread() is not threading.main_thread():
        return  # Python only lets the main thread install handlers (e.g. a notebook's worker)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)
    atexit.unregister(_end_loader_workers)  # once, however many accelerators a process makes
    atexit.register(_end_loader_workers)  # runs before multiprocessing's own exit hook (LIFO)


def _record(signum, frame) -> None:
    if signum == signal.SIGINT and signal.SIGINT in _received:  # Ctrl-C twice: do not wait for the step
        signal.default_int_handler(signum, frame)
    _received.append(signum)


def ignore_stop_signals(worker_id=None) -> None:
    """For DataLoader workers: the group-wide signal is the training process's to handle; a
    worker that died of it would turn a clean stop into a crash."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _end_loader_workers() -> None:
    """At exit, end the DataLoader workers still running (after an error, say) with SIGKILL:
    multiprocessing's exit hook would send them SIGTERM, which they ignore, and wait forever."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report each as a crash
    for child in workers:
        child.kill()


class Preempted(Exception):
    """Raised after the stop checkpoint is saved; `common.exit_codes` turns it into the exit code."""

    def __init__(self, signal_name: str, step: int, checkpoint, during: str | None = None):
        when = f"during {during} " if during else ""
        super().__init__(
            f"stopped by {signal_name} {when}after step {step}; saved {checkpoint}. "
            f"Continue with --resume_from_checkpoint latest (exit code {PREEMPTED_EXIT_CODE})"
        )
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class StopOnSignal:
    """Records the stop signals from now on; every process calls `requested()` once per optimizer
    step (and per evaluation batch), and it returns the signal's name on every process at the same
    call, one call after any process received one.

    The flags travel over a gloo group of their own: a CPU all-reduce needs no GPU
    synchronisation, and, started asynchronously at one call and read at the next, it overlaps
    a whole step of compute instead of stalling the loop.
    """

    def __init__(self, accelerator):
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending = None
        self.signal = None  # the agreed signal's name, once requested() has returned it
        distributed = accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None
        install_stop_handlers()  # once the group stands: a process stuck joining it may still be killed

    def requested(self) -> str | None:
        local = _received[0] if _received else 0
        if self._group is None:
            agreed = local
        else:
            agreed = 0
            if self._pending is not None:
                self._pending.wait()
                agreed = int(self._flag.item())
            self._pending = None
        if agreed:
            self.signal = signal.Signals(agreed).name
            return self.signal
        if self._group is None:
            return None
        self._flag.fill_(local)
        # MAX over signal numbers: SIGTERM (15) wins over SIGUSR1 (10) and SIGINT (2) in the message.
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return None

    def preempted(self, step: int, checkpoint, during: str | None = None) -> Preempted:
        """The exception to end the run with once its stop checkpoint is saved (exit_codes: exit 75)."""
        return Preempted(self.signal, step, checkpoint, during)


def write_status(text: str) -> None:
    """Tell launch.sh (which sets RECIPE_STATUS_FILE) how the run ended."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        with open(path, "w") as f:
            f.write(text + "\n")
