"""Checkpoints that are either complete or absent, and final weights that load anywhere.

Layout in `--output_dir`:
    checkpoint-<step>/      accelerator.save_state + trainer_state.json (written last: the marker
                            of a complete checkpoint, with the size of every file in it)
    .tmp-checkpoint-<step>/ a save in progress; never picked by `latest`
    model.safetensors       final weights (or save_pretrained files for transformers models)
    results.json            the run's record (metrics.py)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .runtime import RecipeError, library_versions, logger, one_line

CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
STATE_FILE = "trainer_state.json"
# What a finished or checkpointed run leaves in --output_dir (save_pretrained's files included).
RUN_OUTPUTS = ("results.json", "model.safetensors", "config.json", "adapter_config.json", "checkpoint-*", ".tmp-checkpoint-*")


def write_json(path: Path, data: dict) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def save_checkpoint(accelerator, output_dir, step: int, state: dict, total_limit: int | None = None) -> Path:
    """Save the full training state (model, optimizer, scheduler, RNG, sampler) at `step`, with
    `state` (the data position, the run's settings) and the library versions in trainer_state.json.

    Every process writes its part into a temporary folder; after a barrier the main process adds
    `trainer_state.json` and renames the folder to checkpoint-<step>. A crash at any point leaves
    either a complete checkpoint or a temporary folder that `latest` ignores. `total_limit` keeps
    that many of the newest checkpoints, deleting older ones only once the new one is complete.
    Assumes `output_dir` is on a filesystem every node sees, as checkpoints of multi-node jobs must be.
    """
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # File sizes let `latest` tell a checkpoint damaged after the fact (a copy cut short).
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        write_json(tmp / STATE_FILE, {"step": step, **state, "files": files, "versions": library_versions()})
        if final.exists():  # a resumed run reached a step already saved: keep what is there
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
        logger.info(f"saved checkpoint {final}")
        if total_limit:
            for old in complete_checkpoints(output_dir)[:-total_limit]:
                if old != final:
                    shutil.rmtree(old)
                    logger.info(f"deleted {old} (--save_total_limit {total_limit})")
    accelerator.wait_for_everyone()
    return final


def complete_checkpoints(output_dir) -> list:
    """The checkpoint-<step> folders with their marker, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if CHECKPOINT_RE.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(CHECKPOINT_RE.fullmatch(p.name).group(1)))


def checkpoint_damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None: its marker and every file it lists
    must be there with the size it was written with."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"{STATE_FILE} is unreadable ({one_line(err)})"
    for name, size in state.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def resolve_checkpoint(output_dir, spec: str | None) -> Path | None:
    """`--resume_from_checkpoint`: None, `latest` (the newest complete, undamaged checkpoint in
    output_dir, or None with a warning when there is none yet, so a requeued job can always pass
    it), or a path."""
    if not spec:
        return None
    if spec != "latest":
        path = Path(spec)
        if not (path / STATE_FILE).is_file():
            raise RecipeError(
                f"--resume_from_checkpoint {spec}: not a complete checkpoint (no {STATE_FILE}); "
                "pass a checkpoint-<step> folder written by a recipe, or `latest`"
            )
        damage = checkpoint_damage(path)
        if damage:
            raise RecipeError(f"--resume_from_checkpoint {spec}: the checkpoint is damaged: {damage}; "
                              f"pass an older checkpoint-<step> folder, or `latest` to pick the newest intact one")
        return path
    for path in Path(output_dir).glob("checkpoint-*"):
        if CHECKPOINT_RE.fullmatch(path.name) and not (path / STATE_FILE).is_file():
            logger.warning(f"ignoring incomplete checkpoint {path} (no {STATE_FILE})")
    damaged = 0
    for path in reversed(complete_checkpoints(output_dir)):
        damage = checkpoint_damage(path)
        if not damage:
            return path
        logger.warning(f"ignoring damaged checkpoint {path}: {damage}")
        damaged += 1
    what = f"no intact checkpoint ({damaged} damaged)" if damaged else "no checkpoint yet"
    logger.warning(f"--resume_from_checkpoint latest: {what} in {output_dir}, starting at step 0")
    return None


def prepare_output_dir(accelerator, args) -> Path | None:
    """Check `--output_dir` before any work is done there, and return the checkpoint to resume
    from (None: a fresh start).

    - A folder holding an earlier run is refused unless the run resumes it or
      `--overwrite_output_dir` is passed (which deletes that run's checkpoints, so `latest` cannot
      mix two runs): an earlier run's weights are never overwritten by mistake.
    - A process that restarts under `accelerate launch --max_restarts N` resumes from `latest`.
    - Every process proves it can write there now rather than at the first checkpoint, hours in.
    """
    output_dir, spec = Path(args.output_dir), args.resume_from_checkpoint
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not spec and restarts > 0:
        logger.warning(f"restart {restarts} of this job (--max_restarts): resuming from the latest checkpoint")
        spec = "latest"
    if not spec:
        previous = sorted({p.name for pattern in RUN_OUTPUTS for p in output_dir.glob(pattern)})
        if previous and not getattr(args, "overwrite_output_dir", False):
            raise RecipeError(
                f"--output_dir {output_dir} already holds a run ({', '.join(previous[:4])}); pass "
                "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to start over, "
                "or another --output_dir"
            )
        old = [p for p in output_dir.glob("*checkpoint-*") if p.is_dir()]
        accelerator.wait_for_everyone()  # every process has looked before anything is deleted
        if old and accelerator.is_main_process:
            logger.warning(f"--overwrite_output_dir: deleting the earlier run's {', '.join(sorted(p.name for p in old))}")
            for path in old:
                shutil.rmtree(path)
    _check_writable(accelerator, output_dir)
    return resolve_checkpoint(output_dir, spec)


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
        probe = folder / f".write-test-{os.getpid()}"
        try:
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            problem = one_line(err)
    failed = accelerator.reduce(torch.tensor([problem is not None], device=accelerator.device, dtype=torch.int32), reduction="sum")
    if int(failed.item()):
        detail = problem or f"{int(failed.item())} process(es) on other nodes cannot"
        raise RecipeError(f"cannot write to --output_dir {output_dir} ({detail}); pass a folder this job can write to, "
                          "on a filesystem every node sees")


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
        raise RecipeError(f"checkpoint {path} was written by recipes/{state['recipe']}.py, this is "
                          f"recipes/{identity['recipe']}.py; resume it with that recipe, or use another --output_dir")
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
        accelerator.load_state(str(path))
    except Exception as err:  # a truncated file, another model's weights, a missing shard
        raise RecipeError(f"could not load checkpoint {path}: {one_line(err)}; pass another checkpoint-<step> "
                          "folder, or `latest` to pick the newest intact one", same_on_every_rank=False) from err
    logger.info(f"resumed from {path} at step {state['step']}")
    return state


def save_model(accelerator, model, output_dir, tokenizer=None) -> Path:
    """Save the final weights (and the tokenizer) from the main process, correct under DDP, ZeRO
    and FSDP.

    `get_state_dict` runs on every process because under ZeRO-3 and FSDP it gathers the shards.
    Models with `save_pretrained` (transformers, peft) are saved with it; others as
    model.safetensors. Files are written to a temporary name and renamed.
    """
    output_dir = Path(output_dir)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        if not state_dict:
            raise RecipeError("the gathered state dict is empty; under ZeRO-3 set zero3_save_16bit_model: true")
        output_dir.mkdir(parents=True, exist_ok=True)
        unwrapped = accelerator.unwrap_model(model)
        if hasattr(unwrapped, "save_pretrained"):
            tmp = output_dir / ".tmp-model"
            shutil.rmtree(tmp, ignore_errors=True)
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            for file in tmp.iterdir():
                os.replace(file, output_dir / file.name)
            tmp.rmdir()
            target = output_dir
        else:
            target = output_dir / "model.safetensors"
            tmp = output_dir / ".model.safetensors.tmp"
            save_file({k: v.contiguous() for k, v in state_dict.items()}, tmp, metadata={"format": "pt"})
            os.replace(tmp, target)
        logger.info(f"saved model to {target}")
    accelerator.wait_for_everyone()
    return output_dir
