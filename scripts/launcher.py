"""launch.sh's side of `accelerate launch`: the recipe's exit code is launch.sh's, and killing the
launcher, however it is done, stops the training processes.

    launcher.py config FILE        the values of an accelerate config that launch.sh needs, as shell words
    launcher.py show WORD...       a command as launch.sh prints it, with credentials masked
    launcher.py run ARGS...        `accelerate launch ARGS...`, run in this process (launch.sh does)

`run` calls accelerate's own launch entry point, not the `accelerate` command, because that command
ends a failed run with torch's ChildFailedError traceback (15 to 40 lines, after the recipe's one
`error:` line) and exits 1 whatever the recipe's exit code was. Here the launcher exits with the
code of the process that failed first: 2 for a user mistake, 75 for a stop at a checkpoint, and
adds nothing to what the processes said, except for a process killed by a signal (which could
not say anything itself). torch.distributed.elastic's logging of the same facts is left out. A
process that crashes with a real bug still prints its own traceback: that is a bug report.

Processes that outlive their launcher keep training and writing checkpoints into a folder that a
relaunch then shares. torch's elastic agent starts each process in a session of its own, so
killing launch.sh's process groups does not reach them. Linux's parent-death signal does: `run`
sets it for itself (SIGTERM when launch.sh dies), and each training process sets it for itself
(SIGTERM when the launcher dies; common.runtime.process_group_kwargs). SIGTERM is the signal the
recipes stop on: every process finishes its step and saves a checkpoint. Elsewhere than Linux
this does nothing.

Only the standard library is imported at the top: `config` and `show` start in a few tens of
milliseconds; `run` imports accelerate.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

# The rules common/metrics.py masks credentials with in results.json (tests/test_launcher.py
# keeps the two equal); here they apply to launch.sh's printed command and the launcher's messages.
SECRET_NAMES = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|credentials?)($|_)", re.I)
SECRET_VALUES = re.compile(r"hf_[A-Za-z0-9]{20,}|(?<=://)[^/@\s]+:[^/@\s]+(?=@)")  # hub tokens, user:password@ in URLs

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask Linux to send this process `sig` when its parent dies (prctl PR_SET_PDEATHSIG, kept
    across execve). `parent`: the pid the parent should have; if it died before the request was
    made (this process already reparented), `sig` is sent now. False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


# ---------------------------------------------------------------- config, show


def mask(words: list[str]) -> list[str]:
    """Command words with credentials masked: the value of a flag named like a credential
    (--hub_token X, --hub_token=X, --wandb-api-key X) and any hub token or URL password."""
    shown, hide_next = [], False
    for word in words:
        if hide_next and not word.startswith("-"):
            shown.append("***")
            hide_next = False
            continue
        hide_next = False
        if word.startswith("--"):
            name, eq, _ = word[2:].partition("=")
            if SECRET_NAMES.search(name.replace("-", "_")):
                if eq:
                    word = f"--{name}=***"
                else:
                    hide_next = True
        shown.append(SECRET_VALUES.sub("***", word))
    return shown


def show(words: list[str]) -> str:
    return "+ " + " ".join(shlex.quote(word) for word in mask(words))


CONFIG_KEYS = {"num_machines": int, "num_processes": int, "distributed_type": str, "use_cpu": bool}


def read_config(path: str) -> list[str]:
    """num_machines, num_processes, distributed_type and use_cpu of an accelerate YAML, checked."""
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        mark = getattr(err, "problem_mark", None)
        reason = getattr(err, "problem", None) or getattr(err, "strerror", None) or str(err).splitlines()[0]
        where = f" at line {mark.line + 1}" if mark else ""
        raise ValueError(f"{path}: not a readable YAML file ({reason}{where})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not an accelerate config (a YAML mapping of keys such as distributed_type)")
    values = {"num_machines": 1, "num_processes": 1, "distributed_type": "NO", "use_cpu": False}
    for key, kind in CONFIG_KEYS.items():
        value = config.get(key, values[key])
        if kind is int and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{path}: {key} must be a whole number from 1, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{path}: {key} must be true or false, got {value!r}")
        if kind is str and not (isinstance(value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]*", value)):
            raise ValueError(f"{path}: {key} must be a name such as MULTI_GPU or DEEPSPEED, got {value!r}")
        values[key] = value
    return [
        str(values["num_machines"]),
        str(values["num_processes"]),
        values["distributed_type"],
        str(values["use_cpu"]).lower(),
    ]


# ---------------------------------------------------------------- run

_child: subprocess.Popen | None = None  # the one process of a launch without a process group
_stopping = False  # a stop signal was passed on to _child


def _on_stop_signal(signum, frame) -> None:
    """SIGTERM, SIGINT or SIGHUP before torch's agent takes these signals over (when it starts
    the processes): pass it on as SIGTERM to a running single process, which then saves a
    checkpoint. With nothing started yet, end at once: an exception raised here, in the middle
    of importing accelerate or of a rendezvous, could leave them half done and say so at length."""
    global _stopping
    if _child is not None and _child.poll() is None:
        _child.send_signal(signal.SIGTERM)
        _stopping = True
        return
    os._exit(128 + signum)


def _simple_launcher(args) -> None:
    """accelerate's launcher for one process without a process group (`--cpu`), with the child
    kept at hand for the signal handler and its exit code returned instead of raised."""
    global _child
    from accelerate.commands.launch import prepare_simple_launcher_cmd_env

    cmd, env = prepare_simple_launcher_cmd_env(args)
    _child = subprocess.Popen(cmd, env=env)
    _child.wait()
    if _child.returncode:
        raise _ProcessFailed(_child.returncode, "the process")


class _ProcessFailed(Exception):
    def __init__(self, exitcode: int, who: str):
        super().__init__(who)
        self.exitcode, self.who = exitcode, who


class _QuietElastic(logging.Filter):
    """torch.distributed.elastic's log of a failed or stopped run repeats what the processes and
    the launcher's exit code say; keep its other messages, and say one of them in our words."""

    DROP = (
        "Sending process %s closing signal %s",
        "Closing process %s via signal %s",
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        "Received %s death signal, shutting down workers",
        "Got termination signal: %s",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in self.DROP:
            return False
        if record.msg == "Unable to shutdown process %s via %s, forcefully exiting via %s" and len(record.args) == 3:
            pid, sig, _ = record.args
            timeout = os.environ.get(SHUTDOWN_TIMEOUT_ENV, "30")
            record.msg = (
                f"launch.sh: process {pid} had not exited {timeout} s after {getattr(sig, 'name', sig)} "
                f"({SHUTDOWN_TIMEOUT_ENV}): killed it; a checkpoint it had not finished is not used "
                "by --resume_from_checkpoint latest"
            )
            record.args = ()
            return True
        record.msg = f"launcher: {record.levelname.lower()}: {SECRET_VALUES.sub('***', record.getMessage())}"
        record.args = ()
        return True


def _quiet_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_QuietElastic())
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(handler)
    elastic.propagate = False
    # accelerate saying it picked --num_cpu_threads_per_process by itself asks nothing of the user
    logging.getLogger("accelerate.commands.launch").addFilter(
        lambda record: not str(record.msg).startswith("The following values were not passed to `accelerate launch`")
    )


_exit_codes: dict = {}  # local rank -> exit code of the processes torch's agent closed last


def _record_exit_codes() -> None:
    """Keep the exit codes of the processes whenever torch's agent closes them: when the agent
    stops on a signal it raises SignalException whatever they were, and a run whose processes
    finished (0) or stopped at a checkpoint (75) must not end as killed."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_and_record(self, *args, **kwargs):
        try:
            return close(self, *args, **kwargs)
        finally:
            handlers = getattr(self, "subprocess_handlers", None) or {}
            _exit_codes.clear()
            _exit_codes.update({rank: h.proc.poll() for rank, h in handlers.items()})

    PContext.close = close_and_record


def _stop_once() -> None:
    """torch's agent raises SignalException on every SIGTERM, SIGINT or SIGHUP; one that arrives
    while it waits for the processes to save their checkpoint cuts that wait short (two or three
    do: scancel signals every process of the step, launch.sh passes its own on). The first one
    stops the run; the others are let go."""
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = getattr(api, "_terminate_process_handler", None)
    if raise_signal is None:  # another torch: its own handling stands
        return
    received = []

    def first_only(signum, frame):
        if not received:
            received.append(signum)
            raise_signal(signum, frame)

    api._terminate_process_handler = first_only


def _stopped_code(signum: int) -> int:
    """launch.sh's exit code after torch's agent stopped the processes on `signum`: theirs when
    they all finished, stopped at a checkpoint (75) or met an error (2), else the signal's."""
    codes = [code for code in _exit_codes.values() if code is not None]
    if codes and all(code == 0 for code in codes):
        return 0
    for wanted in (2, 75):
        if wanted in codes:
            return wanted
    return max([code for code in codes if code > 0], default=128 + signum)


def _first_failure(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the process that failed first. torch stamps failures in whole seconds,
    and a process whose peer left (cutting a collective short) often fails in the same second as
    that peer: among those, the one that said why (2: a user mistake, 75: stopped at a
    checkpoint) is the cause."""
    first = min(f.timestamp for f in failures.values())
    tied = sorted((rank, f) for rank, f in failures.items() if f.timestamp == first)
    return min(tied, key=lambda rf: (rf[1].exitcode not in (2, 75), rf[1].exitcode < 0, rf[0]))


def _exit_code(exitcode: int, who: str) -> int:
    """A shell's exit code for a process's, saying why where the process could not."""
    if exitcode >= 0:
        return exitcode
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    cause = " (out of memory? see dmesg)" if -exitcode == signal.SIGKILL else ""
    print(f"launch.sh: {who} was killed by {name}{cause}", file=sys.stderr, flush=True)
    return 128 - exitcode


def _error(message: str) -> int:
    print(f"launch.sh: error: {SECRET_VALUES.sub('***', message)}", file=sys.stderr, flush=True)
    return 2


def _children() -> list[int]:
    """The live processes whose parent is this one (Linux's /proc; elsewhere none)."""
    me, found = str(os.getpid()), []
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return found
    for entry in entries:
        if entry.name.isdigit():
            try:
                state, ppid = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):  # gone meanwhile
                continue
            if ppid == me and state != "Z":
                found.append(int(entry.name))
    return found


def _end_strays(grace: float = 5.0) -> None:
    """End the training processes torch's agent started but did not close: one started just as a stop
    signal came is not among those it stops and waits for. It sets its parent-death signal only once
    its imports are done, so it would outlive this launcher, waiting up to --ddp_timeout for a
    store that is gone. SIGTERM (such a process has not reached training: it dies at once), then
    SIGKILL after `grace` seconds."""
    strays = _children()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in strays:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while strays and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = set(_children())
            strays = [pid for pid in strays if pid in alive]
        if not strays:
            return


def run(argv: list[str]) -> int:
    parent = os.environ.pop("LAUNCH_SH_PID", None)
    die_with_parent(signal.SIGTERM, int(parent) if parent and parent.isdigit() else None)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # launch.sh passes USR1 on as TERM; a direct one must not kill us
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_stop_signal)
    try:
        import accelerate.commands.launch as accelerate_launch
        from torch.distributed import DistNetworkError
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousError
    except ImportError as err:
        return _error(f"{err}: install the project's environment (pip install -e .) or activate it")

    _quiet_logging()
    _record_exit_codes()
    _stop_once()
    args = accelerate_launch.launch_command_parser().parse_args(argv)
    accelerate_launch.simple_launcher = _simple_launcher
    try:
        accelerate_launch.launch_command(args)
    except ChildFailedError as err:
        rank, failure = _first_failure(err.failures)
        return _exit_code(failure.exitcode, f"process rank {rank} (pid {failure.pid})")
    except _ProcessFailed as err:
        if _stopping and err.exitcode == -signal.SIGTERM:  # as asked: launch.sh says so
            return 128 + signal.SIGTERM
        return _exit_code(err.exitcode, f"{err.who} (pid {_child.pid if _child else '?'})")
    except SignalException as err:  # torch's agent stopped its processes on this signal
        return _stopped_code(int(err.sigval))
    except RendezvousError as err:  # a node that did not come, or a head that cannot be reached
        head = f"{args.main_process_ip}:{args.main_process_port}" if args.main_process_ip else "the head node"
        timeout = re.search(r"join_timeout=(\d+)", args.rdzv_conf or "")
        detail = str(err).splitlines()[0] if str(err) else ""
        if timeout and "Timeout" in type(err).__name__:
            what = f"not every node joined within RDZV_TIMEOUT={timeout.group(1)} s"
        else:
            what = f"the nodes did not meet ({type(err).__name__}{': ' + detail if detail else ''})"
        return _error(
            f"{what}; check that launch.sh started on every node of the job and that each reaches {head} "
            "(see ./launch.sh doctor)"
        )
    except (ConnectionError, DistNetworkError) as err:  # accelerate's check of the port, or the store's bind
        text = str(err)
        if "utilizing it" in text or "EADDRINUSE" in text or "address already in use" in text.lower():
            port = args.main_process_port or os.environ.get("MASTER_PORT") or 29500
            return _error(
                f"port {port} on this node is in use by another process; set MASTER_PORT to a free port "
                "(the same on every node)"
            )
        raise
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        try:
            return run(rest)
        finally:
            _end_strays()
    if command == "show":
        print(show(rest))
        return 0
    if command == "config" and len(rest) == 1:
        try:
            print(" ".join(read_config(rest[0])))
        except ValueError as err:
            return _error(str(err))
        return 0
    print(f"launcher.py: unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if sys.argv[1:2] == ["run"]:  # torch and accelerate loaded: skip a second of tearing them down, nothing to save
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
