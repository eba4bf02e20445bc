"""One run per --output_dir: a run claims the folder before it does any work there, and never mixes
its checkpoints or weights with another run's, nor overwrites them by mistake.

    .run.lock   locked by the run writing here; present while it runs (or after a kill)
"""

from __future__ import annotations

import atexit
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
    OLD_CHECKPOINT_RE,
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
# The files that show --output_dir holds a run (with its checkpoint folders); save_pretrained's included.
RUN_FILES = (RESULTS_FILE, "model.safetensors", "config.json", "adapter_config.json")
# Temporary files of an interrupted final save (save_model, write_json).
TMP_FILES = (".tmp-model", ".model.safetensors.tmp", f".{RESULTS_FILE}.tmp", f".{MODEL_FILES}.tmp")
# Filesystems without working locks (Lustre mounted without -o flock, some FUSE and SMB mounts).
UNSUPPORTED_LOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class OutputDir:
    """--output_dir, claimed for this run, and what the run writes there: checkpoints, the final
    weights, results.json. `resume_from`: the checkpoint this run continues, or None."""

    def __init__(self, accelerator, args):
        self.accelerator, self.args = accelerator, args
        self.resume_from = prepare_output_dir(accelerator, args)

    def load_checkpoint(self, model, optimizer, plan) -> dict:
        return load_checkpoint(self.accelerator, self.resume_from, model, optimizer, self.args.recipe, plan)

    def save_checkpoint(self, model, plan, at, log) -> Path:
        return save_checkpoint(self.accelerator, model, self.args, plan, at, log)

    def save_model(self, model, tokenizer=None) -> Path:
        return save_model(self.accelerator, model, self.args.output_dir, tokenizer)

    def write_results(self, plan, **metrics) -> Path:
        return write_results(self.accelerator, self.args, plan, **metrics)


def prepare_output_dir(accelerator, args) -> Path | None:
    """Claim `--output_dir` for this run before any work is done there, and return the checkpoint
    to resume from (None: a fresh start).

    - The main process locks the folder until it exits (`_RunLock`): a second run started into
      it is refused, naming the first, with nothing changed.
    - A folder holding an earlier run is refused unless the run resumes it (`latest`, or a
      checkpoint of its own) or `--overwrite_output_dir` is passed, which deletes what the earlier
      run wrote (its checkpoints, weights and results.json, nothing else). Resuming another
      folder's checkpoint is a new run here, under the same rule.
    - `latest` on a finished run (results.json, written last, and no newer checkpoint) raises
      RunFinished: a requeued job that already finished ends at once, successfully.
    - A process that restarts under `accelerate launch --max_restarts N` resumes from `latest`.
    - Every process proves it can write there now rather than at the first checkpoint, hours in.
    - Once the folder is the run's, the trackers (--report_to) start logging there.
    """
    output_dir, spec = Path(args.output_dir), args.resume_from_checkpoint
    overwrite = bool(getattr(args, "overwrite_output_dir", False))
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
    """On the main process: lock output_dir, then refuse what would mix or overwrite runs. A
    refused run leaves the folder as it found it. Returns whether the run continues the one there."""
    path = None if spec in (None, "latest") else Path(spec)
    if path is not None and not (path / STATE_FILE).is_file():  # a typo, or the run's folder itself
        raise RecipeError(not_a_checkpoint(spec))
    inside = path is not None and path.resolve().parent == output_dir.resolve()  # a checkpoint of this run
    if overwrite and (spec == "latest" or inside):
        what = f"latest continues the run in {output_dir}" if spec == "latest" else f"{spec} is one it would delete"
        raise RecipeError(f"--overwrite_output_dir starts over and --resume_from_checkpoint {what}: pass one of them")
    held = _key(output_dir) in _RunLock.held
    lock = _RunLock.acquire(output_dir)
    try:
        previous = _run_outputs(output_dir)
        if spec == "latest" and _finished(output_dir):
            raise RunFinished(_finished(output_dir))
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
        if not held:
            lock.release()
        raise
    return spec == "latest" or inside


def _begin(output_dir: Path, overwrite: bool) -> None:
    """On the main process, once nothing can refuse the run any more: it owns the folder now."""
    lock = _RunLock.held.get(_key(output_dir))
    if lock is not None:
        lock.proceeded = True
    if overwrite:
        _start_over(output_dir)


def _ours(path: Path) -> bool:
    """A checkpoint folder in one of the forms this project's saves write."""
    return path.is_dir() and any(r.fullmatch(path.name) for r in (CHECKPOINT_RE, TMP_CHECKPOINT_RE, OLD_CHECKPOINT_RE))


def _run_outputs(output_dir: Path) -> list:
    """Names in output_dir that a recipe's run wrote there (its lock file aside)."""
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.name in RUN_FILES or _ours(p))


def _finished(output_dir: Path) -> str | None:
    """Why output_dir holds a finished run (results.json is written last), or None. A checkpoint
    newer than the finished run's last step means the run was resumed by path to train further,
    and `latest` continues that."""
    if not (output_dir / RESULTS_FILE).is_file():
        return None
    try:
        steps = json.loads((output_dir / RESULTS_FILE).read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        steps = None
    checkpoints = complete_checkpoints(output_dir)
    if isinstance(steps, int) and checkpoints and checkpoint_step(checkpoints[-1]) > steps:
        return None
    further = (
        f"; to train it further pass --resume_from_checkpoint {checkpoints[-1]} with a larger --max_train_steps"
        if checkpoints
        else ""
    )
    counted = f", {steps} steps" if isinstance(steps, int) else ""
    return (
        f"{output_dir} holds a finished run ({RESULTS_FILE}{counted}): nothing left to train{further}; "
        "to start over, pass --overwrite_output_dir instead of --resume_from_checkpoint"
    )


def _start_over(output_dir: Path) -> None:
    """--overwrite_output_dir: delete what this project's runs wrote, named exactly as they name it:
    checkpoint-<step>/ and its temporary forms, results.json, the weights and tokenizer files save_model
    listed, temporary files. Everything else (a user's best-checkpoint/, notes, tracker logs) stays."""
    if not output_dir.is_dir():
        return
    names = {RESULTS_FILE, MODEL_FILES, *TMP_FILES, *model_files(output_dir)}
    folders = sorted((p for p in output_dir.iterdir() if _ours(p)), key=checkpoint_step)
    files = sorted(p for p in output_dir.iterdir() if p.name in names and (p.is_file() or p.name in TMP_FILES))
    if not folders and not files:
        return
    logger.warning(f"--overwrite_output_dir: deleting the earlier run's {', '.join(p.name for p in folders + files)}")
    for path in sorted(folders + files, key=lambda p: p.name != RESULTS_FILE):  # results.json first: not finished
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _check_writable(accelerator, output_dir: Path) -> None:
    """Every process writes and removes a file in output_dir (or, before the run has created it,
    in the nearest folder above it that exists); all of them agree on the outcome."""
    problem = None
    if output_dir.exists() and not output_dir.is_dir():
        problem = "it is a file"
    else:
        try:
            # A file without a name (O_TMPFILE; elsewhere unlinked as soon as it is created): a process
            # stopped here, before it records stop signals, leaves nothing in the folder.
            with tempfile.TemporaryFile(dir=nearest_existing(output_dir)) as probe:
                probe.write(b"ok")
                probe.flush()
        except OSError as err:
            problem = one_line(err)
    flag = torch.tensor([problem is not None], device=accelerator.device, dtype=torch.int32)
    failed = int(accelerator.reduce(flag, reduction="sum").item())
    if failed:
        raise RecipeError(_unwritable(output_dir, problem or f"{failed} process(es) on other nodes cannot"))


def _unwritable(output_dir: Path, detail: str) -> str:
    return (
        f"cannot write to --output_dir {output_dir} ({detail}); pass a folder this job can write to, "
        "on a filesystem every node sees"
    )


def _key(output_dir: Path) -> str:
    return str(Path(output_dir).resolve())


class _RunLock:
    """An exclusive fcntl (POSIX) lock on <output_dir>/.run.lock, taken by the main process before
    it looks at the folder and held until it exits. The kernel releases it when the process ends,
    however it ends, so a killed run leaves no stale lock; fcntl locks hold across the nodes of an
    NFS mount. The file records who holds it (pid, host, Slurm job, start), for the message a second
    run gets. Forked DataLoader workers do not inherit fcntl locks, and nothing else in the process
    opens the file (closing any descriptor of it would drop the lock).

    A refused run leaves the folder as it found it (the lock file and the folders it created
    removed, or the file's earlier content put back); a run that went on removes the lock file at
    exit. Whoever locks the file checks afterwards that it is still the one at that path, since its
    holder may have removed it in between."""

    held: dict = {}
    warned = False

    def __init__(self, output_dir: Path):
        self.output_dir, self.path = output_dir, output_dir / LOCK_FILE
        self.fd, self.original, self.created_dirs, self.proceeded, self.pid = None, None, [], False, os.getpid()

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
                missing = [p for p in [self.output_dir, *self.output_dir.parents] if not p.exists()]
                for folder in reversed(missing):
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
            try:
                if fcntl is None:
                    raise OSError(errno.ENOSYS, "no fcntl on this platform")
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                held = err.errno in (errno.EACCES, errno.EAGAIN)
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() if held else ""
                os.close(fd)
                if created and not held:
                    self.path.unlink(missing_ok=True)
                if held:
                    raise RecipeError(
                        f"--output_dir {self.output_dir} is in use by another run "
                        f"({holder or 'it has not said who'}); wait for it to end, or pass another --output_dir"
                    ) from err
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
            try:
                same = os.stat(self.path)[1:3] == os.fstat(fd)[1:3]  # (inode, device): still the file at the path
            except OSError:
                same = False
            if not same:
                os.close(fd)
                continue
            self.fd, self.original = fd, None if created else os.pread(fd, 1 << 16, 0)
            job = f", Slurm job {os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else ""
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            try:
                self._write(f"pid {os.getpid()} on {socket.gethostname()}{job}, started {started}\n".encode())
            except OSError as err:
                raise RecipeError(_unwritable(self.output_dir, one_line(err))) from err
            return
        raise RecipeError(f"could not lock --output_dir {self.output_dir}: its lock file kept being replaced")

    def _write(self, data: bytes) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)  # another node reads it over NFS

    def release(self) -> None:
        if self.pid != os.getpid():  # a forked child inherited the object, not the lock
            return
        if self.fd is not None:
            try:
                if self.original is None or self.proceeded:
                    self.path.unlink()  # while still locked: a run waiting on this file sees it replaced
                else:
                    self._write(self.original)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
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
