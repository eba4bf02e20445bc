"""Checkpoints that are either complete or absent, and final weights that load anywhere.

Layout in `--output_dir`:
    checkpoint-<step>/      accelerator.save_state + trainer_state.json (written last)
    .tmp-checkpoint-<step>/ a save in progress; never picked by `latest`
    model.safetensors       final weights (or save_pretrained files for transformers models)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from .runtime import RecipeError, library_versions, logger

CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
STATE_FILE = "trainer_state.json"


def write_json(path: Path, data: dict) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def save_checkpoint(accelerator, output_dir, step: int, state: dict) -> Path:
    """Save the full training state (model, optimizer, scheduler, RNG, sampler) at `step`, with
    `state` (the data position, the run's settings) and the library versions in trainer_state.json.

    Every process writes its part into a temporary folder; after a barrier the main process adds
    `trainer_state.json` and renames the folder to checkpoint-<step>. A crash at any point leaves
    either a complete checkpoint or a temporary folder that `latest` ignores. Assumes
    `output_dir` is on a filesystem every node sees, as checkpoints of multi-node jobs must be.
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
        write_json(tmp / STATE_FILE, {"step": step, **state, "versions": library_versions()})
        if final.exists():  # a resumed run reached a step already saved: keep what is there
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
        logger.info(f"saved checkpoint {final}")
    accelerator.wait_for_everyone()
    return final


def resolve_checkpoint(output_dir, spec: str | None) -> Path | None:
    """`--resume_from_checkpoint`: None, `latest` (newest complete checkpoint in output_dir, or
    None with a warning when there is none yet, so a requeued job can always pass it), or a path."""
    if not spec:
        return None
    if spec != "latest":
        path = Path(spec)
        if not (path / STATE_FILE).is_file():
            raise RecipeError(
                f"--resume_from_checkpoint {spec}: not a complete checkpoint (no {STATE_FILE}); "
                "pass a checkpoint-<step> folder written by a recipe, or `latest`"
            )
        return path
    complete, incomplete = [], []
    for path in Path(output_dir).glob("checkpoint-*"):
        if CHECKPOINT_RE.fullmatch(path.name):
            (complete if (path / STATE_FILE).is_file() else incomplete).append(path)
    for path in incomplete:
        logger.warning(f"ignoring incomplete checkpoint {path} (no {STATE_FILE})")
    if not complete:
        logger.warning(f"--resume_from_checkpoint latest: no checkpoint in {output_dir} yet, starting at step 0")
        return None
    return max(complete, key=lambda p: int(CHECKPOINT_RE.fullmatch(p.name).group(1)))


def load_checkpoint(accelerator, path: Path, must_match: dict) -> dict:
    """Restore the state saved at `path`; return its trainer state.

    `must_match` holds the settings that give the saved data position its meaning (process count,
    per-device batch, accumulation): resuming with other values would replay other batches.
    """
    state = json.loads((Path(path) / STATE_FILE).read_text())
    for key, value in must_match.items():
        if key in state and state[key] != value:
            raise RecipeError(
                f"checkpoint {path} was written with {key}={state[key]} but this run has {value}; "
                f"resume with {key}={state[key]} (the saved data position depends on it)"
            )
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # a truncated file, another model's weights, a missing shard
        raise RecipeError(f"could not load checkpoint {path}: {err}", same_on_every_rank=False) from err
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
