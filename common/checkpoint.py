"""Checkpoints that are either complete or absent, and final weights that load anywhere.

Layout in `--output_dir` (common.outputs keeps it to one run at a time):
    checkpoint-<step>/      accelerator.save_state + trainer_state.json (written last: the marker
                            of a complete checkpoint, with the size and sha256 of every file in it)
    .tmp-checkpoint-<step>/ a save in progress; never picked by `latest`
    .old-checkpoint-<step>/ a checkpoint that a complete new save of the same step is replacing
    model.safetensors       final weights (or save_pretrained files for transformers models); the
                            names of the files written are kept in .model-files.json
    results.json            the run's record (metrics.py), written last: the run has finished
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
from pathlib import Path

import torch
from accelerate.utils import gather_object
from safetensors.torch import save_file

from .runtime import RecipeError, decide_on_main, distributed, library_versions, logger, one_line

CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
TMP_CHECKPOINT_RE = re.compile(r"\.tmp-checkpoint-(\d+)")
OLD_CHECKPOINT_RE = re.compile(r"\.old-checkpoint-(\d+)")
STATE_FILE = "trainer_state.json"
RESULTS_FILE = "results.json"
MODEL_FILES = ".model-files.json"
# sha256 over blake2b: 1.4 against 0.95 GB/s on one core of an x86 CPU with SHA extensions.
HASH = "sha256"


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


# Across processes -------------------------------------------------------------------------------


def _all_gather(accelerator, obj) -> list:
    """`obj` of every process, in process order."""
    return gather_object([obj]) if distributed(accelerator) else [obj]


def _rank_and_world(accelerator) -> tuple[int, int]:
    return (accelerator.process_index, accelerator.num_processes) if distributed(accelerator) else (0, 1)


# Checksums ----------------------------------------------------------------------------------------


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
    problem, files, digests = decide_on_main(accelerator, lambda: _size_damage(path))
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


# Saving -------------------------------------------------------------------------------------------


def save_checkpoint(accelerator, output_dir, step: int, state: dict, total_limit: int | None = None) -> Path:
    """Save the full training state (model, optimizer, scheduler, RNG, sampler) at `step`, with
    `state` (the data position, the run's settings), the library versions and every file's size
    and sha256 in trainer_state.json.

    Every process writes its part into a temporary folder; the processes hash the files (a share
    each); the main process adds `trainer_state.json` and renames the folder to checkpoint-<step>.
    A crash at any point leaves either a complete checkpoint or a temporary folder that `latest`
    ignores (see `finish_interrupted_saves` for the one case in between). A complete new save
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
    files = decide_on_main(accelerator, lambda: _file_sizes(tmp))
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
    a crash leaves the new save complete in `tmp`: finish_interrupted_saves completes it."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        logger.info(f"replaced the earlier {final.name} with this run's")
    else:
        os.replace(tmp, final)


def checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def _prune(output_dir: Path, final: Path, total_limit: int) -> None:
    """--save_total_limit: keep the newest `total_limit` intact checkpoints and the one just
    written; delete complete checkpoints older than it that are not kept. Damaged ones (sizes only:
    a full checksum pass at every save would cost too much) never count towards the limit."""
    intact = [p for p in complete_checkpoints(output_dir) if p == final or not checkpoint_damage(p, checksums=False)]
    keep = set(intact[-total_limit:]) | {final}
    for old in complete_checkpoints(output_dir):
        if old not in keep and checkpoint_step(old) < checkpoint_step(final):
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
        where = f" on process {rank}" if distributed(self.accelerator) else ""
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
    return sorted(found, key=checkpoint_step)


# Resuming -----------------------------------------------------------------------------------------


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
        if not decide_on_main(accelerator, lambda: (path / STATE_FILE).is_file()):
            raise RecipeError(not_a_checkpoint(spec))
        damage = checkpoint_damage(path, accelerator)
        if damage:
            raise RecipeError(
                f"--resume_from_checkpoint {spec}: the checkpoint is damaged: {damage}; "
                f"pass an older checkpoint-<step> folder, or `latest` to pick the newest intact one"
            )
        return path
    damaged = 0
    for path in decide_on_main(accelerator, lambda: _latest_candidates(Path(output_dir))):
        damage = checkpoint_damage(path, accelerator)
        if not damage:
            return path
        logger.warning(f"ignoring damaged checkpoint {path}: {damage}")
        damaged += 1
    what = f"no intact checkpoint ({damaged} damaged)" if damaged else "no checkpoint yet"
    logger.warning(f"--resume_from_checkpoint latest: {what} in {output_dir}, starting at step 0")
    return None


def not_a_checkpoint(spec: str) -> str:
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


def finish_interrupted_saves(output_dir: Path) -> None:
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


def load_checkpoint(accelerator, path: Path, identity: dict) -> dict:
    """Restore the state saved at `path`; return its trainer state. `identity` (recipe,
    model_signature, model_parameters) must match: another recipe's or another model's checkpoint is
    refused with a line saying whose it is. Another layout is not refused: the data position is in
    samples (common.training.plan_run)."""
    state = json.loads((Path(path) / STATE_FILE).read_text())
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


# Final weights ------------------------------------------------------------------------------------


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
        earlier = model_files(output_dir)
        for name in names:
            os.replace(tmp / name, output_dir / name)
        tmp.rmdir()
        target = output_dir
    else:
        names, earlier = ["model.safetensors"], model_files(output_dir)
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


def model_files(output_dir: Path) -> list:
    """The files the last save_model wrote in output_dir (plain names only)."""
    try:
        names = json.loads((output_dir / MODEL_FILES).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [n for n in names if isinstance(n, str) and n not in ("", ".", "..") and Path(n).name == n]
