"""Building the Accelerator, and refusing launches that would not train as one job.

The failure this module exists for: a launcher starts N processes, they never form one process
group (or form one whose model is never wrapped for gradient sync), and each process quietly
trains its own copy. The run "works", the loss goes down, and the result is N independent
models. `make_accelerator` checks what actually formed and stops with one line naming the fix.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import importlib.metadata
import logging
import os
import platform
import signal
import sys
import traceback
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list
from tqdm.auto import tqdm

from .preemption import PREEMPTED_EXIT_CODE, Preempted, write_status

logger = get_logger("recipes")

CPU_FIX = (
    "on a host without GPUs use ./launch.sh, or export ACCELERATE_USE_CPU=true before "
    "accelerate launch (accelerate_configs/cpu.yaml)"
)


class RecipeError(Exception):
    """A mistake the user can fix. Printed as one `error:` line; the process exits with code 2.

    `same_on_every_rank` (the default) means every process reaches the same error, so only rank 0
    prints it; pass False for a failure that may hit one rank alone, so that rank reports it.
    """

    def __init__(self, message: str, same_on_every_rank: bool = True):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


class DataError(RecipeError):
    """Bad data met by one process, often in a DataLoader worker (an unreadable image): the rank
    that meets it reports it. DataLoader re-raises a worker's exception as `DataError(text)` with
    the worker's traceback in the text; `one_line` recovers the message."""

    def __init__(self, message: str, same_on_every_rank: bool = False):
        super().__init__(message, same_on_every_rank)


class RunFinished(Exception):
    """The run in --output_dir has finished already (a requeued job, `latest` on a finished run):
    nothing to do. Printed as one `done:` line; the process exits with code 0."""


def one_line(err: BaseException) -> str:
    """An exception's message as one line: the original message of an exception re-raised from a
    DataLoader worker, the first line of a multi-line one."""
    text = str(err).strip()
    if "\nOriginal Traceback" in text:  # torch's ExceptionWrapper: "...\n<module>.<Type>: <message>"
        last = text.splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return text.splitlines()[0] if text else type(err).__name__


def distributed(accelerator) -> bool:
    """Whether `accelerator` (None: no Accelerator, as in a single-process helper) spans processes."""
    return accelerator is not None and accelerator.num_processes > 1


def decide_on_main(accelerator, fn):
    """Run `fn` on the main process alone; every process returns its result or raises its
    RecipeError or RunFinished (printed once, by the main process). Decisions about --output_dir
    are taken once, so no two processes see the folder at different moments."""
    if not distributed(accelerator):
        return fn()
    outcome = [None]
    if accelerator.is_main_process:
        try:
            outcome = [("ok", fn())]
        except (RecipeError, RunFinished) as err:
            broadcast_object_list([(type(err).__name__, str(err))])
            raise
        except BaseException as err:
            broadcast_object_list([("RecipeError", f"the main process failed: {one_line(err)}")])
            raise
    broadcast_object_list(outcome)
    kind, value = outcome[0]
    if kind == "ok":
        return value
    raise RunFinished(value) if kind == "RunFinished" else RecipeError(value)


@contextlib.contextmanager
def exit_codes():
    """Around a recipe's main(): a user's mistake (RecipeError) becomes one `error:` line and exit 2; a
    run that had finished already (RunFinished) one `done:` line and exit 0; a stop on a signal, its
    checkpoint saved (Preempted), one line and exit PREEMPTED_EXIT_CODE; a second Ctrl-C one line and
    exit 130; a bug its traceback and exit 1. launch.sh learns how the run ended from
    RECIPE_STATUS_FILE."""
    # The launcher's RANK, not Accelerate's: when the group did not form, every process believes
    # it is process 0.
    first = os.environ.get("RANK", "0") == "0"
    together = True  # every process ends here at the same point: the process group can be taken down
    try:
        yield
        write_status("finished")
        return
    except RecipeError as err:
        if not err.same_on_every_rank or first:
            tqdm.write(f"error: {one_line(err)}", file=sys.stderr)  # on a line of its own, below a progress bar
        write_status("error")
        together, code = err.same_on_every_rank, 2
    except RunFinished as done:
        if first:
            tqdm.write(f"done: {done}", file=sys.stderr)
            write_status("finished")
        code = 0
    except Preempted as stop:
        if first:
            tqdm.write(f"preempted: {stop}", file=sys.stderr)
            write_status(f"preempted {stop.step} {stop.checkpoint}")
        code = PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        if first:
            tqdm.write("interrupted by Ctrl-C: nothing was saved after the last checkpoint", file=sys.stderr)
            write_status("interrupted")
        together, code = False, 130
    except Exception:
        # Printed here rather than at exit, so the frames holding the DataLoader (and its
        # workers, which ignore SIGTERM) are released first: the workers are then shut down
        # instead of holding the exit up.
        traceback.print_exc()
        together, code = False, 1
    # A gloo group left to the interpreter's exit can abort the process (SIGABRT, "terminate called
    # without an active exception": pytorch#190489), turning exit 2 into a crash. Taken down only when
    # every process is here: one still inside a collective could make the teardown wait for ever.
    if together and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)


def process_group_kwargs(ddp_timeout: int = 600) -> InitProcessGroupKwargs:
    """For `Accelerator(kwargs_handlers=[...])`: the process group's settings, after the checks that
    must precede it.

    - More processes on this node than visible GPUs is refused now, not with 'invalid device ordinal'.
    - A process started by a launcher ends with it (Linux's parent-death signal, SIGTERM: it stops
      at a checkpoint), instead of training on alone when the launcher is killed.
    - A process restarted by `--max_restarts` joins its attempt's group (see _join_restarted_group).
    - A stuck collective fails after `ddp_timeout` seconds instead of torch's 30 minutes or more.
    - Hosts without GPUs get gloo explicitly: DeepSpeed's CPU path needs it to see the world size.
    """
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    _check_visible_gpus()
    if _started_by_a_launcher():
        die_with_parent(signal.SIGTERM, _PARENT)
    kwargs = {"timeout": datetime.timedelta(seconds=ddp_timeout)}
    if expected > 1 and not torch.cuda.is_available():
        kwargs["backend"] = "gloo"
    try:
        _join_restarted_group(kwargs)
    except torch.distributed.DistError as err:
        raise RecipeError(
            f"the process group did not form ({err}); check that MASTER_ADDR/MASTER_PORT are "
            "reachable from every process and that the port is free"
        ) from err
    return InitProcessGroupKwargs(**kwargs)


def check_launch(accelerator: Accelerator, gradient_accumulation_steps: int = 1, max_grad_norm: float | None = None):
    """Refuse a launch that would not train as one job: the processes the launcher started must form
    one group that syncs gradients (one all-reduce proves it), and under DeepSpeed, which clips and
    accumulates itself, its config must agree with the recipe's accumulation (its clipping is set
    from `max_grad_norm` when the config leaves it to us)."""
    check_process_group(accelerator, int(os.environ.get("WORLD_SIZE", "1")))
    if accelerator.state.deepspeed_plugin is not None:
        _agree_with_deepspeed(
            accelerator.state.deepspeed_plugin.deepspeed_config, gradient_accumulation_steps, max_grad_norm
        )


def _started_by_a_launcher() -> bool:
    """torchrun's workers, or the one process `accelerate launch` starts without it."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(os.fsdecode(arg)).name == "accelerate" for arg in parent[:2]) and b"launch" in parent


_PARENT = os.getppid()  # as early as this process can tell: the launcher that started it


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask Linux to send this process `sig` when its parent exits (prctl PR_SET_PDEATHSIG, kept across
    execve; elsewhere nothing, and False). torchrun starts its workers in sessions of their own, so
    killing the launcher, or its process group, would otherwise leave them training. `parent`: the
    pid the parent should have; if it is gone already (this process was reparented), `sig` is sent now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def _join_restarted_group(pg_kwargs: dict) -> None:
    """Under `--max_restarts`, torchrun's static rendezvous keeps one store for every attempt, and
    init_process_group's keys do not name the attempt: restarted processes read the dead
    attempt's addresses and fail to connect ("Connection refused"). Join with the attempt in the
    key prefix instead; Accelerate then uses the group that is already there."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    timeout = pg_kwargs["timeout"]
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    backend = pg_kwargs.get("backend") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(
        backend,
        store=torch.distributed.PrefixStore(f"attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def _agree_with_deepspeed(config: dict, gradient_accumulation_steps: int, max_grad_norm: float | None) -> None:
    """DeepSpeed's own accumulation and clipping settings win over Accelerate's; make them the recipe's."""
    steps = config.get("gradient_accumulation_steps", "auto")
    if steps not in ("auto", gradient_accumulation_steps):
        raise RecipeError(
            f"the DeepSpeed config sets gradient_accumulation_steps={steps} but the recipe has "
            f"{gradient_accumulation_steps}; remove it from the config (the recipe's value is used) or pass "
            f"--gradient_accumulation_steps {steps}"
        )
    config["gradient_accumulation_steps"] = gradient_accumulation_steps
    if max_grad_norm is not None and config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = max_grad_norm


def check_process_group(accelerator: Accelerator, expected: int) -> None:
    """Refuse to train unless the `expected` processes form one group that syncs gradients."""
    if accelerator.num_processes != expected:
        raise RecipeError(
            f"the launcher started {expected} processes but they formed a group of "
            f"{accelerator.num_processes} (distributed type {accelerator.distributed_type.value}): "
            f"each process would train its own copy of the model; {CPU_FIX}"
        )
    if expected > 1 and accelerator.distributed_type == DistributedType.NO:
        raise RecipeError(
            f"{expected} processes formed a group, but with distributed type NO the model would "
            f"not be wrapped for gradient synchronisation; {CPU_FIX}"
        )
    if expected > 1:
        # Ask the group itself: one all-reduce proves every process is in it.
        total = accelerator.reduce(torch.ones(1, device=accelerator.device), reduction="sum")
        if int(total.item()) != expected:
            raise RecipeError(
                f"an all-reduce over the process group counted {int(total.item())} processes, "
                f"expected {expected}; check the launcher's --num_processes and --num_machines"
            )


LIBRARIES = ("torch", "torchvision", "accelerate", "transformers", "datasets", "safetensors", "deepspeed", "peft")


def library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
        versions["gpu"] = torch.cuda.get_device_name()
    return versions


def _check_visible_gpus() -> None:
    """More processes on a node than GPUs fails later with 'invalid device ordinal'; say why now."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return
    if not torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local > gpus:
        raise RecipeError(
            f"{local} processes were started on this node but only {gpus} GPU(s) are visible; "
            f"pass --num_processes {gpus} (or fewer), or check CUDA_VISIBLE_DEVICES"
        )


def setup_logging(accelerator: Accelerator) -> None:
    """INFO from the main process, warnings and errors from every process; libraries' chatter off."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
    )
    for noisy in (
        "torch.distributed",
        "torch.nn.parallel",
        "datasets",
        "httpx",
        "urllib3",
        "accelerate.checkpointing",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING)
