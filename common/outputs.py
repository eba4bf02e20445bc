"""One run per --output_dir, and a run writes only what it owns: it claims the folder before it does any work
there, never mixes its checkpoints or weights with another run's, never writes over files no run of these
recipes wrote (a pretrained model's folder, say), and deletes only what runs wrote.

    .run.lock   locked by the run writing here, which says who it is in it; removed when that run ends
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

from .checkpoint import (
    CHECKPOINT_RE,
    MODEL_FILES,
    RESULTS_FILE,
    STATE_FILE,
    TMP_CHECKPOINT_RE,
    checkpoint_step,
    complete_checkpoints,
    finish_interrupted_saves,
    load_checkpoint,
    model_files,
    nearest_existing,
    not_a_checkpoint,
    record_written,
    remove_checkpoint,
    resharded_deepspeed,
    resolve_checkpoint,
    save_checkpoint,
    save_model,
)
from .metrics import tracker_config, write_results
from .runtime import RecipeError, RunFinished, decide_on_main, logger, one_line

try:
    import fcntl
except ImportError:  # Windows: no fcntl locks; runs go unguarded, with a warning
    fcntl = None

LOCK_FILE = ".run.lock"
# Files a final save writes: where one is there and no run of ours recorded writing it, the folder holds a model
# of someone else's (save_pretrained's names, ours, peft's).
MODEL_NAMES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "config.json", "generation_config.json",
    "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
)  # fmt: skip
TMP_FILES = (".tmp-model", f".{RESULTS_FILE}.tmp", f".{MODEL_FILES}.tmp")  # of an interrupted final save
# Filesystems without working locks (Lustre mounted without -o flock, some FUSE and SMB mounts).
UNSUPPORTED_LOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class OutputDir:
    """--output_dir, claimed for this run, and what the run writes there: checkpoints, the final weights,
    results.json. `resume_from`: the checkpoint this run continues, or None."""

    def __init__(self, accelerator, args):
        self.accelerator, self.args = accelerator, args
        self.resume_from = prepare_output_dir(accelerator, args)
        resharded_deepspeed(accelerator, self.resume_from)  # before the engine is built from the config

    def load_checkpoint(self, model, optimizer) -> dict:
        return load_checkpoint(self.accelerator, self.resume_from, model, optimizer, self.args)

    def save_checkpoint(self, model, plan, at, log) -> Path:
        return save_checkpoint(self.accelerator, model, self.args, plan, at, log)

    def save_model(self, model, tokenizer=None) -> Path:
        return save_model(self.accelerator, model, self.args.output_dir, tokenizer)

    def write_results(self, plan, **metrics) -> Path:
        return write_results(self.accelerator, self.args, plan, **metrics)

    def record_written(self, *names) -> None:
        """Files or folders the run wrote beside its weights: the next save or --overwrite_output_dir removes them."""
        if self.accelerator.is_main_process:
            record_written(self.args.output_dir, *names)


def prepare_output_dir(accelerator, args) -> Path | None:
    """Claim --output_dir before any work there; return the checkpoint to resume from, or None. The main process
    locks it until it exits. An earlier run there is refused unless this one continues it or passes
    --overwrite_output_dir; `latest` on a finished run raises RunFinished (a requeued job ends, exit 0); a restart
    under --max_restarts resumes `latest`. Every process proves it can write there now, not hours in."""
    output_dir, spec = Path(args.output_dir), args.resume_from_checkpoint
    overwrite = bool(getattr(args, "overwrite_output_dir", False))
    for name, value in vars(args).items():  # an input folder the run reads: what it writes would become input
        if name not in ("output_dir", "resume_from_checkpoint") and isinstance(value, str) and Path(value).is_dir():
            if output_dir.resolve().is_relative_to(Path(value).resolve()):
                where = "is" if output_dir.resolve() == Path(value).resolve() else "lies inside"
                raise RecipeError(
                    f"--output_dir {output_dir} {where} --{name} {value}, which the run reads: what it writes there "
                    "would become part of its input, or replace it; pass an --output_dir outside it"
                )
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not spec and restarts > 0:
        logger.warning(f"restart {restarts} of this job (--max_restarts): resuming from the latest checkpoint")
        spec, overwrite = "latest", False  # the first attempt started over already
    continuing = decide_on_main(accelerator, lambda: _claim(output_dir, spec, overwrite))
    _check_writable(accelerator, output_dir)
    if continuing:
        decide_on_main(accelerator, lambda: finish_interrupted_saves(output_dir))
    resume_from = resolve_checkpoint(output_dir, spec, accelerator=accelerator)
    decide_on_main(accelerator, lambda: _begin(output_dir, overwrite))
    accelerator.init_trackers(args.recipe, config=tracker_config(args))
    return resume_from


def _claim(output_dir: Path, spec: str | None, overwrite: bool) -> bool:
    """On the main process: lock output_dir, refuse what would mix or overwrite runs; whether this run continues
    the one there."""
    path = None if spec in (None, "latest") else Path(spec)
    if path is not None and not (path / STATE_FILE).is_file():  # a typo, or the run's folder itself
        raise RecipeError(not_a_checkpoint(spec))
    inside = path is not None and path.resolve().parent == output_dir.resolve()  # a checkpoint of this run
    if overwrite and (spec == "latest" or inside):
        what = f"latest continues the run in {output_dir}" if spec == "latest" else f"{spec} is one it would delete"
        raise RecipeError(f"--overwrite_output_dir starts over and --resume_from_checkpoint {what}: pass one of them")
    lock = _RunLock.acquire(output_dir)
    try:
        ours = set(model_files(output_dir))
        foreign = [n for n in MODEL_NAMES if (output_dir / n).exists() and n not in ours]
        if foreign:  # a pretrained model's own folder, say: --overwrite_output_dir deletes only what runs wrote
            raise RecipeError(
                f"--output_dir {output_dir} holds a model that no run of these recipes wrote ({', '.join(foreign)}), "
                "which a run would write over; pass another --output_dir"
            )
        previous = _run_outputs(output_dir)
        if spec == "latest" and (finished := _finished(output_dir)):
            raise RunFinished(finished)
        if previous and not (spec == "latest" or inside or overwrite):
            advice = (
                f" and --resume_from_checkpoint {spec} is another folder's checkpoint; pass --overwrite_output_dir to "
                "start over there from it, or another --output_dir"
                if spec
                else "; pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to start over, or "
                "another --output_dir"
            )
            raise RecipeError(f"--output_dir {output_dir} already holds a run ({', '.join(previous[:4])}){advice}")
    except BaseException:
        lock.release()
        raise
    return spec == "latest" or inside


def _begin(output_dir: Path, overwrite: bool) -> None:
    """On the main process, once nothing can refuse the run: it owns the folder now."""
    _RunLock.held[_key(output_dir)].proceed()
    if overwrite:
        _start_over(output_dir)


def _ours(path: Path) -> bool:
    """A checkpoint folder in one of the forms this project's saves write."""
    return path.is_dir() and any(r.fullmatch(path.name) for r in (CHECKPOINT_RE, TMP_CHECKPOINT_RE))


def _run_outputs(output_dir: Path) -> list:
    """Names in output_dir that a recipe's run wrote there (its lock file aside)."""
    if not output_dir.is_dir():
        return []
    written = {
        RESULTS_FILE,
        *(set(model_files(output_dir)) & {"model.safetensors", "config.json", "adapter_config.json"}),
    }
    return sorted(p.name for p in output_dir.iterdir() if p.name in written or _ours(p))


def _finished(output_dir: Path) -> str | None:
    """Why output_dir holds a finished run (results.json, written last, and no checkpoint after it), or None."""
    if not (output_dir / RESULTS_FILE).is_file():
        return None
    try:
        steps = json.loads((output_dir / RESULTS_FILE).read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        steps = None
    checkpoints = complete_checkpoints(output_dir)
    if checkpoints and (checkpoints[-1] / STATE_FILE).stat().st_mtime > (output_dir / RESULTS_FILE).stat().st_mtime:
        return None
    further = (
        f"; to train it further pass --resume_from_checkpoint {max(checkpoints, key=checkpoint_step)} with a larger "
        "--max_train_steps"
        if checkpoints
        else ""
    )
    counted = f", {steps} steps" if isinstance(steps, int) else ""
    return (
        f"{output_dir} holds a finished run ({RESULTS_FILE}{counted}): nothing left to train{further}; to start over, "
        "pass --overwrite_output_dir instead of --resume_from_checkpoint"
    )


def _start_over(output_dir: Path) -> None:
    """--overwrite_output_dir: delete what runs wrote (checkpoints' listed files, a save's temporary forms,
    results.json, save_model's recorded files); a user's files, even inside a checkpoint, stay."""
    if not output_dir.is_dir():
        return
    names = {RESULTS_FILE, MODEL_FILES, *TMP_FILES, *model_files(output_dir)}
    saved = lambda p: _ours(p) and (TMP_CHECKPOINT_RE.fullmatch(p.name) or (p / STATE_FILE).is_file())  # noqa: E731
    found = sorted(
        (p for p in output_dir.iterdir() if saved(p) or p.name in names), key=lambda p: (not _ours(p), p.name)
    )
    if found:
        logger.warning(f"--overwrite_output_dir: deleting the earlier run's {', '.join(p.name for p in found)}")
    for path in sorted(found, key=lambda p: p.name != RESULTS_FILE):  # results.json first: no longer finished
        if CHECKPOINT_RE.fullmatch(path.name):
            remove_checkpoint(path)
        else:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _check_writable(accelerator, output_dir: Path) -> None:
    """Every process writes a file in output_dir (or the nearest existing folder above it); all agree."""
    problem = "it is a file" if output_dir.exists() and not output_dir.is_dir() else None
    if problem is None:
        try:  # a file without a name (O_TMPFILE): a process stopped here leaves nothing in the folder
            with tempfile.TemporaryFile(dir=nearest_existing(output_dir)) as probe:
                probe.write(b"ok")
                probe.flush()
        except OSError as err:
            problem = one_line(err)
    flag = torch.tensor([problem is not None], device=accelerator.device, dtype=torch.int32)
    if failed := int(accelerator.reduce(flag, reduction="sum").item()):
        raise RecipeError(_unwritable(output_dir, problem or f"{failed} process(es) on other nodes cannot"))


def _unwritable(output_dir: Path, detail: str) -> str:
    return (
        f"cannot write to --output_dir {output_dir} ({detail}); pass a folder this job can write to, on a filesystem "
        "every node sees"
    )


def _key(output_dir: Path) -> str:
    return str(Path(output_dir).resolve())


class _RunLock:
    """An fcntl lock on <output_dir>/.run.lock, held by the main process until it exits: the kernel releases it
    however the process ends (no stale lock), and it holds across NFS nodes. A run that proceeds writes who it is
    there, for a second run's message; a refused run leaves the folder as it found it. Nothing else in the process
    may open the file: closing any descriptor of it drops the lock."""

    held: dict = {}
    warned = False

    def __init__(self, output_dir: Path):
        self.output_dir, self.path, self.pid = output_dir, output_dir / LOCK_FILE, os.getpid()
        self.fd, self.created, self.created_dirs, self.proceeded = None, False, [], False

    @classmethod
    def acquire(cls, output_dir: Path) -> _RunLock:
        if _key(output_dir) in cls.held:  # this process holds it already (a second prepare_output_dir)
            return cls.held[_key(output_dir)]
        lock = cls(output_dir)
        try:
            lock._acquire()
        except BaseException:
            lock.release()
            raise
        if not cls.held:
            atexit.register(cls.release_all)
        cls.held[_key(output_dir)] = lock
        return lock

    def _acquire(self) -> None:
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise RecipeError(_unwritable(self.output_dir, "it is a file"))
        for _ in range(50):  # another run removing or replacing the file meanwhile: try again
            try:
                for folder in reversed([p for p in [self.output_dir, *self.output_dir.parents] if not p.exists()]):
                    folder.mkdir(exist_ok=True)
                    self.created_dirs.append(folder)
                try:
                    fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
                except FileExistsError:
                    fd, created = os.open(self.path, os.O_RDWR), False
            except FileNotFoundError:
                continue
            except OSError as err:
                raise RecipeError(_unwritable(self.output_dir, one_line(err))) from err
            self.fd, self.created = fd, created
            try:
                if fcntl is None:
                    raise OSError(errno.ENOSYS, "no fcntl on this platform")
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EACCES, errno.EAGAIN):
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "it has not said who"
                    raise RecipeError(
                        f"--output_dir {self.output_dir} is in use by another run ({holder}); wait for it to end, or "
                        "pass another --output_dir"
                    ) from err
                self._close()
                if err.errno == errno.ESTALE:  # NFS: the file was removed on another node
                    continue
                if err.errno not in UNSUPPORTED_LOCK:
                    raise RecipeError(
                        f"cannot lock --output_dir {self.output_dir} ({one_line(err)}); pass a folder on another "
                        "filesystem"
                    ) from err
                if not _RunLock.warned:
                    logger.warning(
                        f"cannot lock --output_dir {self.output_dir} on this filesystem ({one_line(err)}): a second "
                        "run started into it would not be stopped"
                    )
                    _RunLock.warned = True
                return
            with_path = self.path.exists() and os.stat(self.path)[1:3] == os.fstat(fd)[1:3]  # (inode, device)
            if with_path:
                return
            self._close()  # its holder removed it meanwhile: lock the one at the path now
        raise RecipeError(f"could not lock --output_dir {self.output_dir}: its lock file kept being replaced")

    def proceed(self) -> None:
        """The run goes on: the file now says who holds it (another node reads it over NFS: fsync)."""
        self.proceeded = True
        if self.fd is not None:
            job = f", Slurm job {os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else ""
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}{job}, started {started}\n".encode(), 0)
            os.fsync(self.fd)

    def _close(self) -> None:
        if self.fd is not None:
            if self.created or self.proceeded:  # removed while still locked: a run waiting on it sees it replaced
                with contextlib.suppress(OSError):
                    self.path.unlink()
            os.close(self.fd)
            self.fd, self.created = None, False

    def release(self) -> None:
        if self.pid != os.getpid():  # a forked child inherited the object, not the lock
            return
        self._close()
        for folder in reversed(self.created_dirs):
            try:
                folder.rmdir()  # only if nothing was written there
            except OSError:
                break
        self.created_dirs = []
        _RunLock.held.pop(_key(self.output_dir), None)

    @classmethod
    def release_all(cls) -> None:
        for lock in list(cls.held.values()):
            lock.release()
