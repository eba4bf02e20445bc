"""Checkpoints that are either complete or absent, and final weights that load anywhere.

Layout in --output_dir (common.outputs keeps it to one run at a time):
    checkpoint-<step>/       accelerator.save_state + trainer_state.json, written last: the marker of a
                             complete checkpoint, with the size and sha256 of every file in it
    .tmp-checkpoint-<step>/  a save in progress
    model.safetensors        final weights (or save_pretrained's files; their names in .model-files.json)
    merged/                  a LoRA run's adapter merged into its base model: save_pretrained's files, no peft needed
    results.json             the run's record (common.metrics), written last: the run has finished

`latest` is the intact checkpoint written last. A write all processes take part in succeeds on all of them or
fails on all of them with one line (`_save_or_fail_together`): none is left waiting in a collective for one that
failed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import json
import os
import re
import shutil
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch
from accelerate.utils import gather_object
from safetensors.torch import save_file

from . import tensor_parallel
from .args import public_args
from .runtime import RecipeError, causes, decide_on_main, library_versions, logger, one_line

CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
RUN_FOLDER_RE = re.compile(rf"(\.tmp-|\.universal-)?{CHECKPOINT_RE.pattern}")  # or a save, a conversion in progress
STATE_FILE, RESULTS_FILE, MODEL_FILES = "trainer_state.json", "results.json", ".model-files.json"
HASH = "sha256"  # over blake2b: 1.4 against 0.95 GB/s on one core of an x86 CPU with SHA extensions
MARKER_HASH = f"{STATE_FILE} {HASH}"  # the marker's own, over the rest of it (older checkpoints lack it)
MERGED = "merged"  # a LoRA run's merged model, beside its adapter


def write_json(path, data: dict) -> None:
    """JSON through a temporary file and a rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no stray temporary file
        raise


def apply_umask(path: Path) -> dict:
    """Give `path` (a file, or each file in a folder) the permissions the user's umask gives a new file: safetensors
    and torch write 0600, which a colleague or a service account sharing the results could not read. Returns each
    file's size by its path in the folder (a checkpoint's marker records them)."""
    umask = os.umask(0)
    os.umask(umask)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        file.chmod(0o666 & ~umask)
    return {str(f.relative_to(path)): f.stat().st_size for f in files}


def read_state(path) -> dict:
    """A checkpoint's trainer_state.json: its position, identity, layout and arguments."""
    return json.loads((Path(path) / STATE_FILE).read_text())


# Arguments that decide how long, where and how a run goes, not what it computes: a resume may change them.
RUN_CONTROL = {
    "output_dir", "resume_from_checkpoint", "overwrite_output_dir", "max_train_steps", "num_train_epochs",
    "logging_steps", "checkpointing_steps", "save_total_limit", "report_to", "dataloader_num_workers",
    "preprocessing_num_workers", "ddp_timeout", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "save_fp32", "torch_compile", "recipe", "seed", "prepared_data_dir", "prepare_only",
    "max_eval_samples", "sample_prompts", "max_new_tokens",
}  # fmt: skip


def changed_settings(saved_args: dict, args) -> list:
    """`--name old -> new` for each argument outside RUN_CONTROL that differs from a checkpoint's (None: unset)."""
    now = public_args(args)
    return [
        f"--{k} {saved_args.get(k)} -> {now.get(k)}"
        for k in {**now, **saved_args}  # this run's names first, then those it no longer has
        if saved_args.get(k) != now.get(k) and k not in RUN_CONTROL
    ]


# Across processes -------------------------------------------------------------------------------


def _all_gather(accelerator, obj) -> list:
    return gather_object([obj]) if accelerator is not None and accelerator.num_processes > 1 else [obj]


def _save_or_fail_together(accelerator, what: str, output_dir: Path, needed, fn, tmp: Path, main_only=False):
    """Run the save step `fn` on every process (or the main one alone), then agree on the outcome: every process
    returns the list of all processes' results, or every process raises. Without the agreement a process whose write
    failed would raise while the others waited for it in the save's next collective until --ddp_timeout. A failure
    to write is one line (a full disk: the space `needed()` and the space free); any other exception is re-raised
    where it happened. `tmp`, the half-written folder, is removed on failure."""
    failure = error = result = None
    if accelerator.is_main_process or not main_only:
        try:
            result = fn()
        except Exception as err:
            failure = _write_failure(err) or ("other", one_line(err))
            error = err if failure[0] == "other" else None  # kept to re-raise; a failed write's frames hold its file
    everyone = _all_gather(accelerator, (failure, result))
    failures = [(rank, f) for rank, (f, _) in enumerate(everyone) if f]
    if not failures:
        return [r for _, r in everyone]
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    rank, (kind, text) = failures[0]
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(nearest_existing(output_dir)).free
    if any(k == "space" for _, (k, _) in failures) or (kind == "io" and free is not None and free < needed()):
        have = f", {_human(free)} free" if free is not None else ""
        raise RecipeError(
            f"no space left on the filesystem of {output_dir} to save the {what}: it needs about {_human(needed())}"
            f"{have}",
            "free space there or pass another --output_dir (the checkpoints already saved are intact)",
            subject="--output_dir",
        )
    where = f" on process {rank}" if accelerator.num_processes > 1 else ""
    # what the system said is the problem, and no option of the user's is at fault: no subject
    raise RecipeError(f"could not save the {what}{where}: {text}", "the checkpoints already saved are intact")


def _write_failure(err: BaseException) -> tuple | None:
    """("space" | "io", one line) for an error writing files, None for any other. torch.save reports a full disk
    without an errno ("unexpected pos ..."): the free space decides."""
    chain = causes(err)
    text = " ".join([type(err).__name__, *map(str, chain)])
    if re.search(r"No space left|[Qq]uota exceeded|(os error|Errno) (28|122)\b", text):  # ENOSPC, EDQUOT
        return "space", one_line(err)
    if any(isinstance(e, OSError) for e in chain) or re.search(
        r"SafetensorError|PytorchStreamWriter|inline_container|iostream|file write failed", text
    ):
        return "io", one_line(err)
    return None


def nearest_existing(path) -> Path:
    """`path`, or the nearest folder above it that exists (here: a first save creates it)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# Integrity ----------------------------------------------------------------------------------------


def _digest(path: Path) -> str:
    h, buffer = hashlib.new(HASH), bytearray(1 << 23)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _share(files: dict, accelerator) -> list:
    """The files (name: size) this process hashes, largest first dealt in turn: all processes hash at once, and
    none waits in a collective long enough to time out."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    return sorted(files, key=lambda name: (-files[name], name))[rank::world]


def marker_digest(state: dict) -> str:
    """The sha256 of a checkpoint's marker (trainer_state.json) less this digest, which it records (MARKER_HASH)."""
    rest = json.dumps({k: v for k, v in state.items() if k != MARKER_HASH}, sort_keys=True, default=str)
    return hashlib.new(HASH, rest.encode()).hexdigest()


def _size_damage(path: Path) -> tuple:
    """(why the checkpoint at `path` is damaged or None, its files' sizes, their checksums)."""
    try:
        state = read_state(path)
        files, digests = dict(state.get("files", {})), dict(state.get(HASH, {}))
    except (OSError, ValueError, TypeError, AttributeError) as err:
        return f"{STATE_FILE} is unreadable ({one_line(err)})", {}, {}
    if MARKER_HASH in state and state[MARKER_HASH] != marker_digest(state):  # the position, the data's identity
        return f"{STATE_FILE} does not match the {HASH} written with it", {}, {}
    for name, size in files.items():
        if not (path / name).is_file():
            return f"{name} is missing", files, digests
        if (path / name).stat().st_size != size:
            return f"{name} has {(path / name).stat().st_size} bytes, {size} were written", files, digests
    return None, files, digests


def checkpoint_damage(path, accelerator=None) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None: a listed file missing, of another size or another
    sha256 (a bad disk or copy). With `accelerator`, every process calls it and hashes a share."""
    path = Path(path)
    problem, files, digests = decide_on_main(accelerator, lambda: _size_damage(path))
    if problem or not digests:
        return problem
    bad = []
    for name in _share({name: files.get(name, 0) for name in digests}, accelerator):
        with contextlib.suppress(OSError):
            if _digest(path / name) == digests[name]:
                continue
        bad.append(name)
    bad = sorted({name for share in _all_gather(accelerator, bad) for name in share})
    more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
    return f"{bad[0]}{more} does not match the {HASH} written with the checkpoint" if bad else None


# Saving -------------------------------------------------------------------------------------------


def save_checkpoint(accelerator, model, args, plan, position, log, optimizer=None) -> Path:
    """The training state at `position` (a common.plan.Position) with what a resume on any layout needs; a run
    whose loss or weights are no longer finite is not saved."""
    log.check_finite(position.step, model)
    state = {
        "epoch": position.epoch,
        "samples_in_epoch": position.sample,
        "samples_seen": position.seen,
        "recipe": args.recipe,
        **model_signature(model),
        "distributed_type": accelerator.distributed_type.value,
        "layout": _layout(accelerator),
        "mixed_precision": accelerator.mixed_precision,
        "world_size": accelerator.num_processes,
        "per_device_train_batch_size": plan.per_device_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "effective_batch_size": plan.effective_batch_size,
        "learning_rate": plan.learning_rate,
        "num_samples": plan.num_samples,
        "data_fingerprint": plan.data_fingerprint,
        "total_samples": plan.total_samples,
        "warmup_samples": plan.warmup_samples,
        "log_history": log.history,  # as transformers' Trainer keeps it: a resumed run's results.json has it whole
        "log_window": log.window,
        "eval_history": log.eval_history,
        "train_seconds": log.seconds,  # the time since the last log too
        "args": public_args(args),
    }
    return write_checkpoint(
        accelerator, args.output_dir, position.step, state, args.save_total_limit, model, optimizer
    )


def write_checkpoint(
    accelerator, output_dir, step: int, state: dict, total_limit=None, model=None, optimizer=None
) -> Path:
    """accelerator.save_state at `step` into .tmp-checkpoint-<step> (under tensor parallelism the split model and
    `optimizer` through torch's distributed checkpoint: tensor_parallel.save_state), then the marker (`state`,
    versions, time, each file's size and sha256) and a rename into place: a crash at any point leaves a complete
    checkpoint or a temporary folder `latest` ignores. `total_limit` rotates older ones out once this one is
    complete. `output_dir` is on a filesystem every node sees, as multi-node checkpoints must be."""
    output_dir = Path(output_dir)
    final, tmp = output_dir / f"checkpoint-{step}", output_dir / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
    accelerator.wait_for_everyone()

    def needed() -> int:  # the newest checkpoint's size, or else the weights and Adam's two moments
        for path in reversed(complete_checkpoints(output_dir)):
            if files := _size_damage(path)[1]:
                return sum(files.values())
        tensors = [*model.parameters(), *model.buffers()] if model is not None else []
        return 3 * sum(getattr(t, "ds_numel", t.numel()) * t.element_size() for t in tensors)

    save_or_fail = functools.partial(
        _save_or_fail_together, accelerator, f"checkpoint {final}", output_dir, needed, tmp=tmp
    )
    if _layout(accelerator) == tensor_parallel.LAYOUT:
        save_or_fail(lambda: tensor_parallel.save_state(accelerator, model, optimizer, tmp))
    else:
        save_or_fail(lambda: accelerator.save_state(str(tmp)))
    (files,) = [f for f in save_or_fail(lambda: apply_umask(tmp), main_only=True) if f is not None]
    shares = save_or_fail(lambda: {name: _digest(tmp / name) for name in _share(files, accelerator)})
    digests = {k: v for share in shares for k, v in share.items()}
    marker = {"step": step, **state, "saved_at": time.time(), "files": files, HASH: digests}
    marker["versions"] = library_versions()
    marker[MARKER_HASH] = marker_digest(json.loads(json.dumps(marker, default=str)))  # of the form read back
    save_or_fail(lambda: (write_json(tmp / STATE_FILE, marker), _install(tmp, final)), main_only=True)
    if accelerator.is_main_process:
        logger.info(f"saved checkpoint {final}")
        if total_limit:
            _prune(output_dir, final, total_limit)
    accelerator.wait_for_everyone()
    return final


# Files a save writes once per process (accelerate's RNG states, DeepSpeed's ZeRO shards, the shard files of
# torch.distributed.checkpoint): in a checkpoint whose marker does not read, those of another process count are the
# earlier save's.
PER_PROCESS_FILE = re.compile(
    r"random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_\w+\.pt|__\d+_\d+\.distcp"
)


def _install(tmp: Path, final: Path) -> None:
    """`tmp` renamed to `final`, replacing what a save wrote there; a crash at any point leaves `tmp` complete
    (`latest` installs it). A file of the user's in `final` stays: it moves into `tmp` first (one of a save's names,
    left by a save cut short, is replaced). Where `final`'s marker does not read, its per-process files go too: kept,
    a resume on their process count would read another trajectory's random states or shards."""
    if final.exists():
        if not remove_checkpoint(final):
            for path in [p for p in final.rglob("*") if p.is_file() and PER_PROCESS_FILE.fullmatch(p.name)]:
                path.unlink()
        logger.info(f"replacing the earlier {final.name} with this run's")
    if final.exists():  # what remove_checkpoint left: a user's files move into tmp, the rest (names tmp has too) goes
        _move_theirs(final, tmp)
        shutil.rmtree(final)
    os.replace(tmp, final)


def _move_theirs(old: Path, new: Path) -> None:
    """What is in folder `old` and not in `new` moves there, at any depth (a note in a shard folder too)."""
    for item in list(old.iterdir()):
        if not (new / item.name).exists():
            os.replace(item, new / item.name)
        elif item.is_dir() and not item.is_symlink() and (new / item.name).is_dir():
            _move_theirs(item, new / item.name)


def remove_checkpoint(path: Path) -> bool:
    """Delete the files the marker of `path` lists, the marker, and the folders left empty: a file someone added
    stays, and a folder without a readable marker is not ours (False)."""
    try:
        listed = [Path(name) for name in read_state(path).get("files", {})]
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    for name in [*listed, Path(STATE_FILE)]:  # the marker last: a removal cut short leaves a damaged checkpoint
        if not name.is_absolute() and ".." not in name.parts:
            (path / name).unlink(missing_ok=True)
    for folder in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [path]:
        with contextlib.suppress(OSError):
            folder.rmdir()
    return True


def saved_at(path: Path) -> float:
    """When a checkpoint was saved: as its record says, else (an older record, or one cut short: among the newest,
    where latest meets it and says so) its record's mtime."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if saved := read_state(path).get("saved_at"):
            return float(saved)
    with contextlib.suppress(OSError):
        return (path / STATE_FILE).stat().st_mtime
    return 0.0


def complete_checkpoints(output_dir) -> list:
    """The checkpoint-<step> folders with their marker, in the order they were written."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if CHECKPOINT_RE.fullmatch(p.name)]
    found = [p for p in found if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: (saved_at(p), int(p.name.removeprefix("checkpoint-"))))


def in_run_folder(path, output_dir) -> bool:
    """Whether checkpoint `path` is one of --output_dir's own (`latest` and another --output_dir mean something to
    it), not another folder's given by path."""
    return Path(path).resolve().parent == Path(output_dir).resolve()


def start_anew(path, output_dir) -> str:
    """How a refusal of checkpoint `path` says to start a new run instead: in another folder where it is the run's
    own, else without it (the run's folder holds nothing of it)."""
    if in_run_folder(path, output_dir):
        return "use another --output_dir"
    return "drop --resume_from_checkpoint to start a new run"


def instead_of(path, output_dir) -> str:
    """What to resume instead of checkpoint `path`, which does not load: `latest` where it is the run's own (it
    passes over a damaged one), else the newest checkpoint before it in its folder."""
    if in_run_folder(path, output_dir):
        return "pass an older checkpoint-<step> folder, or `latest` to pick the newest intact one"
    step = step_of(path)
    older = [c for c in complete_checkpoints(Path(path).parent) if step is None or step_of(c) < step]
    if older:
        return f"pass an older checkpoint ({older[-1]})"
    return "pass another checkpoint, or drop --resume_from_checkpoint to start a new run"


def step_of(path) -> int | None:
    """The step of a checkpoint-<step> folder (None for another name)."""
    return int(found[1]) if (found := CHECKPOINT_RE.fullmatch(Path(path).name)) else None


def _prune(output_dir: Path, final: Path, total_limit: int) -> None:
    """--save_total_limit: keep `final` and the `total_limit` intact ones written last (sizes checked only: a
    checksum pass per save would cost too much)."""
    written = complete_checkpoints(output_dir)
    keep = {final, *[p for p in written if p == final or not _size_damage(p)[0]][-total_limit:]}
    for old in written[: written.index(final)]:
        if old not in keep:
            if remove_checkpoint(old):
                logger.info(f"deleted {old} (--save_total_limit {total_limit})")
            else:  # which files are a run's, its marker no longer says
                logger.warning(f"kept {old} (--save_total_limit {total_limit}): its {STATE_FILE} is unreadable")


# Resuming -----------------------------------------------------------------------------------------


def resolve_checkpoint(output_dir, spec: str | None, accelerator=None) -> Path | None:
    """--resume_from_checkpoint: `latest`, the intact checkpoint written last (None when there is none yet: a
    requeued job can always pass it), once the saves a crash cut short are finished; or a path, refused when
    damaged (OutputDir refused it already if it has no marker). Every process calls it."""
    if not spec:
        return None
    output_dir = Path(output_dir)
    if spec != "latest":
        path = Path(spec)
        if damage := checkpoint_damage(path, accelerator):
            raise RecipeError(
                f"--resume_from_checkpoint {spec}: the checkpoint is damaged: {damage}",
                instead_of(path, output_dir),
                subject="--resume_from_checkpoint",
            )
        return path

    def candidates():  # a save a crash cut short is completed if its marker is there and every file matches it
        for tmp in sorted(output_dir.glob(".tmp-checkpoint-*")):
            final = output_dir / tmp.name.removeprefix(".tmp-")
            if not CHECKPOINT_RE.fullmatch(final.name):
                continue
            if checkpoint_damage(tmp) is None:
                _install(tmp, final)
                logger.warning(f"completed the interrupted save of {final}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                logger.warning(f"deleted {tmp}, a save that did not complete")
        for path in sorted(output_dir.glob("checkpoint-*")):
            if CHECKPOINT_RE.fullmatch(path.name) and not (path / STATE_FILE).is_file():
                logger.warning(f"ignoring incomplete checkpoint {path} (no {STATE_FILE})")
        return complete_checkpoints(output_dir)[::-1]

    newest_first, newest = decide_on_main(accelerator, candidates), None
    for path in newest_first:
        if not (damage := checkpoint_damage(path, accelerator)):
            return path
        newest = newest or f"{path.name}: {damage}"
        logger.warning(f"ignoring damaged checkpoint {path}: {damage}")
    if newest:  # starting over would replace them: a copy still in progress, a disk's fault, is for a person
        raise RecipeError(
            f"--resume_from_checkpoint latest: every checkpoint in {output_dir} is damaged (the newest, {newest})",
            "restore them from a copy, or pass --overwrite_output_dir instead to start over",
            subject="--resume_from_checkpoint",
        )
    logger.warning(f"--resume_from_checkpoint latest: no checkpoint yet in {output_dir}, starting at step 0")
    return None


def model_signature(model) -> dict:
    """Digests of the parameters' and buffers' names and full shapes (a BatchNorm and a GroupNorm differ in buffers
    alone), without a wrapper's prefix (module., _orig_mod.), and the parameter count."""

    def digest(named):
        shapes = (
            f"{re.sub(r'^((module|_orig_mod)[.])+', '', n)}:{tuple(getattr(t, 'ds_shape', t.shape))}" for n, t in named
        )
        return hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]

    return {
        "model_signature": digest(model.named_parameters()),
        "model_buffers": digest(model.named_buffers()),
        "model_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
    }


def _layout(accelerator) -> str:
    """How model and optimizer state are laid out in files: DDP's whole, FSDP's or a ZeRO stage's shards, TP's split
    layers (torch's distributed checkpoint)."""
    kind, plugin = accelerator.distributed_type.value, accelerator.state.deepspeed_plugin
    if tensor_parallel.degree() > 1:
        return tensor_parallel.LAYOUT
    if kind == "DEEPSPEED":
        return f"DEEPSPEED ZeRO-{plugin.zero_stage}"
    return kind if kind == "FSDP" else "DDP"


def load_checkpoint(accelerator, path: Path, model, optimizer, args) -> dict:
    """Restore `path` into the prepared model and optimizer; return its trainer state. Another model's or distributed
    layout's checkpoint is refused in one line that names the settings this run changed. The optimizer
    keeps this run's settings (weight decay, momentum, ...), not the checkpoint's."""
    state = read_state(path)  # another recipe's was refused before the data was read (OutputDir)
    changed = changed_settings(state.get("args", {}), args)
    differs = f"; this run differs from it in {', '.join(changed)}" if changed else ""
    identity = model_signature(model)
    if any(state.get(key, identity[key]) != identity[key] for key in ("model_signature", "model_buffers")):
        theirs, ours = state.get("model_parameters", 0), identity["model_parameters"]
        size = f"{theirs:,} parameters, this run's has {ours:,}" if theirs != ours else "other layers, as many weights"
        raise RecipeError(
            f"checkpoint {path} holds another model ({size}){differs}",
            f"resume with the model arguments that wrote it (its {STATE_FILE} lists them under args), or "
            f"{start_anew(path, args.output_dir)}",
            subject=str(path),
        )
    saved = state.get("layout", _layout(accelerator))
    if saved != _layout(accelerator) and not tensor_parallel.loads(saved, _layout(accelerator)):  # files of its own
        raise RecipeError(
            f"checkpoint {path} was written under {state['layout']}, this run is {_layout(accelerator)}, and each "
            "keeps the model and optimizer state in files of its own layout",
            f"resume with an accelerate config of the checkpoint's kind ({state['layout']}), or "
            f"{start_anew(path, args.output_dir)}",
            subject=str(path),
        )
    if state.get("mixed_precision", accelerator.mixed_precision) != accelerator.mixed_precision:
        logger.warning(
            f"resuming {path} with another mixed precision: {state['mixed_precision']} -> "
            f"{accelerator.mixed_precision}"
        )
    fresh = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]
    try:
        if tensor_parallel.LAYOUT in (saved, _layout(accelerator)):  # split or whole, into split or whole
            tensor_parallel.load_state(accelerator, model, optimizer, Path(path), saved == tensor_parallel.LAYOUT)
        elif _resharded(accelerator, state):
            _load_resharded_deepspeed(accelerator, model, Path(path), state)
        else:
            accelerator.load_state(str(path))
    except Exception as err:  # a truncated file, another model's weights, a missing shard; or what this run changed
        fix = (
            f"{differs[2:]}: resume with the checkpoint's settings, or {start_anew(path, args.output_dir)}"
            if changed
            else instead_of(path, args.output_dir)
        )
        raise RecipeError(
            f"could not load checkpoint {path}: {one_line(err)}", fix, subject=str(path), same_on_every_rank=False
        ) from err
    for group, settings in zip(optimizer.param_groups, fresh):  # this run's, not the checkpoint's (plan_run lists)
        group.update(settings)
    logger.info(f"resumed from {path} at step {state['step']}")
    return state


def _load_resharded_deepspeed(accelerator, engine, path: Path, state: dict) -> None:
    """A ZeRO checkpoint of another process count or precision, which DeepSpeed refuses: the main process converts it
    with DeepSpeed's ds_to_universal into .universal-checkpoint-<step>/ in this run's output folder (deleted once
    loaded; never beside the checkpoint, an input that may be another run's or read-only), which every process loads
    with DeepSpeed's universal loader into this run's partitions."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    view = Path(accelerator.project_dir) / f".universal-{path.name}"  # removed however this ends (a stop meanwhile)
    tags = sorted(d.name for d in path.iterdir() if d.is_dir() and any(d.glob("*model_states.pt")))
    try:
        if accelerator.is_main_process:
            shutil.rmtree(view, ignore_errors=True)
            view.mkdir()
            for item in path.iterdir():  # the rest (RNG states, ...) as it is
                if item.name not in tags:
                    (view / item.name).symlink_to(item.resolve())
            logger.warning(
                f"{path.name} was written by {state['world_size']} processes in {state.get('mixed_precision')}, "
                f"this run has {accelerator.num_processes} in {accelerator.mixed_precision}: "
                "converting its ZeRO state with DeepSpeed's ds_to_universal to repartition it"
            )
            with contextlib.redirect_stdout(io.StringIO()):  # its progress prints
                for tag in tags:  # inject_missing_state: ZeRO-1/2 checkpoints lack its metadata
                    options = dict(num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True)
                    convert = dict(input_folder=str(path / tag), output_folder=str(view / tag))
                    ds_to_universal(Namespace(**options, **convert, inject_missing_state=True))
        accelerator.wait_for_everyone()
        accelerator.load_state(str(view))  # as a universal one: see universal_load_if_resharded
        # DeepSpeed's ZeRO-3 universal load gives every parameter group's state one and the same `step` tensor,
        # which torch's Adam increments in place: with two groups it would count two steps a step. One each.
        for state in getattr(getattr(engine.optimizer, "optimizer", None), "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(view, ignore_errors=True)


def _resharded(accelerator, state: dict) -> bool:
    """Whether a checkpoint's trainer state is a ZeRO checkpoint of another process count or mixed precision (ZeRO
    names its optimizer files by their precision)."""
    layout = (state.get("world_size", 1), state.get("mixed_precision", accelerator.mixed_precision))
    ours = (accelerator.num_processes, accelerator.mixed_precision)
    return accelerator.state.deepspeed_plugin is not None and layout != ours


def universal_load_if_resharded(accelerator, path) -> None:
    """Before accelerator.prepare: where `path` is a ZeRO checkpoint of another process count, the DeepSpeed config
    the engine is built from loads checkpoints as universal ones (DeepSpeed's documented `checkpoint.load_universal`,
    read only when the engine is built)."""
    if path is not None and _resharded(accelerator, read_state(path)):
        accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True


# Final weights ------------------------------------------------------------------------------------


def save_model(accelerator, model, output_dir, tokenizer=None) -> Path:
    """The final weights (and tokenizer) under DDP, ZeRO and FSDP (`get_state_dict` gathers shards on every
    process): save_pretrained where the model has it, else model.safetensors, through a temporary folder. The names
    go in .model-files.json: the next save and --overwrite_output_dir remove exactly these."""
    output_dir = Path(output_dir)
    tmp = output_dir / ".tmp-model"
    # accelerate launch --dynamo_backend compiles the model it prepares: the names it gathers start with _orig_mod.
    # (ZeRO-3 gathers the weights on the main process alone: None elsewhere)
    state_dict = {re.sub(r"^(_orig_mod[.])+", "", k): v for k, v in (accelerator.get_state_dict(model) or {}).items()}
    state_dict = tensor_parallel.whole(state_dict)  # TP's split weights gathered: Accelerate returns them split
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)

    def write():
        output_dir.mkdir(parents=True, exist_ok=True)
        earlier = model_files(output_dir)
        shutil.rmtree(
            tmp, ignore_errors=True
        )  # left by a save that crashed; one that failed was removed where it failed
        if hasattr(unwrapped, "save_pretrained"):
            with tensor_parallel.saved_by_one_process(unwrapped):
                unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if "peft" in sys.modules and isinstance(unwrapped, sys.modules["peft"].PeftModel):  # LoRA: also merged
                save_merged(unwrapped, state_dict, tmp / MERGED, tokenizer)
        else:
            tmp.mkdir()
            save_file({k: v.contiguous() for k, v in state_dict.items()}, tmp / "model.safetensors", {"format": "pt"})
        apply_umask(tmp)
        if (output_dir / "README.md").exists() and "README.md" not in earlier:  # peft's model card: a user's stays
            (tmp / "README.md").unlink(missing_ok=True)
        names = sorted(f.name for f in tmp.iterdir())
        if appeared := [n for n in names if (output_dir / n).exists() and n not in earlier]:  # since OutputDir looked
            raise RecipeError(
                f"{output_dir / appeared[0]} is not this run's, and the model would write over it",
                "move it",
                subject=str(output_dir / appeared[0]),
            )
        write_json(output_dir / MODEL_FILES, {"files": sorted({*earlier, *names})})  # a save cut short: all recorded
        for name in names:
            if (output_dir / name).is_dir():  # a rename does not replace a folder (merged/): the old one goes aside
                os.replace(output_dir / name, tmp / f"{name}.old")
            os.replace(tmp / name, output_dir / name)
            shutil.rmtree(tmp / f"{name}.old", ignore_errors=True)
        tmp.rmdir()
        write_json(output_dir / MODEL_FILES, {"files": names})
        for stale in set(earlier) - set(names):
            if (output_dir / stale).is_dir():
                shutil.rmtree(output_dir / stale)
            else:
                (output_dir / stale).unlink(missing_ok=True)
        logger.info(f"saved model to {output_dir if len(names) > 1 else output_dir / names[0]}")

    size = sum(t.numel() * t.element_size() for t in state_dict.values())  # before save_merged consumes them
    needed = lambda: size  # noqa: E731
    _save_or_fail_together(accelerator, f"model in {output_dir}", output_dir, needed, write, tmp, main_only=True)
    return output_dir


def save_merged(peft_model, state_dict: dict, folder: Path, tokenizer=None) -> None:
    """A LoRA run's adapter merged into its base weights (peft's merge_and_unload), saved in `folder` as a full
    fine-tune's weights are, in their dtype: from_pretrained loads it without peft (and finds no adapter_config.json
    to apply a second time). Built on CPU from the gathered `state_dict`, which it consumes: empty layers of the
    model's own classes take its tensors, and each merged weight replaces its original as it is made, so no more than
    one copy of the model is held beside the trained one (beside the copy ZeRO-3 or FSDP gathered, no second one)."""
    from accelerate import init_empty_weights
    from peft import get_peft_model

    base, name = peft_model.get_base_model(), peft_model.active_adapter
    with init_empty_weights():  # parameters on the meta device, no memory; buffers (rotary tables) computed
        shell = get_peft_model(
            type(base)(copy.deepcopy(base.config)), copy.deepcopy(peft_model.peft_config[name]), adapter_name=name
        )
    tensors = {key: state_dict.pop(key).detach().cpu() for key in list(state_dict)}
    shell.load_state_dict(tensors, strict=False, assign=True)
    del tensors
    shell.get_base_model().tie_weights()  # a tied head, gathered once or twice: one tensor again, as peft expects
    model = shell.merge_and_unload(safe_merge=True)  # a merged weight is a new tensor, checked finite
    if empty := [n for n, p in model.named_parameters() if p.is_meta]:
        raise RuntimeError(f"the gathered weights lack {empty[0]}, which the merged model needs")
    model.generation_config = copy.deepcopy(base.generation_config)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def model_files(output_dir: Path) -> list:
    """The files the last save_model wrote in output_dir (plain names only)."""
    try:
        names = json.loads((output_dir / MODEL_FILES).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [n for n in names if isinstance(n, str) and n not in ("", ".", "..") and Path(n).name == n]


def export_fp32(accelerator, model, output_dir):
    """--save_fp32: fp32 weights from a ZeRO-trained model's shards into `output_dir`/fp32, through DeepSpeed's own
    zero_to_fp32 converter (the model's config beside them, as from_pretrained loads it)."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    shards, target = Path(output_dir) / ".tmp-zero-shards", Path(output_dir) / "fp32"
    model.save_checkpoint(str(shards))  # every rank writes its partition
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        convert_zero_checkpoint_to_fp32_state_dict(str(shards), str(target), safe_serialization=True)
        config = copy.deepcopy(accelerator.unwrap_model(model).config)
        config.dtype = torch.float32  # what from_pretrained loads it as (a bf16 run's config says bfloat16)
        config.save_pretrained(target)
        shutil.rmtree(shards)
        logger.info(f"saved fp32 weights to {target}")
    accelerator.wait_for_everyone()
