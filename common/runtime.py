"""Building the Accelerator, refusing launches that would not train as one job (N processes that never form one
group, each quietly training its own copy), and `exit_codes`: the one place where a run's end becomes an exit code
and, for a mistake the user can fix, one line."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import errno
import importlib.metadata
import importlib.util
import inspect
import logging
import math
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list, parse_flag_from_env
from tqdm.auto import tqdm

from . import args as _args
from . import preemption, preflight
from .errors import RecipeError
from .preemption import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE, Preempted, install_stop_handlers, write_status

logger = get_logger("recipes")
LOST_PEERS = (
    "a collective operation did not complete within --ddp_timeout: a process stalled, died, or the job was suspended "
    "for longer; any checkpoint already saved is intact: resume with --resume_from_checkpoint latest (exit 124)"
)
PEER_GONE = re.compile(r"(gloo|NCCL).*(Connection (closed|reset) by peer|remote process exited)", re.S)
NO_COMPILER = (
    "torch.compile (--torch_compile, --dynamo_backend inductor) needs a C++ compiler for inductor's CPU code, and it "
    "found none (or not $CXX); install g++ (apt install g++, conda install gxx), or train without compiling"
)


class RunFinished(Exception):
    """--output_dir holds a finished run (a requeued job that had finished): one `done:` line, exit 0."""


def one_line(err: BaseException) -> str:
    """An exception's message as one line (the original one of an exception re-raised from a DataLoader worker)."""
    text = str(err).strip()
    if "\nOriginal Traceback" in text:  # torch's ExceptionWrapper: "...\n<module>.<Type>: <message>"
        last = text.splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:  # a heading: what it announces is on the next line
        first = f"{first} {lines[1]}"
    elif lines[-1].startswith("because "):  # the reason after what it is about (pyarrow's cast errors)
        first = f"{first} {lines[-1]}"
    return first.rstrip(".")


# Where a path that fails may come from, besides the command line, and what fixes each kind of failure.
PATH_VARIABLES = ("TMPDIR", "HF_DATASETS_CACHE", "HF_HOME", "TORCH_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "HOME")
OS_FIXES = {
    errno.ENOENT: "check the path",
    **dict.fromkeys((errno.EACCES, errno.EPERM), "give this user access to it (chmod, chown) or use another path"),
    errno.EROFS: "it is on a read-only filesystem: use a path on a writable one",
    errno.ENOSPC: "free space there or use another filesystem",
    errno.EDQUOT: "free space there (your quota) or use another filesystem",
    errno.EISDIR: "pass a file in it",
    errno.ENOTDIR: "a part of that path is a file, not a folder",
    errno.EEXIST: "it is a file where a folder must be: remove it or use another path",  # os.makedirs's error
}


def causes(err: BaseException) -> list:
    """`err` and the exceptions it was raised from or during, nearest first."""
    chain = [err]
    while len(chain) < 10 and (chain[-1].__cause__ or chain[-1].__context__):
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


def os_error_line(err: BaseException) -> str | None:
    """One line for an OS error about a path in `err` or its causes: the path, the option or environment variable
    it comes from, what the system said, and the fix; or None."""
    return None if (refusal := os_error_refusal(err)) is None else str(refusal)


def os_error_refusal(err: BaseException) -> RecipeError | None:
    """An OS error about a path in `err` or its causes as a refusal (os_error_line's), its subject the option or
    environment variable the path comes from, else the path; or None."""
    found = next((e for e in causes(err) if isinstance(e, OSError) and e.errno in OS_FIXES and e.filename), None)
    if found is None:
        return None
    name = os.fsdecode(found.filename)
    path, where, subject = os.path.abspath(name), name, name
    parsed = _arguments_of_failing_code(err)
    options = parsed.values_by_option.items() if parsed else ()
    origins = [*options, *((f"${n}", os.environ[n]) for n in PATH_VARIABLES if os.environ.get(n))]
    for origin, value in origins:
        base = os.path.abspath(os.path.expanduser(value))
        inside = path.startswith(base.rstrip(os.sep) + os.sep)
        if inside and found.errno in (errno.ENOTDIR, errno.EEXIST) and not os.path.isdir(base):
            # a folder beneath it could not be made because the named folder cannot be one: said of the folder named
            code = errno.EEXIST if os.path.lexists(base) else errno.ENOTDIR
            found, path, name, inside = OSError(code, os.strerror(code), base), base, base, False
        if path == base or inside:
            where = f"{origin} {value}" if path == base else f"{name} (in {origin} {value})"
        elif base.startswith(path.rstrip(os.sep) + os.sep):  # a folder on its way
            where = f"{name} (on the path of {origin} {value})"
        elif os.path.dirname(path) == os.path.dirname(base.rstrip(os.sep)) and os.path.basename(path).startswith(
            f".{os.path.basename(base.rstrip(os.sep))}."
        ):
            where = f"{name} (kept beside {origin} {value} while it is written)"  # e.g. the preparation's lock
        else:
            continue
        subject = origin
        break
    return RecipeError(_args.mask_secrets(f"{where}: {_os_reason(found)}"), subject=_args.mask_secrets(subject))


def _arguments_of_failing_code(err: BaseException) -> _args.ParsedArgs | None:
    """The parsed arguments the code that raised `err` ran with: the innermost held by a frame `err` passed through,
    or by one of their callers (while `err` is still being handled, as in decide_on_main). The failure carries its
    own run's arguments, so that no module keeps the last parse's: two parses in one process (tests, tests/warm.py's
    forks) do not name each other's options."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    frames.reverse()  # innermost first, then the callers of the outermost
    caller = frames[-1].f_back if frames else None
    while caller is not None:
        frames.append(caller)
        caller = caller.f_back
    for frame in frames:
        for value in frame.f_locals.values():
            if isinstance(value, _args.ParsedArgs):
                return value
    return None


def _os_reason(err: OSError) -> str:
    fix, name = OS_FIXES.get(err.errno, "check the path"), os.fsdecode(err.filename or "")
    if err.errno == errno.ENOTDIR and os.path.isfile(name):
        fix = "it is a file: pass the folder that holds it"
    if os.path.islink(name) and not os.path.exists(name):  # EEXIST or ENOENT: a link to what is gone
        return f"a symbolic link to {os.readlink(name)}, which does not exist; create that folder, or remove the link"
    return f"{(err.strerror or one_line(err)).lower()}; {fix}"


def check_path(flag: str, path, folder: bool = False) -> None:
    """Refuse, in one line naming `flag`, a path that cannot be read as a file (or a folder)."""
    try:
        os.scandir(os.path.expanduser(path)).close() if folder else open(os.path.expanduser(path), "rb").close()
    except OSError as err:
        raise RecipeError(f"{flag} {path}: {_os_reason(err)}", subject=flag) from err


def decide_on_main(accelerator, fn):
    """`fn` on the main process alone; every process returns its result or raises its RecipeError, RunFinished or
    Preempted: decisions about --output_dir are taken once, not by processes seeing it at different moments."""
    if accelerator is None or accelerator.num_processes == 1:
        return fn()
    outcome = [None]
    if accelerator.is_main_process:
        try:
            outcome = [fn()]
        except BaseException as err:
            broadcast_object_list([_as_told_to_all(err, "the main process")])
            raise
    broadcast_object_list(outcome)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _as_told_to_all(err: BaseException, who: str) -> BaseException:
    """What the other processes raise for `err`, met by `who`: a user's mistake or a stop as it is (`err` itself is
    then said once, not by each process), anything else a RecipeError of one line (`who` alone shows its traceback)."""
    if isinstance(err, RecipeError):
        err.same_on_every_rank = True  # every process raises it: one line says it
    if isinstance(err, (RecipeError, RunFinished, Preempted, KeyboardInterrupt)):
        return err
    return os_error_refusal(err) or RecipeError(f"{who} failed: {one_line(err)}")  # whichever process says it


class LostWhileWaiting(Exception):
    """A process ended or stopped answering while the others waited for its work (taking_turns): the line, and
    launch.sh's status (None: the line names no cause, the process that ended or its launcher says why)."""

    def __init__(self, line: str, status: str | None):
        super().__init__(line)
        self.status = status


BEAT_SECONDS = 1.0  # how often a process at work says it is alive: the others hear of its end within it
LOOK_SECONDS = 0.01  # how often a waiting process looks at its beat: a stop signal is handled between looks


@contextlib.contextmanager
def taking_turns(state, turn: int, who: tuple, timeout: int):
    """The block on every process in the order of its `turn` (0 to len(who) - 1), the processes of one turn at once,
    the others waiting until each of those has ended it. The wait has no deadline, it lasts as long as the work: each
    process at work tells the others every BEAT_SECONDS that it works, is done or failed (a thread of its own
    all-reduces that on a gloo group made for the purpose, a collective that completes in a moment, far inside
    `timeout`); a process that died is known at the next beat, and one that stalled within `timeout` (--ddp_timeout),
    each waiting process saying so in one line that names it (`who` of the turn: "the main process (rank 0)").
    A stop signal is honoured while waiting. An error in the block reaches every process as decide_on_main's does:
    the failing process raises it, the others what _as_told_to_all makes of it."""
    if state.num_processes == 1:
        yield
        return
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    for now, working in enumerate(who):
        if now != turn:
            flags = _wait_out_turn(group, working, timeout)
        else:
            beating = _Beating(group, state, timeout)
            try:
                yield
            except BaseException as err:
                flags = beating.end(failed=True)
                if flags is not None:  # else the others have gone: this process's own error is its report
                    with contextlib.suppress(Exception):
                        _tell_failure(group, state, flags, _as_told_to_all(err, working))
                raise
            flags = beating.end(failed=False)
            if flags is None:  # the beats broke after this process's part: another one ended or stalled
                _raise_lost(beating.error, "another process", "the processes prepared the data", timeout)
        if flags[1]:  # a process failed in this turn: every process raises its error
            raise _tell_failure(group, state, flags, None)
    torch.distributed.destroy_process_group(group)


def _flags(state, working: bool, failed: bool) -> torch.Tensor:
    """A beat's content, all-reduced with MAX: whether any process still works, and the lowest rank that failed
    (as world size - rank, 0 for none)."""
    return torch.tensor([int(working), state.num_processes - state.process_index if failed else 0])


def _tell_failure(group, state, flags, error):
    """The error of the lowest rank that failed (flags[1]), told by it (`error`) to every process, which returns it."""
    told = [error]
    torch.distributed.broadcast_object_list(told, src=state.num_processes - int(flags[1]), group=group)
    return told[0]


def _wait_out_turn(group, working: str, timeout: int) -> torch.Tensor:
    """Beats with the processes at work in this turn (`working`) until none works; the last beat's flags."""
    while True:
        flags = torch.zeros(2, dtype=torch.int64)
        beat = torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group, async_op=True)
        try:
            while not beat.is_completed():
                time.sleep(LOOK_SECONDS)  # a stop signal's handler runs here (and raises), not inside torch's wait
        except BaseException:  # a stop; but if the beat had already broken, the process waited for ended first
            if beat.is_completed():  # (and torch's agent, seeing it end, stops the others: that stop is not the cause)
                _raise_if_broken(beat, working, timeout)
            raise
        _raise_if_broken(beat, working, timeout)
        if not flags[0]:
            return flags


def _raise_if_broken(beat, working: str, timeout: int) -> None:
    try:
        beat.wait()
    except Exception as err:
        _raise_lost(err, working, "it prepared the data, which this process waited for", timeout)


def _raise_lost(err: BaseException, who: str, doing: str, timeout: int):
    """Raises what a broken beat means: `who` ended while `doing`, or stopped answering for --ddp_timeout; `err`
    itself if neither."""
    lost = _lost(err, who, doing, timeout)
    if lost is err:
        raise err
    raise lost from err


def _lost(err: BaseException, who: str, doing: str, timeout: int) -> BaseException:
    if any(PEER_GONE.search(str(e)) for e in causes(err)):
        return LostWhileWaiting(f"stopped: {who} ended while {doing} (its output, or its launcher's, says why)", None)
    if _timed_out(err):
        return LostWhileWaiting(
            f"error: {who} did not answer for --ddp_timeout {timeout} s while {doing}: it stalled or was suspended; "
            "any checkpoint already saved is intact (exit 124)",
            "error",
        )
    return err


class _Beating:
    """While this process works in its turn (taking_turns), a daemon thread all-reduces its state with the others
    every BEAT_SECONDS, at once when the work ends, until no process of the turn works. If the others are lost
    while the work goes on, it ends this process (the work is for nothing), saying why as exit_codes would."""

    def __init__(self, group, state, timeout: int):
        self.group, self.state, self.timeout = group, state, timeout
        self.working, self.failed, self.error, self.flags = True, False, None, None
        self.lock, self.ended = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, name="data-preparation-beat", daemon=True)
        self.thread.start()

    def end(self, failed: bool):
        """This process's part is done (or `failed`): the flags of the turn's last beat, or None if the beats broke
        (self.error). Waits for the turn's other processes at work; a stop signal is honoured while it waits."""
        with self.lock:
            self.working, self.failed = False, failed
        self.ended.set()
        self.thread.join()  # interrupted by a stop signal's handler, as any wait of the main thread
        return self.flags

    def _beat(self) -> None:
        try:
            while True:
                with self.lock:
                    flags = _flags(self.state, self.working, self.failed)
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
                if not flags[0]:
                    self.flags = flags
                    return
                self.ended.wait(BEAT_SECONDS)
        except Exception as err:
            with self.lock:
                self.error = err
                if self.working and preemption.stop_before_training() is None:  # else the main thread ends it
                    lost = _lost(err, "another process", "this one prepared the data", self.timeout)
                    code, status, line, _, everyone = _how_it_ended(lost)
                    _say(code, status, line, everyone)
                    exit_without_teardown(code)


@contextlib.contextmanager
def exit_codes():
    """Around a recipe's main(): a user's mistake (RecipeError, an OS error about a path) is one `error:` line and
    exit 2; RunFinished `done:` and 0; a stop on a signal 75; a second Ctrl-C 130; a stuck collective 124; a bug
    its traceback and 1. launch.sh reads how the run ended from RECIPE_STATUS_FILE."""
    install_stop_handlers()
    if _args.restarted_after_mistake():  # --max_restarts: a restart does not mend a mistake, its line was said
        _args.first_to_say(2)  # for the next restart
        sys.exit(2)
    try:
        try:
            yield
        finally:
            preemption.mark_run_ending()  # a signal from here on cannot interrupt the handling below
        write_status("finished")
        if _one_of_several():  # its work is written and its group taken down (end_training): the interpreter's
            exit_without_teardown(0)  # teardown would only cost time, about 1.3 CPU-seconds a process here
        return
    except SystemExit:  # argparse's --help and usage errors
        raise
    except BaseException as err:
        # a mistake said, a finished run or a process waited for that ended is how it ended, whatever stop came after
        # it (torch's agent ending the others once one exits); any other failure after a stop before training is the
        # stop's consequence
        said = next((e for e in causes(err) if isinstance(e, (RecipeError, RunFinished, LostWhileWaiting))), None)
        ended = said or preemption.stop_before_training() or err
        code, status, line, together, everyone = _how_it_ended(ended)
    _say(code, status, line, everyone)
    # A gloo group left to the interpreter's exit can abort the process (pytorch#190489), turning exit 2 into a
    # crash: taken down only when every process is here (one still in a collective would wait for ever), and a
    # process of several skips the interpreter's teardown (exit_without_teardown).
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if together and group and _others_reached_the_end():
        torch.distributed.destroy_process_group()
    if group and _one_of_several():  # see exit_without_teardown
        exit_without_teardown(code)
    sys.exit(code)


def _one_of_several() -> bool:
    """Whether this process is one of several a launcher started, which the launcher waits for: each ends without
    the interpreter's teardown (exit_without_teardown), which frees what torch, torchvision and transformers
    imported one object at a time (about 1.3 CPU-seconds a process here, 3 of a 2-process test run's 19)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _others_reached_the_end(seconds: float = 10) -> bool:
    """Wait (bounded) until every process ends at this same point. The one that says the line may be seconds behind
    the others; a process that exits first has torch's agent stop that one before it says it (which then reads as
    a stop on SIGTERM, exit 75: a scheduler requeues a mistake)."""
    try:
        torch.distributed.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=seconds))
        return True
    except Exception:  # a peer gone or late: the process group is left to exit_without_teardown
        return False


def _say(code: int, status: str | None, line: str | None, everyone: bool) -> None:
    """The line that says why the run ended, by the process that says it, and the status for launch.sh."""
    # status None: a line that names no cause (a peer gone), which launch.sh does not take the exit code of
    line = line and _args.mask_secrets(line)  # a library's message may quote a URL's password
    if line and _args.first_to_say(code if status else None, everyone):
        # on a line of its own, below a progress bar: this process's (tqdm.write clears it), or one another process
        # of its node draws (each draws transformers' "Loading weights"), which only a new line ends
        tqdm.write(line if os.environ.get("LOCAL_WORLD_SIZE", "1") == "1" else f"\n{line}", file=sys.stderr)
    if status:
        write_status(status)  # launch.sh's rank 0 alone writes it


def _timed_out(err: BaseException) -> bool:
    """Whether torch gave up waiting for the other processes (a collective of gloo or NCCL, or the group's store),
    not a timeout of the user's own code (a tracking server's, a dataset's network read: its traceback)."""
    return any(
        re.search(r"timed out|timeout", f"{type(e).__name__} {e}", re.I)
        and (isinstance(e, torch.distributed.DistError) or re.search(r"gloo|NCCL|c10d|TCPStore", str(e)))
        for e in causes(err)
    )


def _how_it_ended(err: BaseException) -> tuple:
    """(exit code, status for launch.sh, line, together, everyone): `together`, every process ends here at the same
    point (the process group can be taken down); `everyone`, one process may meet it alone (each prints its line,
    not the launcher's rank 0 alone). A bug is its traceback and 1, printed now, so the frames holding DataLoader
    workers (which ignore SIGTERM) go before exit."""
    if isinstance(err, RecipeError):
        return 2, "error", f"error: {one_line(err)}", err.same_on_every_rank, not err.same_on_every_rank
    if isinstance(err, RunFinished):
        return 0, "finished", f"done: {err}", True, False
    if isinstance(err, Preempted):
        status = f"preempted {err.step} {err.checkpoint}"
        return PREEMPTED_EXIT_CODE, status, f"preempted: {err}", err.checkpoint is not None, False
    if isinstance(err, KeyboardInterrupt):
        return 130, "interrupted", "interrupted by Ctrl-C: nothing was saved after the last checkpoint", False, False
    if isinstance(err, LostWhileWaiting):  # said by each process that waited: the one waited for may say nothing
        return HUNG_EXIT_CODE, err.status, str(err), False, True
    if _timed_out(err):
        return HUNG_EXIT_CODE, "error", f"error: {LOST_PEERS}", False, False  # a collective did not complete
    if any(PEER_GONE.search(str(e)) for e in causes(err)):  # not the cause: the process that ended first is
        line = "another process of the job ended while this one waited for it in a collective (its output says why)"
        return HUNG_EXIT_CODE, None, f"stopped: {line}", False, False
    if os_line := os_error_line(err):
        return 2, "error", f"error: {os_line}", False, True
    if deepspeed_line := _deepspeed_config_error(err):
        return 2, "error", f"error: {deepspeed_line}", False, True
    if any("InvalidCxxCompiler" in f"{type(e).__name__} {e}" for e in causes(err)):  # inductor's, at the first step
        return 2, "error", f"error: {NO_COMPILER}", False, True
    traceback.print_exception(err)
    return 1, None, None, False, False


def _deepspeed_config_error(err: BaseException) -> str | None:
    """One line for a DeepSpeed config DeepSpeed's own models refuse (pydantic's errors, one per field), or with an
    "auto" Accelerate cannot fill (its ValueError), or None."""
    if auto := next((m for e in causes(err) if (m := re.search(r"`?([\w.]+)`? not found in kwargs", str(e)))), None):
        return f'the DeepSpeed config sets {auto[1]} to "auto", which nothing here fills; set its value in the config'
    found = next((e for e in causes(err) if str(getattr(e, "title", "")).startswith("DeepSpeed")), None)
    if found is None or not hasattr(found, "errors"):
        return None
    fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})" for e in found.errors())
    return (
        f"DeepSpeed refuses its config ({found.title}: {fields}); correct it in the accelerate config's "
        "deepspeed_config, or in its deepspeed_config_file"
    )


def exit_without_teardown(code: int) -> None:
    """Exit with `code` after Python's exit handlers, skipping the interpreter's teardown, where torch's C++ objects
    that hold the gloo group (a DDP reducer, Accelerate's state) abort once a peer has gone (exit 134, not 2).
    atexit has no public way to run its handlers: the private one is here alone (tests/test_common.py checks it)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def make_accelerator(args, **kwargs) -> Accelerator:
    """The recipes' Accelerator, refusing a launch that would not train as one job as asked. A process started by a
    launcher ends with it (a parent-death signal: it stops at a checkpoint); hosts without GPUs get gloo explicitly
    (DeepSpeed's CPU path needs it to see the world size)."""
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    versions = {name: importlib.metadata.version(name) for name in ("torch", "accelerate")}
    preflight.check(os.environ, gpus, versions, args)
    launch = _started_by_accelerate_launch(expected)
    # torchrun's workers, launch.sh's processes, or the one process `accelerate launch` starts alone
    if "TORCHELASTIC_RUN_ID" in os.environ or _args.STATUS_FILE_ENV in os.environ or launch:
        die_with_parent(signal.SIGTERM, _PARENT)
    group = {"timeout": datetime.timedelta(seconds=args.ddp_timeout)}
    if expected > 1 and not torch.cuda.is_available():
        group["backend"] = "gloo"
    try:
        with _watching_group_formation(expected, args.ddp_timeout):
            if _sharded_by_accelerate() and not torch.cuda.is_available():
                fsdp_on_cpu(group["timeout"])  # forms the group itself
            accelerator = Accelerator(
                gradient_accumulation_steps=args.gradient_accumulation_steps,  # what accelerator.backward divides by
                log_with=None if args.report_to == "none" else args.report_to,
                project_dir=args.output_dir,
                kwargs_handlers=[InitProcessGroupKwargs(**group), *kwargs.pop("kwargs_handlers", [])],  # and a copy's
                **kwargs,
            )
    except Exception as err:
        if _timed_out(err):  # said by each process: with RANK left from another job there may be no rank 0
            raise RecipeError(_not_met(args.ddp_timeout), subject="--ddp_timeout", same_on_every_rank=False) from err
        if isinstance(err, RecipeError) or os_error_line(err):
            raise
        raise RecipeError(  # what accelerate launch passed on from the config, refused here (FSDP's, fp8 without TE)
            f"Accelerate cannot set up the accelerate config's settings here ({type(err).__name__}: {one_line(err)}); "
            "correct the config passed to accelerate launch (accelerate config writes one)",
            same_on_every_rank=False,
        ) from err
    _configure_logging(accelerator.is_main_process)
    _cache_missing_optional_packages()
    _check_what_formed(accelerator, expected)
    if accelerator.state.deepspeed_plugin is not None:  # DeepSpeed's own settings win over Accelerate's and ours
        fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, args, accelerator.num_processes)
    return accelerator


def _configure_logging(main_process: bool) -> None:
    """INFO from the main process, warnings from every process; the libraries' chatter off."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if main_process else logging.WARNING,
        handlers=[_BelowTheBar()],
    )
    for noisy in ("torch.distributed", "torch.nn.parallel", "datasets", "httpx", "urllib3", "accelerate.checkpointing",
                  "accelerate.utils.fsdp_utils", "accelerate.accelerator"):  # fmt: skip
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fill_deepspeed_config(config: dict, args, num_processes: int) -> None:
    """A DeepSpeed config's batch, accumulation and clipping made the recipe's flags' where it leaves them "auto" or
    unset (where it sets others, common.preflight refused it before the group formed: deepspeed_against_arguments)."""
    for key, value, _ in preflight.deepspeed_settings(args, num_processes):
        config[key] = value


def agree_deepspeed_optimizer(ds_config: dict, args, plan, position) -> None:
    """A DeepSpeed config's optimizer and scheduler settings made the plan's (recipes/zero.py takes them): a rate,
    warmup or length the config sets is the plan's, so that what trains is what results.json reports, or one line;
    "auto", or a key its scheduler takes left out (DeepSpeed's default), is filled with the plan's (in steps:
    Accelerate would divide total_num_steps by the processes). A scheduler of the config counts optimizer steps: a
    checkpoint resumed at another effective batch is refused."""
    if "scheduler" in ds_config and position.seen != position.step * plan.effective_batch_size:
        raise RecipeError(
            f"the DeepSpeed config's scheduler counts optimizer steps, and the checkpoint's {position.step} steps "
            f"trained {position.seen:,} samples, not {position.step} x this run's effective batch of "
            f"{plan.effective_batch_size}: resume with the checkpoint's effective batch (processes x per-device batch "
            "x accumulation), or delete the config's scheduler (the recipe's own schedule counts samples)"
        )
    lr = (plan.learning_rate, "--learning_rate (scaled to the batch)", "--lr_scaling none --learning_rate")
    ours = {
        "warmup_max_lr": lr,
        "cycle_max_lr": lr,
        "warmup_num_steps": (plan.warmup_steps, "warmup steps (--warmup_steps, --warmup_ratio)", "--warmup_steps"),
        "total_num_steps": (
            plan.max_train_steps,
            "steps (--max_train_steps, --num_train_epochs)",
            "--max_train_steps",
        ),
    }
    scheduler = {}
    if "scheduler" in ds_config:
        from deepspeed.runtime import lr_schedules

        scheduler = ds_config["scheduler"].setdefault("params", {})
        kind = getattr(lr_schedules, str(ds_config["scheduler"].get("type")), None)  # else DeepSpeed refuses it
        for key in ours.keys() & (inspect.signature(kind).parameters if inspect.isclass(kind) else {}):
            scheduler.setdefault(key, "auto")
    theirs = {"weight_decay": (args.weight_decay, "--weight_decay", "--weight_decay")}  # the optimizer's keys
    if not {"warmup_max_lr", "cycle_max_lr"} & scheduler.keys():  # else the scheduler's peak replaces the rate
        theirs["lr"] = lr
    optimizer_params = ds_config.get("optimizer", {}).get("params", {})
    for part, params, keys in (("optimizer", optimizer_params, theirs), ("scheduler", scheduler, ours)):
        for key, (value, name, flag) in keys.items():
            given = params.get(key, "auto")
            if given != "auto" and not (isinstance(given, (int, float)) and math.isclose(given, value, rel_tol=1e-9)):
                raise RecipeError(
                    f"the DeepSpeed config sets the {part}'s {key}={given} but the recipe's {name} is {value:.10g}, "
                    f'which it trains with; set it to "auto" in the config, or pass {flag} {given}',
                    subject=flag.split()[0],
                )
            if key in params and part == "scheduler":
                params[key] = max(value, 1) if key == "warmup_num_steps" else value  # DeepSpeed refuses 0


class _BelowTheBar(logging.Handler):
    """Each log line on a line of its own, below this process's progress bar (tqdm.write clears and redraws it)."""

    def emit(self, record) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _not_met(timeout: int) -> str:
    return f"the processes did not meet within --ddp_timeout {timeout} s: {_group()}"


def _group() -> str:
    env = {name: os.environ.get(name, "?") for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    return (
        f"the {env['WORLD_SIZE']} processes of WORLD_SIZE={env['WORLD_SIZE']} (this one RANK={env['RANK']}) at "
        f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}: a process still starting (a first DeepSpeed run on CPU builds "
        "its ops), one that did not start or cannot reach that address, or variables left from another job (unset "
        "them: python alone runs one process)"
    )


@contextlib.contextmanager
def _watching_group_formation(expected: int, timeout: int):
    """Around the forming of the process group (`expected` processes), a thread that watches the wait: torch waits in
    C++, where Python's signal handlers do not run, so without it a stop signal would not end the process, a long
    wait would say nothing, and a store torch cannot reach would be retried for minutes past `timeout`. With it a
    stop signal ends this process (as before training, a second later), a wait of 30 s says what it waits for, and
    one past `timeout` ends it.
    The signal's number reaches a thread here through Python's wakeup file descriptor (signal.set_wakeup_fd)."""
    if expected == 1 or threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous, met = signal.set_wakeup_fd(write), threading.Event()

    def watch():
        said, started = False, time.monotonic()
        while not met.is_set():
            if select.select([read], [], [], 1.0)[0]:
                stops = [n for n in os.read(read, 64) if n in preemption.STOP_SIGNALS]
                if stops and not met.wait(1.0):  # the main thread could not take it
                    code, status, line, _, everyone = _how_it_ended(preemption.stop_before_training(stops[0]))
                    _say(code, status, line, everyone)
                    exit_without_teardown(code)
            elif time.monotonic() > started + timeout + 2:  # torch's own error, if it comes, is the same line
                _say(2, "error", f"error: {_not_met(timeout)}", True)
                exit_without_teardown(2)
            elif not said and time.monotonic() > started + 30:
                tqdm.write(f"warning: still waiting for {_group()}", file=sys.stderr)
                said = True
        os.close(read)

    threading.Thread(target=watch, name="group-meeting", daemon=True).start()
    try:
        yield
    finally:
        met.set()
        signal.set_wakeup_fd(previous)
        os.close(write)


def _cache_missing_optional_packages() -> None:
    """Accelerate's prepared optimizer asks whether lomo_optim is installed twice a step (an uncached find_spec:
    100 to 300 us a step here); its absence is recorded in sys.modules, Python's own record of imports."""
    if "lomo_optim" not in sys.modules and importlib.util.find_spec("lomo_optim") is None:
        sys.modules["lomo_optim"] = None


def _started_by_accelerate_launch(expected: int) -> bool:
    """Whether `accelerate launch` (or `accelerate-launch`, its entry point of its own) is this process's parent
    (Linux: its command line). It runs `--num_processes N` as one process, without a word, unless it has several
    GPUs, --multi_gpu or a multi-process config: refused."""
    try:
        parent = [os.fsdecode(a) for a in Path(f"/proc/{_PARENT}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return False
    names = [Path(arg).name for arg in parent[:2]]  # [python,] accelerate launch ... or accelerate-launch ...
    if "accelerate-launch" in names:
        launch_args = parent[names.index("accelerate-launch") + 1 :]
    elif "accelerate" in names and "launch" in parent:
        launch_args = parent[parent.index("launch") + 1 :]
    else:
        return False
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    with contextlib.suppress(SystemExit):  # options this accelerate does not know: not ours to judge
        given = launch_command_parser().parse_known_args(launch_args)[0]
        asked, why = given.num_processes, "--multi_gpu, a multi-process --config_file or more than one GPU"
        if not asked and expected == 1:  # the config's (accelerate's default file without --config_file)
            with contextlib.suppress(Exception):
                config = load_config_from_file(given.config_file)
                kind = getattr(config.distributed_type, "value", config.distributed_type)
                asked, why = config.num_processes, f"a distributed_type such as MULTI_GPU, not {kind}"
        if expected == 1 and asked and asked > 1:
            raise RecipeError(
                f"accelerate launch {'--num_processes' if given.num_processes else 'with num_processes:'} {asked} "
                f"started one process: it starts several only with {why}; on a host without GPUs pass --multi_gpu "
                "with ACCELERATE_USE_CPU=true exported (it starts the processes on the CPU), or use ./launch.sh",
                subject="--num_processes" if given.num_processes else "num_processes",
            )
    return True


_PARENT = os.getppid()  # as early as this process can tell: the launcher that started it


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Linux sends this process `sig` when its parent exits (prctl PR_SET_PDEATHSIG; elsewhere False): torchrun's
    workers, in sessions of their own, would outlive a killed launcher. `parent` gone already: `sig` now."""
    if not sys.platform.startswith("linux") or ctypes.CDLL(None).prctl(1, int(sig), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def _sharded_by_accelerate() -> bool:
    """FSDP, or an accelerate config's parallelism_config (tp.yaml): both need the group presented as fsdp_on_cpu
    does (ParallelismConfig too accepts only GPU-like distributed types: its _validate_accelerator)."""
    return parse_flag_from_env("ACCELERATE_USE_FSDP") or parse_flag_from_env("ACCELERATE_USE_PARALLELISM_CONFIG")


def fsdp_on_cpu(timeout: datetime.timedelta) -> None:
    """FSDP2 runs on CPU over gloo, but Accelerate applies FSDP only for GPU-like distributed types
    (AcceleratorState.__init__ leaves out MULTI_CPU): the gloo group is formed here and presented as MULTI_GPU.
    Retire it when Accelerate lists MULTI_CPU there (tests/test_fsdp.py fails first)."""
    from accelerate import PartialState

    PartialState(cpu=True, backend="gloo", timeout=timeout).distributed_type = DistributedType.MULTI_GPU


def _gpus_nvidia_smi_lists() -> int:
    """The GPUs `nvidia-smi -L` lists (0 without it, or when it fails within 10 s)."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU") for line in listed.splitlines())


def _check_what_formed(accelerator: Accelerator, expected: int) -> None:
    """Refuse what Accelerate did not set up as asked: the `expected` processes in one group that syncs gradients,
    and the config's FSDP and DeepSpeed (it falls back without a word: FSDP on CPU to DDP). What the environment
    alone shows (fp16 on the CPU, DeepSpeed under ACCELERATE_USE_CPU) common.preflight refused before."""
    kind = accelerator.distributed_type.value
    asked = int(os.environ.get(_args.WORLD_SIZE_ENV, accelerator.num_processes))
    if accelerator.num_processes != asked:  # accelerate launch starts one process for some configs (MULTI_CPU)
        raise RecipeError(
            f"launch.sh asked accelerate launch for {asked} processes and it started {accelerator.num_processes}; "
            "for CPU processes use distributed_type: MULTI_GPU with use_cpu: true in the config, as "
            "accelerate_configs/cpu.yaml does (MULTI_CPU starts one process unless mpirun is set up)",
            subject="distributed_type",
        )
    copies = [
        (os.environ[n], n) for n in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE") if n in os.environ
    ]
    if accelerator.num_processes == 1 and "WORLD_SIZE" not in os.environ and copies and copies[0][0] != "1":
        (count, variable), srun = copies[0], copies[0][1].startswith("SLURM")  # N copies nothing joins
        who, fix = (
            ("srun", "one ./launch.sh per node: srun --ntasks-per-node=1 ./launch.sh ... (slurm/*.sbatch)")
            if srun
            else ("mpirun", "./launch.sh or accelerate launch on each node")
        )
        raise RecipeError(
            f"{who} started this command as {count} processes ({variable}) and none of them starts a process group: "
            f"each would train its own copy of the model; start {fix}, which start and join the processes",
            subject=f"${variable}",
            same_on_every_rank=False,
        )
    if accelerator.num_processes != expected or (expected > 1 and kind == DistributedType.NO.value):
        formed = f"a group of {accelerator.num_processes}" if kind != DistributedType.NO.value else "no group"
        if (listed := _gpus_nvidia_smi_lists()) and not torch.cuda.is_available():  # the tools disagree: say so
            build = "a build without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise RecipeError(
                f"nvidia-smi lists {listed} GPU(s) but this torch ({torch.__version__}, {build}) cannot use them, so "
                f"the {expected} processes formed {formed}: install a torch built for this driver's CUDA "
                "(pytorch.org), or train on the CPU: ./launch.sh --config cpu"
            )
        raise RecipeError(
            f"the launcher started {expected} processes but they formed {formed} (distributed type {kind}): each "
            "process would train its own copy of the model; on a host without GPUs use ./launch.sh, or export "
            "ACCELERATE_USE_CPU=true before accelerate launch (accelerate_configs/cpu.yaml)"
        )
    for name, asked in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED")):
        if parse_flag_from_env(asked) and kind != name:  # under ACCELERATE_USE_CPU: preflight.sharding_left_out_on_cpu
            raise RecipeError(
                f"the accelerate config asks for {name}, and Accelerate set up {kind} instead (on this host it does "
                f"not apply {name}); use a config this host runs, such as accelerate_configs/cpu.yaml without a GPU"
            )


def library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "accelerate", "transformers", "datasets", "safetensors", "deepspeed", "peft"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    if torch.cuda.is_available():
        versions["cuda"], versions["gpu"] = torch.version.cuda, torch.cuda.get_device_name()
    return versions
