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
import importlib.util
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

from .preemption import PREEMPTED_EXIT_CODE, STATUS_FILE_ENV, Preempted, write_status

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
    return text.splitlines()[0].rstrip(".") if text else type(err).__name__  # ends inside a sentence of ours


def decide_on_main(accelerator, fn):
    """Run `fn` on the main process alone; every process returns its result or raises its
    RecipeError or RunFinished (printed once, by the main process). Decisions about --output_dir
    are taken once, so no two processes see the folder at different moments."""
    if accelerator is None or accelerator.num_processes == 1:
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


def make_accelerator(args, **kwargs) -> Accelerator:
    """The recipes' Accelerator (accumulation, trackers, the process group's timeout), after and with
    the checks that refuse a launch that would not train as one job:

    - more processes on this node than visible GPUs is refused now, not with 'invalid device ordinal';
    - a process started by a launcher ends with it (Linux's parent-death signal, SIGTERM: it stops at a
      checkpoint), instead of training on alone when the launcher is killed;
    - a stuck collective fails after --ddp_timeout seconds instead of torch's 30 minutes or more, and
      hosts without GPUs get gloo explicitly (DeepSpeed's CPU path needs it to see the world size);
    - the processes the launcher started must form one group that syncs gradients (one all-reduce
      proves it), and DeepSpeed's config must agree with the recipe's accumulation and clipping.
    """
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    _refuse_known_bad_versions(expected)
    _check_visible_gpus()
    if _started_by_a_launcher():
        die_with_parent(signal.SIGTERM, _PARENT)
    group = {"timeout": datetime.timedelta(seconds=args.ddp_timeout)}
    if expected > 1 and not torch.cuda.is_available():
        group["backend"] = "gloo"
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(**group)],
        **kwargs,
    )
    _setup_logging(accelerator)
    _cache_missing_optional_packages()
    check_process_group(accelerator, expected)
    if accelerator.state.deepspeed_plugin is not None:
        _agree_with_deepspeed(
            accelerator.state.deepspeed_plugin.deepspeed_config, args.gradient_accumulation_steps, args.max_grad_norm
        )
    return accelerator


# (package, first good version, what goes wrong below it): releases that would not fail, but train
# wrong or hang, so a user whose pip ignored pyproject's floors learns it before anything runs.
KNOWN_BAD = (("torch", "2.8", "a job of several processes hangs at exit in destroy_process_group", 2),)


def _refuse_known_bad_versions(processes: int) -> None:
    from packaging.version import Version

    for package, good, problem, from_processes in KNOWN_BAD:
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if processes >= from_processes and Version(installed).release < Version(good).release:
            raise RecipeError(
                f"{package} {installed} is installed, and with it {problem}; pip install '{package}>={good}' "
                "(pyproject.toml lists the versions the recipes are tested with)"
            )


def _cache_missing_optional_packages() -> None:
    """Accelerate's prepared optimizer asks whether the optional package lomo_optim is installed twice
    at every optimizer step (accelerate/optimizer.py, is_lomo_available: an uncached importlib.util.find_spec,
    one stat per sys.path entry: 100 to 300 us a step here, more on a network filesystem). A package that
    is not installed is recorded as such in sys.modules, Python's own record of imports (None: "not
    importable"), so that the question costs nothing; an installed one is left alone."""
    for name in ("lomo_optim",):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = None


def _started_by_a_launcher() -> bool:
    """torchrun's workers, launch.sh's processes, or the one process `accelerate launch` starts alone."""
    if "TORCHELASTIC_RUN_ID" in os.environ or STATUS_FILE_ENV in os.environ:
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


def _setup_logging(accelerator: Accelerator) -> None:
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
