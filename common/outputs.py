"""One run per --output_dir, and a run writes only what it owns: it claims the folder before it does any work
there, never mixes its checkpoints or weights with another run's, never writes over files no run of these
recipes wrote (a pretrained model's folder, say), and deletes only what runs wrote.

    .run.lock   locked by the run writing here, which says who it is in it; removed when that run ends
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import psutil  # accelerate's dependency
from accelerate.utils import gather_object

from .card import launch_record, write_card
from .checkpoint import (
    CHECKPOINT_RE,
    HASH,
    MERGED,
    MODEL_FILES,
    RESULTS_FILE,
    RUN_FOLDER_RE,
    STATE_FILE,
    apply_umask,
    complete_checkpoints,
    load_checkpoint,
    model_files,
    nearest_existing,
    read_state,
    remove_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    save_model,
    saved_at,
    start_anew,
    step_of,
    universal_load_if_resharded,
    write_json,
)
from .metrics import tracker_config, write_results
from .preemption import stop_signals_held
from .runtime import RecipeError, RunFinished, decide_on_main, logger, one_line
from .samples import SAMPLES_FILE, samples_written_by_a_run

LOCK_FILE = ".run.lock"
# Files a final save writes: where one is there and no run of ours recorded writing it, the folder holds a model
# of someone else's (save_pretrained's names, ours, peft's).
MODEL_NAMES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "config.json", "generation_config.json",
    "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "fp32", MERGED,
)  # fmt: skip
# of an interrupted final save (zero.py's fp32 export too), or of a ZeRO checkpoint's conversion to another layout
TMP_FILES = (".tmp-model", ".tmp-zero-shards", f".{RESULTS_FILE}.tmp", f".{MODEL_FILES}.tmp")


# The options the recipes read files from (a copy's own: add it here), which --output_dir is kept apart from
INPUTS = ("data_dir", "train_dir", "val_dir", "pretrained_path", "model_name_or_path", "config_name", "tokenizer_name",
          "dataset_name", "train_file", "validation_file", "prepared_data_dir")  # fmt: skip


class OutputDir:
    """--output_dir, claimed for this run before any work there, and what the run writes there. An earlier run there
    is refused unless this one continues it or passes --overwrite_output_dir; `latest` on a finished run raises
    RunFinished (a requeued job ends, exit 0); a restart under --max_restarts resumes `latest`. Every process proves
    it can write there now, not hours in. `resume_from`: the checkpoint this run continues, or None."""

    def __init__(self, accelerator, args):
        self.accelerator, self.args = accelerator, args
        output_dir, spec, overwrite = Path(args.output_dir), args.resume_from_checkpoint, args.overwrite_output_dir
        _check_apart_from_inputs(args, output_dir)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # else as the first attempt began; decided on the main process alone (NFS shows files late)
        if restarts > 0 and (not spec or decide_on_main(accelerator, lambda: _saved_by_this_job(output_dir))):
            logger.warning(f"restart {restarts} of this job (--max_restarts): resuming from the latest checkpoint")
            spec, overwrite = "latest", False  # the first attempt's own: it started over, or from `spec`, already
        _check_writable(output_dir)
        decide_on_main(accelerator, lambda: _claim(output_dir, spec, overwrite))
        self.resume_from = resolve_checkpoint(output_dir, spec, accelerator=accelerator)
        if self.resume_from and (theirs := read_state(self.resume_from).get("recipe", args.recipe)) != args.recipe:
            raise RecipeError(  # first: what another recipe wrote differs in data, model and settings too
                f"checkpoint {self.resume_from} was written by recipes/{theirs}.py, this is recipes/{args.recipe}.py",
                f"resume it with that recipe, or {start_anew(self.resume_from, output_dir)}",
                subject=str(self.resume_from),
            )
        decide_on_main(accelerator, lambda: _begin(output_dir, overwrite))
        accelerator.init_trackers(args.recipe, config=tracker_config(args))
        universal_load_if_resharded(accelerator, self.resume_from)  # before the engine is built

    def load_checkpoint(self, model, optimizer) -> dict:
        return load_checkpoint(self.accelerator, self.resume_from, model, optimizer, self.args)

    def save_checkpoint(self, model, plan, position, log, optimizer=None) -> Path:
        return save_checkpoint(self.accelerator, model, self.args, plan, position, log, optimizer)

    def save_model(self, model, tokenizer=None) -> Path:
        return save_model(self.accelerator, model, self.args.output_dir, tokenizer)

    def write_results(self, plan, **metrics) -> Path:
        """results.json, then the model card and its pictures from it (common.card), recorded as the run's files."""
        launch = launch_record(self.accelerator, self.args)
        path = write_results(self.accelerator, self.args, plan, **metrics, launch=launch)
        written = decide_on_main(
            self.accelerator, lambda: write_card(self.args.output_dir, json.loads(path.read_text()))
        )
        self.record_written(*written)
        return path

    def record_written(self, *names) -> None:
        """Files or folders the run wrote beside its weights (zero.py's fp32/), recorded with save_model's: the next
        save or --overwrite_output_dir removes them. Readable as the user's umask says, as all a run writes."""
        if self.accelerator.is_main_process:
            output_dir = Path(self.args.output_dir)
            for name in names:
                apply_umask(output_dir / name)
            write_json(output_dir / MODEL_FILES, {"files": sorted({*model_files(output_dir), *names})})


def _saved_by_this_job(output_dir: Path) -> bool:
    """Whether a checkpoint in output_dir was saved since torch's agent, this process's parent through every restart,
    started the job (not one of an earlier run's, newer than the one the job began from)."""
    began = psutil.Process(os.getppid()).create_time()
    return any(saved_at(path) >= began for path in complete_checkpoints(output_dir))


def _a_checkpoint_in(folder: Path, which: str) -> str:
    """The newest complete checkpoint in `folder` (a run's), as a fix names it, or what to pass instead."""
    newest = complete_checkpoints(folder)[-1:]
    return f"{which}, {newest[0]}" if newest else "a checkpoint-<step> folder written by a recipe"


def _claim(output_dir: Path, spec: str | None, overwrite: bool) -> None:
    """On the main process: lock output_dir, refuse what would mix or overwrite runs."""
    path = None if spec in (None, "latest") else Path(spec)
    if path is not None and not path.exists():
        hint = " (did you mean latest?)" if spec.strip().lower() == "latest" else ""
        raise RecipeError(
            f"--resume_from_checkpoint {spec}: no such file or directory{hint}", "check the path",
            subject="--resume_from_checkpoint",
        )  # fmt: skip
    if path is not None and path.is_file():  # a file of a checkpoint, or of a run's folder, or neither
        folder = path.parent if (path.parent / STATE_FILE).is_file() else None
        fix = (
            f"the checkpoint folder it is in, {folder}"
            if folder
            else _a_checkpoint_in(path.parent, "the newest checkpoint beside it")
        )
        raise RecipeError(
            f"--resume_from_checkpoint {spec} is a file, not a checkpoint folder: pass {fix}",
            subject="--resume_from_checkpoint",
        )
    if path is not None and not (path / STATE_FILE).is_file():  # the run's folder itself, say
        latest = "" if not complete_checkpoints(path) else ", or `latest`"
        if latest and path.resolve() != output_dir.resolve():  # latest means --output_dir's newest, not this one's
            latest += f" with --output_dir {path} to continue that run in its folder"
        raise RecipeError(
            f"--resume_from_checkpoint {spec}: not a complete checkpoint (no {STATE_FILE})",
            f"pass {_a_checkpoint_in(path, 'its newest')}{latest}",
            subject="--resume_from_checkpoint",
        )
    if CHECKPOINT_RE.fullmatch(output_dir.name) and (output_dir / STATE_FILE).is_file():  # a run's, not a run
        raise RecipeError(
            f"--output_dir {output_dir} is a checkpoint of the run in {output_dir.parent}",
            f"pass --output_dir {output_dir.parent} (with --resume_from_checkpoint latest to continue it), or another "
            "folder",
            subject="--output_dir",
        )
    continuing = spec == "latest" or (path is not None and path.resolve().parent == output_dir.resolve())
    if overwrite and continuing:
        raise RecipeError(
            f"--overwrite_output_dir starts over and --resume_from_checkpoint {spec} continues the run in "
            f"{output_dir}: pass one of them",
            subject="--overwrite_output_dir",
        )
    lock = _RunLock.held.get(output_dir.resolve()) or _RunLock(output_dir)
    try:
        lock.acquire()
        ours, previous = model_files(output_dir), _run_outputs(output_dir)
        foreign = [n for n in MODEL_NAMES if (output_dir / n).exists() and n not in ours]
        foreign += [f"{p.name} ({why})" for p in previous if (why := _not_ours(p))]  # another trainer's, a user's
        if foreign:  # a pretrained model's own folder, say: --overwrite_output_dir deletes only what runs wrote
            raise RecipeError(
                f"--output_dir {output_dir} holds files that no run of these recipes wrote ({', '.join(foreign[:4])}),"
                " which a run would write over or delete",
                "move them out of it, or pass another --output_dir",
                subject="--output_dir",
            )
        if spec == "latest" and (finished := _finished(output_dir)):
            raise RunFinished(finished)
        if previous and not (continuing or overwrite):
            if spec:
                why = f" and --resume_from_checkpoint {spec} is another folder's checkpoint"
                fix = "pass --overwrite_output_dir to start over there from it, or another --output_dir"
            elif _finished(output_dir):  # latest would end at once: nothing is left to continue
                further = f"{further} to train it further, " if (further := _train_further(output_dir)) else "pass "
                why, fix = (
                    ", which finished",
                    f"{further}--overwrite_output_dir to start over, or another --output_dir",
                )
            else:
                why = ""
                fix = (
                    "pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to start over, or "
                    "another --output_dir"
                )
            names = ", ".join(p.name for p in previous[:4])
            raise RecipeError(
                f"--output_dir {output_dir} already holds a run ({names}){why}", fix, subject="--output_dir"
            )
    except BaseException:
        lock.release()
        raise


def _begin(output_dir: Path, overwrite: bool) -> None:
    """On the main process, once nothing can refuse the run: it owns the folder now."""
    _RunLock.held[output_dir.resolve()].proceed()
    if overwrite:
        _start_over(output_dir)


def _run_outputs(output_dir: Path) -> list:
    """What runs wrote in output_dir (its lock aside), checkpoints first: checkpoint folders (a complete one's
    marker lists its files), a save's temporary forms, results.json, samples.jsonl and what save_model recorded."""
    names = {RESULTS_FILE, MODEL_FILES, SAMPLES_FILE, f".{SAMPLES_FILE}.tmp", *TMP_FILES, *model_files(output_dir)}
    found = [p for p in output_dir.iterdir() if p.name in names or (p.is_dir() and RUN_FOLDER_RE.fullmatch(p.name))]
    return sorted(found, key=lambda p: (p.name.startswith("."), not CHECKPOINT_RE.fullmatch(p.name), p.name))


def _not_ours(path: Path) -> str | None:
    """Why results.json, samples.jsonl or a checkpoint-<step> folder with a trainer_state.json is not a run's (None:
    it is): its record lacks what only a recipe writes (the library versions; the checksums; a sample's fields), or a
    link leads elsewhere. A checkpoint whose record does not read at all is a run's, damaged (a copy cut short):
    resuming passes it over, and nothing deletes it (which files are a run's, its record no longer says). Anything
    else _run_outputs lists is a save's temporary form or a checkpoint cut short, named as only our saves name them."""
    checkpoint = CHECKPOINT_RE.fullmatch(path.name)
    record, key = (path / STATE_FILE, HASH) if checkpoint else (path, "versions")
    if path.is_symlink():  # what a run deletes or replaces there would be another folder's
        return "a symbolic link"
    if path.name == SAMPLES_FILE:
        return None if samples_written_by_a_run(path) else "not the rows a run's samples are"
    if path.name != RESULTS_FILE and not (checkpoint and record.is_file()):
        return None
    try:
        return None if key in json.loads(record.read_text()) else f"no {key} in {record.name}: another program's"
    except (OSError, ValueError, TypeError) as err:
        if checkpoint:  # a run's checkpoint a copy cut short or a disk damaged: `latest` passes it over, saying so
            return None
        return f"its {record.name} is unreadable: {one_line(err)}"


def _finished(output_dir: Path) -> str | None:
    """Why output_dir holds a finished run (results.json, written last, and no checkpoint saved after it by the
    times each records: a copy's file times are the copy's), or None."""
    results, checkpoints = output_dir / RESULTS_FILE, complete_checkpoints(output_dir)
    if not results.is_file():
        return None
    record = json.loads(results.read_text())  # a run's (_claim refused another's)
    if checkpoints and saved_at(checkpoints[-1]) > record.get("finished_at", results.stat().st_mtime):
        return None
    steps, further = f", {record['steps']} steps" if "steps" in record else "", _train_further(output_dir)
    return (
        f"{output_dir} holds a finished run ({RESULTS_FILE}{steps}): nothing left to train"
        f"{'; to train it further ' + further if further else ''}; to start over, pass --overwrite_output_dir instead"
        " of --resume_from_checkpoint"
    )


def _train_further(output_dir: Path) -> str:
    """How to train a finished run further: resume its newest checkpoint with a longer run ("" if it saved none)."""
    checkpoints = complete_checkpoints(output_dir)
    if not checkpoints:
        return ""
    record = json.loads((output_dir / RESULTS_FILE).read_text())
    step, last = step_of(checkpoints[-1]), record.get("steps", 0)
    again = f" (step {step} of {last}: the steps after it train again)" if step < last else ""
    longer = "--max_train_steps" + ("" if record.get("args", {}).get("streaming") else " or --num_train_epochs")
    return f"pass --resume_from_checkpoint {checkpoints[-1]}{again} with a larger {longer}"


def _start_over(output_dir: Path) -> None:
    """--overwrite_output_dir: delete what runs wrote; a user's files, even inside a checkpoint or in a checkpoint
    folder without a marker, stay."""
    found = [p for p in _run_outputs(output_dir) if not CHECKPOINT_RE.fullmatch(p.name) or (p / STATE_FILE).is_file()]
    if found:
        logger.warning(f"--overwrite_output_dir: deleting the earlier run's {', '.join(p.name for p in found)}")
    for path in sorted(found, key=lambda p: p.name != RESULTS_FILE):  # results.json first: no longer finished
        if CHECKPOINT_RE.fullmatch(path.name):
            remove_checkpoint(path)
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _check_apart_from_inputs(args, output_dir: Path) -> None:
    """What the run reads (INPUTS) and where it writes, apart: neither inside the other."""
    unused = getattr(args, "unused_arguments", ())  # of its parse; arguments made by hand (a test's) had none
    for name in INPUTS:
        if name in unused or not isinstance(value := getattr(args, name, None), str) or not value:
            continue
        path, out = Path(value).resolve(), output_dir.resolve()
        if path.is_dir() and out.is_relative_to(path):
            raise RecipeError(
                f"--output_dir {output_dir} {'is' if out == path else 'lies inside'} --{name} {value}, which the "
                "run reads: what it writes there would become part of its input, or replace it",
                "pass an --output_dir outside it",
                subject="--output_dir",
            )
        if path.exists() and path.is_relative_to(out):  # an earlier run's model, say
            raise RecipeError(
                f"--{name} {value} lies inside --output_dir {output_dir}, where the run saves, and which "
                "--overwrite_output_dir empties of runs' files: it could replace or delete what it reads",
                "pass an --output_dir apart from the run's inputs",
                subject=f"--{name}",
            )


def _check_writable(output_dir: Path) -> None:
    """Every process creates a nameless file (O_TMPFILE: a process stopped here leaves nothing) in output_dir, or the
    nearest folder above it it sees (a first run creates it; NFS may show another node's new folder seconds late);
    all agree."""
    problem, base = None, nearest_existing(output_dir)
    try:
        tempfile.TemporaryFile(dir=base).close()
    except OSError as err:
        problem = f"{base} is a file" if base.is_file() else one_line(err)
    if problems := [p for p in gather_object([problem]) if p]:
        raise RecipeError(
            f"cannot write to --output_dir {output_dir} ({problem or f'another process: {problems[0]}'})",
            "pass a folder this job can write to, on a filesystem every node sees",
            subject="--output_dir",
        )


class _RunLock:
    """An fcntl lock on <output_dir>/.run.lock, held by the main process until it exits: the kernel releases it
    however the process ends (no stale lock), and it holds across NFS nodes. The file is removed only by the
    process locking it, and a refused run removes it only if it found none. Nothing else in the process may open
    the file: closing any descriptor of it drops the lock."""

    held: dict = {}  # resolved output_dir: its lock, released at exit

    def __init__(self, output_dir: Path):
        self.key, self.path, self.pid = output_dir.resolve(), output_dir / LOCK_FILE, os.getpid()
        self.fd, self.proceeded = None, False
        self.made = [p for p in (output_dir, *output_dir.parents) if not p.exists()]  # deepest first

    def acquire(self) -> None:
        """Locked, or refused naming the run that holds it; unguarded, with a warning, where the filesystem has no
        locks. On failure the caller releases it."""
        if self.key in _RunLock.held:  # this process holds it already (a second OutputDir)
            return
        if not _RunLock.held:
            atexit.register(_RunLock.release_all)
        _RunLock.held[self.key] = self
        with stop_signals_held():  # a stop between the file's creation and its lock would leave the file behind
            self._acquire()

    def _acquire(self) -> None:
        for _ in range(50):  # the file was removed between our open and our lock (its holder ended): again
            self.path.parent.mkdir(parents=True, exist_ok=True)  # _check_writable found it can
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self.path.exists() and os.stat(self.path)[1:3] == os.fstat(fd)[1:3]:  # (inode, device)
                    self.fd = fd
                    return
            except OSError as err:
                if err.errno in (errno.EACCES, errno.EAGAIN):
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "it has not said who"
                    raise RecipeError(
                        f"--output_dir {self.path.parent} is in use by another run ({holder})",
                        "wait for it to end, or pass another --output_dir",
                        subject="--output_dir",
                    ) from err
                if err.errno != errno.ESTALE:  # not NFS's "removed on another node": no locks on this filesystem
                    logger.warning(
                        f"cannot lock --output_dir {self.path.parent} on this filesystem ({one_line(err)}): a second "
                        "run started into it would not be stopped"
                    )
                    if not os.fstat(fd).st_size:  # created by this run
                        self.path.unlink(missing_ok=True)
                    return
            finally:
                if self.fd != fd:
                    os.close(fd)
        raise RecipeError(
            f"could not lock --output_dir {self.path.parent}: its lock file kept being replaced",
            subject="--output_dir",
        )

    def proceed(self) -> None:
        """The run goes on: the file now says who holds it (another node reads it over NFS: fsync)."""
        self.proceeded = True
        if self.fd is not None:
            job = f", Slurm job {os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else ""
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}{job}, started {started}\n".encode(), 0)
            os.fsync(self.fd)

    def release(self) -> None:
        """Unlocked; the lock file removed unless a refused run found it there, and the folders this run made if
        nothing was written in them."""
        if self.pid != os.getpid():  # a forked child inherited the object, not the lock
            return
        if self.fd is not None:
            if self.proceeded or not os.fstat(self.fd).st_size:  # removed while locked: see acquire's inode check
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:
                break
        self.made = []
        _RunLock.held.pop(self.key, None)

    @classmethod
    def release_all(cls) -> None:
        for lock in list(cls.held.values()):
            lock.release()
