"""Tensor parallelism (accelerate_configs/tp.yaml): each layer's weights split over the processes of a node, the
processes seeing the same batches. Accelerate reads the TP degree from the config's `parallelism_config:` keys
(`accelerate launch` passes them on as PARALLELISM_CONFIG_* variables) and transformers splits the model as it loads
it (`from_pretrained(tp_plan="auto", device_mesh=...)`, the model's own `base_model_tp_plan`). What the recipes'
bookkeeping needs to know is here: the degree asked, the refusals before anything loads, how many processes see
different data, and the saved weights made whole.

Only pure TP runs (the degree is the number of processes): FSDP2 across TP groups, the 2-D case, fails inside
Accelerate 1.15 (its TP preparation imports transformers' ReplicateParallel, which transformers 5.24 no longer has)."""

from __future__ import annotations

import contextlib

from . import mesh
from .runtime import RecipeError


def degree() -> int:
    """The tensor-parallel degree the accelerate config asks for (1: none)."""
    try:
        return (mesh.from_environment() or {}).get("tp", 1)
    except ValueError:
        raise RecipeError(
            "the accelerate config's parallelism_config sizes must be whole numbers of processes, as "
            "accelerate_configs/tp.yaml sets them"
        ) from None


def refuse_what_cannot_split(args, accelerator=None) -> None:
    """Before any data or model loads: TP is the whole job (see the module's note on the 2-D case), and it keeps no
    checkpoints (Accelerate 1.15's save_state cannot save split weights: accelerate.utils.modeling's
    id_tensor_storage fails on a DTensor)."""
    tp = degree()
    if tp == 1:
        return
    from accelerate.state import AcceleratorState

    accelerator = accelerator or AcceleratorState()
    if tp != accelerator.num_processes:
        raise RecipeError(
            f"the accelerate config asks for tensor parallelism of degree {tp} in {accelerator.num_processes} "
            f"processes, and only tensor parallelism over every process runs here (FSDP2 across TP groups fails in "
            f"Accelerate 1.15); launch {tp} processes (--num_processes {tp}), or use fsdp.yaml"
        )
    if getattr(args, "config_name", None) and not getattr(args, "model_name_or_path", None):
        raise RecipeError(
            "--config_name under tensor parallelism: transformers splits a model as from_pretrained loads it, and "
            "a new model is built from its config; save the new model once (save_pretrained) and pass its folder "
            "as --model_name_or_path, or use fsdp.yaml"
        )
    if getattr(args, "lora_r", 0):
        raise RecipeError(
            "--lora_r under tensor parallelism: peft's adapters do not fit the layers transformers splits (their "
            "first forward fails on the split shapes); train the whole model under tp.yaml, or LoRA with fsdp.yaml"
        )
    for flag in ("--checkpointing_steps", "--resume_from_checkpoint"):
        if getattr(args, flag[2:], None) is not None:
            raise RecipeError(f"{flag} under tensor parallelism: {NO_CHECKPOINTS}")


NO_CHECKPOINTS = (
    "tensor-parallel runs save no checkpoints yet (Accelerate's save_state cannot save split weights); train "
    "without --checkpointing_steps and --resume_from_checkpoint, or with fsdp.yaml, whose checkpoints resume"
)


def refuse_checkpoint() -> None:
    """A stop on a signal saves a checkpoint: under TP there is none to save, said in one line."""
    if degree() > 1:
        raise RecipeError(f"a checkpoint was due (a stop on a signal): {NO_CHECKPOINTS}")


def load_kwargs(config, source: str) -> dict:
    """from_pretrained's arguments that split the model as it loads, after refusing in one line a model the degree
    cannot split: attention heads and key-value heads are whole on a process, and the model must name its split."""
    tp = degree()
    if tp == 1:
        return {}
    from accelerate.state import AcceleratorState

    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise RecipeError(
            f"--model_name_or_path {source}: {type(config).__name__} has no tensor-parallel plan "
            "(config.base_model_tp_plan is empty), so transformers cannot split it; train it with fsdp.yaml or "
            "zero3.yaml instead"
        )
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count and count % tp:
            fits = [d for d in range(2, count + 1) if count % d == 0 and heads % d == 0 and kv_heads % d == 0]
            raise RecipeError(
                f"--model_name_or_path {source}: its {count} {name.replace('num_', '').replace('_', ' ')} "
                f"({name}) do not divide into tensor-parallel degree {tp}; set parallelism_config_tp_size and "
                f"--num_processes to {' or '.join(map(str, fits)) or '1 (no TP)'}, or use fsdp.yaml"
            )
    return {"tp_plan": "auto", "device_mesh": AcceleratorState().device_mesh["tp"]}


def data_parallel_size(accelerator) -> int:
    """The processes that see different batches: under TP a group of `degree()` sees one batch together."""
    return accelerator.num_processes // degree()


def whole(state_dict: dict) -> dict:
    """The state dict with each TP-split weight (a DTensor) gathered whole, as save_pretrained writes it."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state_dict.items()}


@contextlib.contextmanager
def saved_by_one_process(model):
    """Around a save_pretrained on the main process alone with `whole` weights: transformers reads the model's
    config.distributed_config (set by from_pretrained(tp_plan=...)) to gather the weights and then wait at a barrier
    for every process, which a save by one process would never pass. The weights are whole already: it is set aside
    meanwhile (config.json never holds it)."""
    config = getattr(model, "config", None)
    held = getattr(config, "distributed_config", None)
    if held is None:
        yield
        return
    config.distributed_config = None
    try:
        yield
    finally:
        config.distributed_config = held
