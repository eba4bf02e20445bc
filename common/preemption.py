"""Stopping when the cluster or the user asks: SIGTERM (preemption, scancel, a launcher shutting down), SIGUSR1
(Slurm's `--signal=USR1@T` before the time limit), SIGHUP (the terminal closed, unless nohup) or a first Ctrl-C; a
second Ctrl-C interrupts.

The handlers are in place from a recipe's first line (common.exit_codes). Before the training loop a stop ends the
process at once (exit 75: nothing to save, a requeued job starts again); in it, StopOnSignal stops every process at
the same step, after one checkpoint, whichever process the signal reached first."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .args import STATUS_FILE_ENV, stop_name

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL from sysexits.h: temporary failure, run it again
HUNG_EXIT_CODE = 124  # as coreutils' timeout: the processes stopped waiting for each other (nothing saved of it)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal closed

_received: list[int] = []  # signal numbers, in the order they arrived
_in_loop = False  # a StopOnSignal exists: the loop stops at a step instead
_ending = False  # common.exit_codes is ending the run: a stop is recorded, not raised inside its handling
_owner = None  # the process whose handlers these are: a forked worker inherits them


class Preempted(BaseException):
    """The run stopped on a signal, after saving `checkpoint` (None: before training, nothing to save). A stop, not an
    error, as KeyboardInterrupt: the `except Exception` of a library or of ours lets it through, unwrapped."""

    def __init__(self, message: str, step=None, checkpoint=None):
        super().__init__(message)  # step and checkpoint travel in __dict__ (pickled by decide_on_main's broadcast)
        self.step, self.checkpoint = step, checkpoint


def install_stop_handlers() -> None:
    """From here on SIGTERM, SIGUSR1, SIGHUP and a first SIGINT stop the run instead of killing the process."""
    if threading.current_thread() is not threading.main_thread():
        return  # Python lets only the main thread install handlers (a notebook's worker, say)
    global _owner
    _owner = os.getpid()
    for sig in STOP_SIGNALS:
        if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN:  # nohup's choice stands
            signal.signal(sig, _record)
    atexit.unregister(_end_loader_workers)
    atexit.register(_end_loader_workers)  # runs before multiprocessing's own exit hook (LIFO)


def _record(signum, frame) -> None:
    if os.getpid() != _owner:  # a forked worker (datasets' map): the signal does what it does to a process of its own,
        signal.signal(signum, signal.SIG_DFL)  # so that its pool's terminate() ends it now, not once its work is done
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)
    if signum == signal.SIGINT and _received.count(signum) > 1:
        signal.default_int_handler(signum, frame)  # Ctrl-C twice: KeyboardInterrupt, wherever it is
    if not (_in_loop or _ending):
        raise stop_before_training()


def stop_before_training(signum: int | None = None) -> BaseException | None:
    """What ends a run a stop signal (`signum`, or the first received) reached before its training loop (None: no
    such signal): a first Ctrl-C interrupts, SIGTERM and SIGUSR1 preempt (exit 75: nothing to save, a requeued job
    starts again). Whatever else failed after it (a collective a peer that stopped first left) is its consequence."""
    if signum is None and (not _received or _in_loop):
        return None
    if (name := stop_name(signum or _received[0])) == "Ctrl-C":
        return KeyboardInterrupt()
    return Preempted(f"stopped by {name} before training started; nothing to save, run it again (exit 75)")


@contextlib.contextmanager
def stop_signals_held():
    """A stop signal that comes during the block is delivered at its end (its handler runs then): for a few system
    calls a stop must not cut in two, such as a lock file created and not yet locked."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def stop_received() -> BaseException | None:
    """What ends a run a stop signal reached in its loop before the first step it can stop at (a resumed stream being
    placed at its position): nothing new was trained, the checkpoint it resumed is still the latest."""
    return stop_before_training(_received[0]) if _received else None


def mark_run_ending() -> None:
    """Called by common.exit_codes once the recipe's main() has returned or raised: from here on a stop signal is
    recorded, not raised, so that it cannot cut short the writing of how the run ended; the watchdog stands down
    (run_ended)."""
    global _ending
    _ending = True


def run_ended() -> bool:
    """Whether common.exit_codes is ending the run: the recipe's main() has returned or raised."""
    return _ending


def ignore_stop_signals(worker_id=None) -> None:
    """For DataLoader workers, where torch installs a SIGTERM handler that ends the worker: the signal is the training
    process's to handle."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _end_loader_workers() -> None:
    """At exit, SIGKILL the DataLoader workers still running (after an error, say): multiprocessing's exit
    hook would send them SIGTERM, which they ignore, and wait for ever."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report each as a crash
    for child in workers:
        child.kill()


class StopOnSignal:
    """`requested()`, called by every process once per evaluation batch, and `agreed()`, once per optimizer step,
    return the signal's name on every process at the same call, one call after any received one: the flags are
    all-reduced over a gloo group of their own, started at one call and read at the next (no device sync). In one
    process there is nothing to agree on: the training loop reads `received` itself and calls `agreed()` only when
    it holds a signal or when `agreeing` (several processes). Each `requested()` is progress for the watchdog
    (`watchdog`'s, common.watchdog.start_watchdog; the loop beats it at each step's end). `progress_only` is the stop
    check of a final evaluation, which a signal does not cut short (its metrics are what the run saves next): its
    `requested()` tells the watchdog the process is alive and never asks to stop."""

    def __init__(self, accelerator, watchdog=None):
        global _in_loop
        self._flag, self._pending, self.signal = torch.zeros(1, dtype=torch.int32), None, None
        spans = accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if spans else None
        self.agreeing, self.received = self._group is not None, _received  # the signal flags, read by the loop
        self.watchdog = watchdog
        self.progress_only = SimpleNamespace(requested=self.watchdog.beat if self.watchdog else lambda: None)
        _in_loop = True

    def requested(self, step: int | None = None) -> str | None:
        """The agreed stop signal's name, or None; progress for the watchdog (`step`: the optimizer steps taken)."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
        return self.agreed()

    def agreed(self) -> str | None:
        """The agreed stop signal's name, or None."""
        local = _received[0] if _received else 0
        agreed = local if self._group is None else 0
        if self._pending is not None:
            self._pending.wait()
            agreed, self._pending = int(self._flag.item()), None
        if agreed:
            self.signal = stop_name(agreed)
            return self.signal
        if self._group is not None:  # MAX: SIGTERM (15) wins over SIGUSR1 (10) and SIGINT (2)
            self._flag.fill_(local)
            self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return None

    def preempted(self, step: int, checkpoint, during: str | None = None) -> Preempted:
        """The exception that ends the run once its checkpoint is saved (common.exit_codes: exit 75)."""
        when = f"during {during} " if during else ""
        message = f"stopped by {self.signal} {when}after step {step}; saved {checkpoint}"
        resume = f"Continue with --resume_from_checkpoint latest (exit code {PREEMPTED_EXIT_CODE})"
        return Preempted(f"{message}. {resume}", step, checkpoint)


def write_status(text: str) -> None:
    """Tell launch.sh (which sets RECIPE_STATUS_FILE) how the run ended."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        with open(path, "w") as f:
            f.write(text + "\n")
