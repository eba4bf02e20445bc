"""Checkpoints that are either complete or absent, an --output_dir written by one run at a time,
and final weights that load anywhere.

Layout in `--output_dir`:
    checkpoint-<step>/      accelerator.save_state + trainer_state.json (written last: the marker
                            of a complete checkpoint, with the size and sha256 of every file in it)
    .tmp-checkpoint-<step>/ a save in progress; never picked by `latest`
    .old-checkpoint-<step>/ a checkpoint that a complete new save of the same step is replacing
    model.safetensors       final weights (or save_pretrained files for transformers models); the
                            names of the files written are kept in .model-files.json
    results.json            the run's record (metrics.py), written last: the run has finished
    .run.lock               locked by the run writing here; present while it runs (or after a kill)
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from safetensors.torch import save_file

from .runtime import RecipeError, RunFinished, library_versions, logger, one_line

try:
    import fcntl
except ImportError:  # Windows: no fcntl locks; runs go unguarded, with a warning
    fcntl = None

CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
TMP_CHECKPOINT_RE = re.compile(r"\.tmp-checkpoint-(\d+)")
OLD_CHECKPOINT_RE = re.compile(r"\.old-checkpoint-(\d+)")
STATE_FILE = "trainer_state.json"
RESULTS_FILE = "results.json"
LOCK_FILE = ".run.lock"
MODEL_FILES = ".model-files.json"
# The files that show --output_dir holds a run (with its checkpoint folders); save_pretrained's included.
RUN_FILES = (RESULTS_FILE, "model.safetensors", "config.json", "adapter_config.json")
# Temporary files of an interrupted final save (save_model, write_json).
TMP_FILES = (".tmp-model", ".model.safetensors.tmp", f".{RESULTS_FILE}.tmp", f".{MODEL_FILES}.tmp")
# sha256 over blake2b: 1.4 against 0.95 GB/s on one core of an x86 CPU with SHA extensions.
HASH = "sha256"
# Filesystems without working locks (Lustre mounted without -o flock, some FUSE and SMB mounts).
UNSUPPORTED_LOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def write_json(path: Path, data: dict) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no stray temporary file
        raise


# Across processes ---------------------------------------------------------------------------------


def _distributed(accelerator) -> bool:
    return accelerator is not None and accelerator.num_processes > 1


def _all_gather(accelerator, obj) -> list:
    """`obj` of every process, in process order."""
    return gather_object([obj]) if _distributed(accelerator) else [obj]


def _from_main(accelerator, fn):
    """Run `fn` on the main process alone; every process returns its result or raises its
    RecipeError or RunFinished (printed once, by the main process). Decisions about --output_dir
    are taken once, so no two processes see the folder at different moments."""
    if not _distributed(accelerator):
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


def _rank_and_world(accelerator) -> tuple[int, int]:
    return (accelerator.process_index, accelerator.num_processes) if _distributed(accelerator) else (0, 1)


# Checksums ---------------------------------------------------------------------------------------


def _digest(path: Path) -> str:
    h = hashlib.new(HASH)
    buffer = bytearray(1 << 23)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _share(files: dict, rank: int, world: int) -> list:
    """The files (name: size) process `rank` hashes: the largest first, each to the least loaded
    process, so that a checkpoint of many shards is hashed by all processes at once and none of
    them waits in a collective long enough to reach the process-group timeout."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        i = loads.index(min(loads))
        shares[i].append(name)
        loads[i] += size
    return shares[rank]


def _file_sizes(folder: Path) -> dict:
    return {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}


def _size_damage(path: Path) -> tuple:
    """(why the checkpoint at `path` is damaged or None, its files' sizes, their checksums)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        files, digests = dict(state.get("files", {})), dict(state.get(HASH, {}))
    except (OSError, ValueError, TypeError, AttributeError) as err:
        return f"{STATE_FILE} is unreadable ({one_line(err)})", {}, {}
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing", files, digests
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written", files, digests
    return None, files, digests


def checkpoint_damage(path, accelerator=None, checksums: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None: its marker and every file it lists
    must be there with the size it was written with (a cheap first pass) and, with `checksums`,
    the same sha256 (bytes altered in place, a bad disk or copy). With `accelerator`, every
    process must call it: they hash a share of the files each."""
    path = Path(path)
    problem, files, digests = _from_main(accelerator, lambda: _size_damage(path))
    if problem or not checksums or not digests:
        return problem
    bad = []
    for name in _share({name: files.get(name, 0) for name in digests}, *_rank_and_world(accelerator)):
        try:
            if _digest(path / name) != digests[name]:
                bad.append(name)
        except OSError:
            bad.append(name)
    bad = sorted(set(itertools.chain.from_iterable(_all_gather(accelerator, bad))))
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
    return f"{bad[0]}{more} does not match the {HASH} written with the checkpoint"


# Saving ------------------------------------------------------------------------------------------


def save_checkpoint(accelerator, output_dir, step: int, state: dict, total_limit: int | None = None) -> Path:
    """Save the full training state (model, optimizer, scheduler, RNG, sampler) at `step`, with
    `state` (the data position, the run's settings), the library versions and every file's size
    and sha256 in trainer_state.json.

    Every process writes its part into a temporary folder; the processes hash the files (a share
    each); the main process adds `trainer_state.json` and renames the folder to checkpoint-<step>.
    A crash at any point leaves either a complete checkpoint or a temporary folder that `latest`
    ignores (see `_finish_interrupted_saves` for the one case in between). A complete new save
    replaces an existing checkpoint-<step>: a damaged one must go, and an intact one of the same
    step belongs to an earlier trajectory (a run resumed from an older checkpoint by path), which
    this run's later checkpoints and final weights no longer continue.

    `total_limit` keeps that many of the newest intact checkpoints (and always this one), deleting
    older ones only once this one is complete. A write that fails on any process (a full disk)
    fails on all of them, with one line saying how much space a checkpoint needs; the temporary
    folder is removed and the checkpoints already saved stay as they were.
    Assumes `output_dir` is on a filesystem every node sees, as checkpoints of multi-node jobs must be.
    """
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
    accelerator.wait_for_everyone()
    settle = _Settle(
        accelerator, output_dir, f"checkpoint {final}", tmp, needed=lambda: _checkpoint_bytes(accelerator, output_dir)
    )
    with settle.attempt():
        accelerator.save_state(str(tmp))
    settle()
    files = _from_main(accelerator, lambda: _file_sizes(tmp))
    digests = {}
    with settle.attempt():
        digests = {name: _digest(tmp / name) for name in _share(files, *_rank_and_world(accelerator))}
    digests = {k: v for part in settle(digests) for k, v in part.items()}
    if accelerator.is_main_process:
        with settle.attempt():
            write_json(
                tmp / STATE_FILE,
                {"step": step, **state, "files": files, HASH: digests, "versions": library_versions()},
            )
            _install(tmp, final)
    settle()
    if accelerator.is_main_process:
        logger.info(f"saved checkpoint {final}")
        if total_limit:
            _prune(output_dir, final, total_limit)
    accelerator.wait_for_everyone()
    return final


def _install(tmp: Path, final: Path) -> None:
    """Rename the complete save `tmp` to `final`, replacing what is there. Between the two renames
    a crash leaves the new save complete in `tmp`: _finish_interrupted_saves completes it."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        logger.info(f"replaced the earlier {final.name} with this run's")
    else:
        os.replace(tmp, final)


def _step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def _prune(output_dir: Path, final: Path, total_limit: int) -> None:
    """--save_total_limit: keep the newest `total_limit` intact checkpoints and the one just
    written; delete complete checkpoints older than it that are not kept. Damaged ones (sizes only:
    a full checksum pass at every save would cost too much) never count towards the limit."""
    intact = [p for p in complete_checkpoints(output_dir) if p == final or not checkpoint_damage(p, checksums=False)]
    keep = set(intact[-total_limit:]) | {final}
    for old in complete_checkpoints(output_dir):
        if old not in keep and _step(old) < _step(final):
            shutil.rmtree(old, ignore_errors=True)
            logger.info(f"deleted {old} (--save_total_limit {total_limit})")


class _Settle:
    """Agreement on a write that every process takes part in: each process records its failure
    (`with settle.attempt(): ...`), then `settle(payload)` all-gathers the failures with the
    payloads, so that either every process goes on or every process raises, none of them left
    waiting in a collective for the others. A failure to write files becomes one error line on
    the main process (how much space the write needs, how much is free, when the disk is full);
    any other exception is re-raised where it happened."""

    def __init__(self, accelerator, output_dir: Path, what: str, tmp: Path | None, needed):
        self.accelerator, self.output_dir, self.what, self.tmp = accelerator, output_dir, what, tmp
        self.needed = needed
        self.failure = self.error = None

    @contextlib.contextmanager
    def attempt(self):
        try:
            yield
        except Exception as err:
            self.failure = _write_failure(err) or ("bug", one_line(err))
            # Kept only to re-raise: the frames of a failed write hold its open file, whose space
            # a full disk would not get back before the error line measures it.
            self.error = err if self.failure[0] == "bug" else None

    def __call__(self, payload=None) -> list:
        everyone = _all_gather(self.accelerator, (self.failure, payload))
        failures = [(rank, failure) for rank, (failure, _) in enumerate(everyone) if failure]
        if not failures:
            return [p for _, p in everyone]
        if self.accelerator.is_main_process and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)  # no half-written folder stays behind
        if self.failure and self.failure[0] == "bug":
            raise self.error  # not a write failure: a bug, with its traceback
        raise self._message(failures)

    def _message(self, failures) -> RecipeError:
        rank, (kind, text) = failures[0]
        if kind == "recipe":
            return RecipeError(text)
        free = _free_bytes(self.output_dir)
        try:
            needed = self.needed()
        except Exception:  # an estimate must not hide the error it explains
            needed = None
        short = kind == "io" and needed and free is not None and free < needed
        if short or any(k == "space" for _, (k, _) in failures):
            need = f"it needs about {_human(needed)}" if needed else "more space is needed"
            have = f", {_human(free)} free" if free is not None else ""
            return RecipeError(
                f"no space left on the filesystem of {self.output_dir} to save the {self.what}: "
                f"{need}{have}; free space there or pass another --output_dir "
                "(the checkpoints already saved are intact)"
            )
        where = f" on process {rank}" if _distributed(self.accelerator) else ""
        return RecipeError(f"could not save the {self.what}{where}: {text}; the checkpoints already saved are intact")


def _write_failure(err: BaseException) -> tuple | None:
    """("space" | "io" | "recipe", text) for an error writing files, None for any other error.
    torch.save reports a full disk without an errno ("unexpected pos ..."): the free space decides."""
    if isinstance(err, RecipeError):
        return "recipe", str(err)
    chain, seen = [], err
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(e) for e in chain)
    if any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in chain) or re.search(
        r"No space left|os error 28|[Qq]uota exceeded|os error 122", text
    ):
        return "space", one_line(err)
    if (
        any(isinstance(e, OSError) for e in chain)
        or type(err).__name__ == "SafetensorError"
        or re.search(r"PytorchStreamWriter|inline_container|iostream|file write failed", text)
    ):
        return "io", one_line(err)
    return None


def _free_bytes(folder: Path) -> int | None:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _checkpoint_bytes(accelerator, output_dir: Path) -> int:
    """What a checkpoint takes: the newest complete one's files, or else the model and optimizer
    state in memory (an estimate: ZeRO's optimizer shards are counted on one process times the
    process count)."""
    for path in reversed(complete_checkpoints(output_dir)):
        _, files, _ = _size_damage(path)
        if files:
            return sum(files.values()) + (path / STATE_FILE).stat().st_size
    total = 0
    for model in accelerator._models:
        for t in itertools.chain(model.parameters(), model.buffers()):
            total += getattr(t, "ds_numel", t.numel()) * t.element_size()
    for optimizer in accelerator._optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)
        states = getattr(inner, "state", None)
        tensors = [
            v
            for s in (states.values() if isinstance(states, dict) else ())
            if isinstance(s, dict)
            for v in s.values()
            if torch.is_tensor(v)
        ]
        shards = accelerator.num_processes if accelerator.state.deepspeed_plugin is not None else 1
        total += shards * sum(t.numel() * t.element_size() for t in tensors)
    return total


def complete_checkpoints(output_dir) -> list:
    """The checkpoint-<step> folders with their marker, oldest first."""
    output_dir = Path(output_dir)
    found = [
        p for p in output_dir.glob("checkpoint-*") if CHECKPOINT_RE.fullmatch(p.name) and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=_step)


# Resuming ----------------------------------------------------------------------------------------


def resolve_checkpoint(output_dir, spec: str | None, accelerator=None) -> Path | None:
    """`--resume_from_checkpoint`: None, `latest` (the newest complete, intact checkpoint in
    output_dir, or None with a warning when there is none yet, so a requeued job can always pass
    it), or a path, refused by name when it is incomplete or damaged. Intact: every file with the
    size and the checksum it was written with. With `accelerator`, every process must call it
    (they share the hashing)."""
    if not spec:
        return None
    if spec != "latest":
        path = Path(spec)
        if not _from_main(accelerator, lambda: (path / STATE_FILE).is_file()):
            raise RecipeError(_not_a_checkpoint(spec))
        damage = checkpoint_damage(path, accelerator)
        if damage:
            raise RecipeError(
                f"--resume_from_checkpoint {spec}: the checkpoint is damaged: {damage}; "
                f"pass an older checkpoint-<step> folder, or `latest` to pick the newest intact one"
            )
        return path
    damaged = 0
    for path in _from_main(accelerator, lambda: _latest_candidates(Path(output_dir))):
        damage = checkpoint_damage(path, accelerator)
        if not damage:
            return path
        logger.warning(f"ignoring damaged checkpoint {path}: {damage}")
        damaged += 1
    what = f"no intact checkpoint ({damaged} damaged)" if damaged else "no checkpoint yet"
    logger.warning(f"--resume_from_checkpoint latest: {what} in {output_dir}, starting at step 0")
    return None


def _not_a_checkpoint(spec: str) -> str:
    return (
        f"--resume_from_checkpoint {spec}: not a complete checkpoint (no {STATE_FILE}); "
        "pass a checkpoint-<step> folder written by a recipe, or `latest`"
    )


def _latest_candidates(output_dir: Path) -> list:
    """Complete checkpoints, newest first, after a warning about each incomplete one."""
    for path in sorted(output_dir.glob("checkpoint-*")):
        if CHECKPOINT_RE.fullmatch(path.name) and not (path / STATE_FILE).is_file():
            logger.warning(f"ignoring incomplete checkpoint {path} (no {STATE_FILE})")
    return list(reversed(complete_checkpoints(output_dir)))


def prepare_output_dir(accelerator, args) -> Path | None:
    """Claim `--output_dir` for this run before any work is done there, and return the checkpoint
    to resume from (None: a fresh start).

    - The main process locks the folder until it exits (`_RunLock`): a second run started into
      it is refused, naming the first, with nothing changed.
    - A folder holding an earlier run is refused unless the run resumes it (`latest`, or a
      checkpoint of its own) or `--overwrite_output_dir` is passed, which deletes what the earlier
      run wrote (its checkpoints, weights and results.json, nothing else), so that `latest` cannot
      mix two runs: an earlier run's weights are never overwritten by mistake. Resuming another
      folder's checkpoint is a new run here, under the same rule.
    - `latest` on a finished run (results.json, written last, and no newer checkpoint) raises
      RunFinished: a requeued job that already finished ends at once, successfully.
    - A process that restarts under `accelerate launch --max_restarts N` resumes from `latest`.
    - Every process proves it can write there now rather than at the first checkpoint, hours in.
    """
    output_dir, spec = Path(args.output_dir), args.resume_from_checkpoint
    overwrite = bool(getattr(args, "overwrite_output_dir", False))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not spec and restarts > 0:
        logger.warning(f"restart {restarts} of this job (--max_restarts): resuming from the latest checkpoint")
        spec, overwrite = "latest", False  # the first attempt started over already
    continuing = _from_main(accelerator, lambda: _claim(output_dir, spec, overwrite))
    _check_writable(accelerator, output_dir)
    if continuing:
        _from_main(accelerator, lambda: _finish_interrupted_saves(output_dir))
    resume_from = resolve_checkpoint(output_dir, spec, accelerator=accelerator)
    _from_main(accelerator, lambda: _begin(output_dir, overwrite))
    return resume_from


def _claim(output_dir: Path, spec: str | None, overwrite: bool) -> bool:
    """On the main process: lock output_dir, then refuse what would mix or overwrite runs. A
    refused run leaves the folder as it found it. Returns whether the run continues the one there."""
    path = None if spec in (None, "latest") else Path(spec)
    if path is not None and not (path / STATE_FILE).is_file():  # a typo, or the run's folder itself
        raise RecipeError(_not_a_checkpoint(spec))
    inside = path is not None and _inside(path, output_dir)
    if overwrite and spec == "latest":
        raise RecipeError(
            "--overwrite_output_dir starts over and --resume_from_checkpoint latest continues the run "
            f"in {output_dir}: pass one of them"
        )
    if overwrite and inside:
        raise RecipeError(
            f"--overwrite_output_dir would delete {spec}, the checkpoint to resume from: pass one of them"
        )
    held = _key(output_dir) in _RunLock.held
    lock = _RunLock.acquire(output_dir)
    try:
        if spec == "latest":
            finished = _finished(output_dir)
            if finished:
                raise RunFinished(finished)
        elif not inside and not overwrite:
            previous = _run_outputs(output_dir)
            if previous and spec:
                raise RecipeError(
                    f"--output_dir {output_dir} already holds a run ({', '.join(previous[:4])}) and "
                    f"--resume_from_checkpoint {spec} is another folder's checkpoint; pass --overwrite_output_dir to "
                    "start over there from it, or another --output_dir"
                )
            if previous:
                raise RecipeError(
                    f"--output_dir {output_dir} already holds a run ({', '.join(previous[:4])}); pass "
                    "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to start over, "
                    "or another --output_dir"
                )
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


def _inside(path: Path, output_dir: Path) -> bool:
    """Whether `path` is a checkpoint of the run in output_dir (continuing it) or another's."""
    return path.resolve().parent == output_dir.resolve()


def _is_checkpoint_dir(path: Path) -> bool:
    return any(r.fullmatch(path.name) for r in (CHECKPOINT_RE, TMP_CHECKPOINT_RE, OLD_CHECKPOINT_RE)) and path.is_dir()


def _run_outputs(output_dir: Path) -> list:
    """Names in output_dir that a recipe's run wrote there (its lock file aside)."""
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.name in RUN_FILES or _is_checkpoint_dir(p))


def _finished(output_dir: Path) -> str | None:
    """Why output_dir holds a finished run (results.json is written last), or None. A checkpoint
    newer than the finished run's last step means the run was resumed by path to train further,
    and `latest` continues that."""
    results = output_dir / RESULTS_FILE
    if not results.is_file():
        return None
    try:
        steps = json.loads(results.read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        steps = None
    checkpoints = complete_checkpoints(output_dir)
    if isinstance(steps, int) and checkpoints and _step(checkpoints[-1]) > steps:
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


def _finish_interrupted_saves(output_dir: Path) -> None:
    """On the main process, under the lock, when a run continues. A crash inside
    save_checkpoint leaves either an incomplete .tmp-checkpoint-<step> (no marker: deleted) or,
    between the renames that replace a checkpoint, a complete and intact one (renamed into place,
    as the save would have done) and .old-checkpoint-<step> (deleted once checkpoint-<step> is
    there, renamed back otherwise)."""
    if not output_dir.is_dir():
        return
    for tmp in sorted(p for p in output_dir.iterdir() if TMP_CHECKPOINT_RE.fullmatch(p.name) and p.is_dir()):
        final = output_dir / tmp.name.removeprefix(".tmp-")
        if (tmp / STATE_FILE).is_file() and checkpoint_damage(tmp) is None:
            _install(tmp, final)
            logger.warning(f"completed the interrupted save of {final}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            logger.warning(f"deleted {tmp}, a save that did not complete")
    for old in sorted(p for p in output_dir.iterdir() if OLD_CHECKPOINT_RE.fullmatch(p.name) and p.is_dir()):
        final = output_dir / old.name.removeprefix(".old-")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def _model_files(output_dir: Path) -> list:
    """The files the last save_model wrote in output_dir (plain names only)."""
    try:
        names = json.loads((output_dir / MODEL_FILES).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [n for n in names if isinstance(n, str) and n not in ("", ".", "..") and Path(n).name == n]


def _start_over(output_dir: Path) -> None:
    """--overwrite_output_dir: delete what this project's runs wrote, named exactly as they name
    it: checkpoint-<step>/ and its temporary forms, results.json, the weights and tokenizer files
    save_model listed, temporary files. Everything else (a user's best-checkpoint/, notes,
    tracker logs) stays."""
    if not output_dir.is_dir():
        return
    folders = sorted((p for p in output_dir.iterdir() if _is_checkpoint_dir(p)), key=_step)
    names = {RESULTS_FILE, MODEL_FILES, *TMP_FILES, *_model_files(output_dir)}
    files = sorted(p for p in output_dir.iterdir() if p.name in names and (p.is_file() or p.name in TMP_FILES))
    if not folders and not files:
        return
    logger.warning(f"--overwrite_output_dir: deleting the earlier run's {', '.join(p.name for p in folders + files)}")
    for path in [output_dir / RESULTS_FILE, *folders, *files]:  # results.json first: the run is no longer finished
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _check_writable(accelerator, output_dir: Path) -> None:
    """Every process writes and removes a file in output_dir (or, before the run has created it,
    in the nearest folder above it that exists); all of them agree on the outcome."""
    folder = output_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    problem = None
    if output_dir.exists() and not output_dir.is_dir():
        problem = "it is a file"
    else:
        try:
            # A file without a name (O_TMPFILE; elsewhere unlinked as soon as it is created): a process
            # stopped here, before it records stop signals, leaves nothing in the folder.
            with tempfile.TemporaryFile(dir=folder) as probe:
                probe.write(b"ok")
                probe.flush()
        except OSError as err:
            problem = one_line(err)
    flag = torch.tensor([problem is not None], device=accelerator.device, dtype=torch.int32)
    failed = accelerator.reduce(flag, reduction="sum")
    if int(failed.item()):
        detail = problem or f"{int(failed.item())} process(es) on other nodes cannot"
        raise RecipeError(_unwritable(output_dir, detail))


def _unwritable(output_dir: Path, detail: str) -> str:
    return (
        f"cannot write to --output_dir {output_dir} ({detail}); pass a folder this job can write to, "
        "on a filesystem every node sees"
    )


# One run per --output_dir -------------------------------------------------------------------------


def _key(output_dir: Path) -> str:
    return str(Path(output_dir).resolve())


class _RunLock:
    """An exclusive fcntl (POSIX) lock on <output_dir>/.run.lock, taken by the main process before
    it looks at the folder and held until it exits. The kernel releases it when the process ends,
    however it ends, so a killed run leaves no stale lock; fcntl locks hold across the nodes of an
    NFS mount (flock is emulated with them there). The file records who holds it (pid, host,
    Slurm job, start), for the message a second run gets. Forked DataLoader workers do not
    inherit fcntl locks, and nothing else in the process opens the file (closing any descriptor
    of it would drop the lock).

    A run leaves the folder as it found it when it is refused (the lock file and the folders it
    created removed, or the file's earlier content put back); once it goes on, it removes the
    lock file at exit. Whoever locks the file checks afterwards that it is still the one at that
    path, since its holder may have removed it in between."""

    held: dict = {}
    warned = registered = False

    def __init__(self, output_dir: Path):
        self.output_dir, self.path = output_dir, output_dir / LOCK_FILE
        self.fd, self.original, self.created_dirs, self.proceeded, self.pid = None, None, [], False, os.getpid()

    @classmethod
    def acquire(cls, output_dir: Path) -> _RunLock:
        key = _key(output_dir)
        if key in cls.held:  # this process holds it already (a second prepare_output_dir)
            return cls.held[key]
        lock = cls(output_dir)
        try:
            lock._acquire()
        except BaseException:
            lock.release()
            raise
        cls.held[key] = lock
        if not cls.registered:
            atexit.register(cls.release_all)
            cls.registered = True
        return lock

    def _acquire(self) -> None:
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise RecipeError(_unwritable(self.output_dir, "it is a file"))
        for _ in range(50):
            try:
                self._make_dirs()
            except OSError as err:
                raise RecipeError(_unwritable(self.output_dir, one_line(err))) from err
            try:
                fd, created = self._open()
            except FileNotFoundError:  # the folder or file vanished in between (a refused run's cleanup)
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
                if err.errno in UNSUPPORTED_LOCK:
                    if not _RunLock.warned:
                        logger.warning(
                            f"cannot lock --output_dir {self.output_dir} on this filesystem "
                            f"({one_line(err)}): a second run started into it would not be stopped"
                        )
                        _RunLock.warned = True
                    return
                raise RecipeError(
                    f"cannot lock --output_dir {self.output_dir} ({one_line(err)}); "
                    "pass a folder on another filesystem"
                ) from err
            if not self._still_there(fd):
                os.close(fd)
                continue
            self.fd = fd
            self.original = None if created else os.pread(fd, 1 << 16, 0)
            try:
                self._write(self._identity())
            except OSError as err:
                raise RecipeError(_unwritable(self.output_dir, one_line(err))) from err
            return
        raise RecipeError(f"could not lock --output_dir {self.output_dir}: its lock file kept being replaced")

    def _make_dirs(self) -> None:
        missing, folder = [], self.output_dir
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            try:
                folder.mkdir()
                self.created_dirs.append(folder)
            except FileExistsError:
                pass

    def _open(self) -> tuple:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            return os.open(self.path, os.O_RDWR), False

    def _still_there(self, fd: int) -> bool:
        try:
            st, mine = os.stat(self.path), os.fstat(fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    @staticmethod
    def _identity() -> bytes:
        job = os.environ.get("SLURM_JOB_ID")
        return (
            f"pid {os.getpid()} on {socket.gethostname()}"
            + (f", Slurm job {job}" if job else "")
            + f", started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        ).encode()

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


def model_signature(accelerator) -> dict:
    """What identifies the prepared model(s): a digest of the parameter names and full shapes (also
    under ZeRO-3, where `ds_shape` is the full shape), and the parameter count."""
    shapes, count = [], 0
    for model in accelerator._models:
        for name, p in accelerator.unwrap_model(model, keep_torch_compile=False).named_parameters():
            shape = tuple(getattr(p, "ds_shape", p.shape))
            shapes.append(f"{name}:{shape}")
            count += getattr(p, "ds_numel", p.numel())
    return {"model_signature": hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16], "model_parameters": count}


def load_checkpoint(accelerator, path: Path, must_match: dict, identity: dict | None = None) -> dict:
    """Restore the state saved at `path`; return its trainer state.

    `must_match` holds the settings that give the saved data position its meaning (process count,
    per-device batch, accumulation): resuming with other values would replay other batches.
    `identity` (recipe, model_signature, model_parameters) must match too: another recipe's or
    another model's checkpoint is refused with a line saying whose it is.
    """
    state = json.loads((Path(path) / STATE_FILE).read_text())
    identity = identity or {}
    if state.get("recipe", identity.get("recipe")) != identity.get("recipe"):
        raise RecipeError(
            f"checkpoint {path} was written by recipes/{state['recipe']}.py, this is "
            f"recipes/{identity['recipe']}.py; resume it with that recipe, or use another --output_dir"
        )
    if state.get("model_signature", identity.get("model_signature")) != identity.get("model_signature"):
        raise RecipeError(
            f"checkpoint {path} holds another model ({state.get('model_parameters', 0):,} parameters, this run's has "
            f"{identity.get('model_parameters', 0):,}); resume with the model arguments that wrote it (its "
            f"{STATE_FILE} lists them under args), or use another --output_dir"
        )
    for key, value in must_match.items():
        if key in state and state[key] != value:
            raise RecipeError(
                f"checkpoint {path} was written with {key}={state[key]} but this run has {value}; "
                f"resume with {key}={state[key]} (the saved data position depends on it)"
            )
    try:
        if accelerator.state.deepspeed_plugin is not None and state.get("world_size", 1) != accelerator.num_processes:
            _load_resharded_deepspeed(accelerator, Path(path), state["world_size"])
        else:
            accelerator.load_state(str(path))
    except Exception as err:  # a truncated file, another model's weights, a missing shard
        raise RecipeError(
            f"could not load checkpoint {path}: {one_line(err)}; pass another checkpoint-<step> "
            "folder, or `latest` to pick the newest intact one",
            same_on_every_rank=False,
        ) from err
    logger.info(f"resumed from {path} at step {state['step']}")
    return state


def _load_resharded_deepspeed(accelerator, path: Path, written_by: int) -> None:
    """Load a ZeRO checkpoint written by another number of processes. DeepSpeed partitions the
    optimizer state (and under ZeRO-3 the weights) by process and refuses another count, so the main
    process converts each engine's folder with DeepSpeed's own ds_to_universal (every parameter's fp32
    weights and optimizer moments, whole) into `.universal-checkpoint-<step>/` beside it, and every
    process loads that with DeepSpeed's `load_universal`, which partitions it for this run. The
    checkpoint itself is not touched; the conversion is deleted once loaded."""
    import contextlib
    import io
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    view = path.parent / f".universal-{path.name}"
    tags = sorted(d.name for d in path.iterdir() if d.is_dir() and any(d.glob("*model_states.pt")))
    if accelerator.is_main_process:
        shutil.rmtree(view, ignore_errors=True)
        view.mkdir()
        for item in path.iterdir():  # the rest (scheduler, RNG states, ...) as it is
            if item.name not in tags:
                (view / item.name).symlink_to(item.resolve())
        logger.warning(
            f"{path.name} was written by {written_by} processes, this run has {accelerator.num_processes}: "
            f"converting its ZeRO state with DeepSpeed's ds_to_universal to repartition it"
        )
        with contextlib.redirect_stdout(io.StringIO()):  # its progress prints
            for tag in tags:
                ds_to_universal(
                    Namespace(
                        input_folder=str(path / tag),
                        output_folder=str(view / tag),
                        num_extract_workers=1,
                        num_merge_workers=1,
                        keep_temp_folder=False,
                        strict=True,
                        inject_missing_state=True,  # ZeRO-1/2 lack its metadata
                    )
                )
    accelerator.wait_for_everyone()
    engines = [model for model in accelerator._models if hasattr(model, "load_universal_checkpoint")]
    try:
        for engine in engines:
            engine._config.load_universal_checkpoint = True
        accelerator.load_state(str(view))
        for engine in engines:
            # DeepSpeed's ZeRO-3 universal load gives every parameter group's state one and the same
            # `step` tensor, which torch's Adam increments in place: with two groups (decay, no decay)
            # it would count two steps per step and get the bias correction wrong. One each.
            base = getattr(engine.optimizer, "optimizer", None)
            for state in getattr(base, "state", {}).values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
    finally:
        for engine in engines:
            engine._config.load_universal_checkpoint = False
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(view, ignore_errors=True)


def save_model(accelerator, model, output_dir, tokenizer=None) -> Path:
    """Save the final weights (and the tokenizer) from the main process, correct under DDP, ZeRO
    and FSDP.

    `get_state_dict` runs on every process because under ZeRO-3 and FSDP it gathers the shards.
    Models with `save_pretrained` (transformers, peft) are saved with it; others as
    model.safetensors. Files are written to a temporary name and renamed; the names are recorded
    in .model-files.json, so that the next save removes the files of this one it does not write
    again (an adapter, other shards) and --overwrite_output_dir removes exactly these. A failure to
    write (a full disk) is one error line on every process, with the space the weights need.
    """
    output_dir = Path(output_dir)
    state_dict = accelerator.get_state_dict(model)
    settle = _Settle(
        accelerator,
        output_dir,
        f"model in {output_dir}",
        None,
        needed=lambda: sum(t.numel() * t.element_size() for t in state_dict.values()),
    )
    if accelerator.is_main_process:
        with settle.attempt():
            if not state_dict:
                raise RecipeError("the gathered state dict is empty; under ZeRO-3 set zero3_save_16bit_model: true")
            _write_model(accelerator.unwrap_model(model), state_dict, output_dir, tokenizer)
    settle()
    return output_dir


def _write_model(unwrapped, state_dict: dict, output_dir: Path, tokenizer) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(unwrapped, "save_pretrained"):
        tmp = output_dir / ".tmp-model"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        names = sorted(f.name for f in tmp.iterdir())
        earlier = _model_files(output_dir)
        for name in names:
            os.replace(tmp / name, output_dir / name)
        tmp.rmdir()
        target = output_dir
    else:
        names, earlier = ["model.safetensors"], _model_files(output_dir)
        target = output_dir / "model.safetensors"
        tmp = output_dir / ".model.safetensors.tmp"
        try:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, tmp, metadata={"format": "pt"})
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, target)
    write_json(output_dir / MODEL_FILES, {"files": names})
    for stale in set(earlier) - set(names):
        (output_dir / stale).unlink(missing_ok=True)
    logger.info(f"saved model to {target}")
