"""Tensor parallelism (accelerate_configs/tp.yaml): each layer's weights split over the processes of a node, the
processes seeing the same batches. Accelerate reads the TP degree from the config's `parallelism_config:` keys
(`accelerate launch` passes them on as PARALLELISM_CONFIG_* variables) and transformers splits the model as it loads
it (`from_pretrained(tp_plan="auto", device_mesh=...)`, the model's own `base_model_tp_plan`). What the recipes'
bookkeeping needs to know is here: the degree asked, how many processes see different data, the saved weights made
whole, and checkpoints of the split model and its optimizer (what TP cannot train here is refused before the group
forms: common.preflight.unsplittable).

With more processes than the degree (the 2-D case: a mesh of dp_shard x tp, `./launch.sh --config tp --num_processes
4` gives 2 x 2) each TP group of a node is one data-parallel rank, and FSDP2 shards the split model across the groups
as it loads (`split_and_sharded`: transformers' DistributedConfig with tp_size and fsdp_size). Accelerate 1.15 would
shard it in `prepare` under an FSDP config, but there its TP preparation imports transformers' ReplicateParallel,
which transformers 5.24 no longer has: so tp.yaml stays without FSDP, and `prepare` (which neither wraps a TP model in
DDP nor shards it) keeps the Accelerator for the mesh, the data loaders (the processes of a TP group get the same
batches), the optimizer and clipping (its DTensor-aware norm over the model's meshes)."""

from __future__ import annotations

import contextlib

from . import mesh
from .runtime import RecipeError


def degree() -> int:
    """The tensor-parallel degree the accelerate config asks for (1: none)."""
    return (mesh.from_environment() or {}).get("tp", 1)  # a size that is not a number: refused there


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
            "zero3.yaml instead",
            subject="--model_name_or_path",
        )
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count and count % tp:
            fits = [d for d in range(2, count + 1) if count % d == 0 and heads % d == 0 and kv_heads % d == 0]
            raise RecipeError(
                f"--model_name_or_path {source}: its {count} {name.replace('num_', '').replace('_', ' ')} "
                f"({name}) do not divide into tensor-parallel degree {tp}; set parallelism_config_tp_size and "
                f"--num_processes to {' or '.join(map(str, fits)) or '1 (no TP)'}, or use fsdp.yaml",
                subject="--model_name_or_path",
            )
    if (across := mesh.from_environment()["dp_shard"]) > 1:  # the 2-D case: see the module's note
        return {"distributed_config": split_and_sharded(tp, across)}
    return {"tp_plan": "auto", "device_mesh": AcceleratorState().device_mesh["tp"]}


def split_and_sharded(tp: int, across: int):
    """transformers' DistributedConfig that splits each layer over `tp` processes and shards the split model with
    FSDP2 over `across` TP groups (the model's FSDP plan: each decoder layer, then the root). transformers builds the
    mesh itself (pp x dp_replicate x fsdp x tp, 1 x 1 x across x tp): the same processes in the same order as
    Accelerate's dp_shard x tp, which deals the batches (a `device_mesh` passed to from_pretrained with a `tp_plan`
    is replaced by one over every process in transformers 5.24)."""
    try:
        from transformers import DistributedConfig
    except ImportError:
        import transformers

        raise RecipeError(
            f"tensor parallelism with FSDP2 across {across} TP groups needs transformers' DistributedConfig, which "
            f"transformers {transformers.__version__} does not have; pip install 'transformers>=5.24'"
        ) from None
    return DistributedConfig(tp_plan="auto", tp_size=tp, fsdp_size=across)


def shards_in_place(model):
    """The model with each FSDP2 group's shards as its parameters, before an optimizer is made from them. transformers
    5.24's FSDP plan keeps one group whole from forward to backward (the final norm with lm_head: keep_full_weight),
    and a forward without a backward (load_causal_lm's is_causal check) leaves it gathered: model.parameters() are
    then gathered copies, which FSDP2 swaps for its shards at the first backward, and an optimizer made from them
    never updates the final norm or lm_head (measured: both untrained after 6 steps). FSDPModule.reshard() (torch's
    public API) puts the shards back."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def gather_for_metrics(accelerator, tensors):
    """accelerator.gather_for_metrics where TP groups share their batches: every process's blocks gathered, those of
    the first process of each TP group kept (in data-parallel order, as the loaders deal them), and the blocks the
    loader repeated to even out its last batch dropped (`remainder`, as Accelerate drops them). Accelerate's own
    would count each block once per process of a group."""
    if data_parallel_size(accelerator) == 1:  # one process, or one TP group: every block is here already
        return tensors
    if degree() == 1:
        return accelerator.gather_for_metrics(tensors)
    device_mesh = accelerator.torch_device_mesh
    firsts = sorted(device_mesh.mesh.select(device_mesh.mesh_dim_names.index("tp"), 0).flatten().tolist())
    state = accelerator.gradient_state
    kept = []
    for tensor in tensors:
        every = accelerator.gather(tensor).reshape(accelerator.num_processes, *tensor.shape)
        kept.append(every[firsts].flatten(0, 1))
        if state.end_of_dataloader and state.remainder > 0:
            kept[-1] = kept[-1][: state.remainder]
    return type(tensors)(kept)


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


# Checkpoints ---------------------------------------------------------------------------------------------------------
# Accelerate 1.15's save_state cannot save split weights (accelerate.utils.modeling's id_tensor_storage fails on a
# DTensor), and its optimizer.bin would hold the main process's halves alone. Under TP the model and optimizer states
# go through torch's distributed checkpoint (DCP) instead: each process writes its halves, and a load reshards them
# into whatever the loading run holds, split over any degree or whole in one process. The rest of the checkpoint (the
# RNG states, then the marker common.checkpoint writes) is what Accelerate writes for every other layout.

LAYOUT = "TP"  # the checkpoint's `layout` (common.checkpoint): the model and optimizer state in SPLIT_STATE
SPLIT_STATE = "model_and_optimizer"  # DCP's folder in the checkpoint: .metadata and a __<rank>_0.distcp a process
WHOLE = ("DDP", LAYOUT)  # layouts each loads the other's: whole tensors split as they load, split ones gathered


def loads(saved: str, ours: str) -> bool:
    """Whether a run of layout `ours` loads a checkpoint of layout `saved` (FSDP's or ZeRO's shards, not)."""
    return saved == ours or (saved in WHOLE and ours in WHOLE)


def save_state(accelerator, model, optimizer, folder) -> None:
    """The model's and `optimizer`'s states into `folder`/SPLIT_STATE, every process its halves, then the RNG states
    as accelerator.save_state writes them (no scheduler or sampler state: the recipes keep the position and the rate
    in the checkpoint's marker)."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import save_accelerator_state

    if optimizer is None:
        raise ValueError("a tensor-parallel checkpoint needs the optimizer (TrainingLoop.steps(..., optimizer))")
    dcp.save(_states(model, optimizer), checkpoint_id=str(folder / SPLIT_STATE))
    save_accelerator_state(
        str(folder), [], [], [], [], accelerator.process_index, accelerator.step, accelerator.scaler,
        save_on_each_node=accelerator.project_configuration.save_on_each_node,
    )  # fmt: skip


def load_state(accelerator, model, optimizer, folder, split: bool) -> None:
    """Checkpoint `folder` into the prepared model and optimizer, split or whole: a TP checkpoint's (`split`) through
    DCP, which reshards; a DDP one's whole files (model.safetensors, optimizer.bin) each cut into this run's halves.
    Then the RNG states and the step, as accelerator.load_state restores them."""
    from accelerate.checkpointing import load_accelerator_state

    if split:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        states = _states(model, optimizer)
        dcp.load(states, checkpoint_id=str(folder / SPLIT_STATE))  # in place, into this run's tensors
        set_model_state_dict(model, states["model"])  # and what is no tensor (Adam's settings), as torch documents
        set_optimizer_state_dict(model, _unwrapped(optimizer), states["optimizer"])
    else:
        _load_whole(model, optimizer, folder)
    restored = load_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.scaler)
    if "step" in restored:
        accelerator.step = restored["step"]


def _states(model, optimizer) -> dict:
    """The model's and optimizer's states by parameter name, as this run holds them (DTensors under TP)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, _unwrapped(optimizer))}


def _unwrapped(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer holds torch's


def _load_whole(model, optimizer, folder) -> None:
    """A DDP checkpoint's whole states into the split model: the weights by name (without DDP's `module.` prefix),
    the optimizer's by position (torch numbers the parameters in the order of its groups, as this run's optimizer,
    made the same way, holds them), each tensor cut to this process's part as `_cut` does."""
    import re

    import torch
    from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights = {
        re.sub(r"^((module|_orig_mod)[.])+", "", k): v for k, v in load_file(folder / SAFE_WEIGHTS_NAME).items()
    }
    set_model_state_dict(model, {k: _cut(weights[k], ours) for k, ours in get_model_state_dict(model).items()})
    saved = torch.load(folder / f"{OPTIMIZER_NAME}.bin", map_location="cpu", weights_only=True)
    ours = get_optimizer_state_dict(model, _unwrapped(optimizer))  # its states made, as this run holds them
    names = [name for group in ours["param_groups"] for name in group["params"]]
    numbers = [n for group in saved["param_groups"] for n in group["params"]]
    if len(names) != len(numbers):
        raise ValueError(f"{OPTIMIZER_NAME}.bin holds {len(numbers)} parameters' states, this model has {len(names)}")
    name_of = dict(zip(numbers, names))
    by_name = {
        "state": {
            name_of[n]: {key: _cut(value, ours["state"][name_of[n]].get(key)) for key, value in state.items()}
            for n, state in saved["state"].items()
        },
        "param_groups": [
            {**group, "params": [name_of[n] for n in group["params"]]} for group in saved["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, _unwrapped(optimizer), by_name)


def _cut(whole, ours):
    """`whole` laid out as this run's tensor `ours`: split or sharded (a DTensor) as `ours` is, else as it is. Through
    a redistribution from a replicated copy: torch's distribute_tensor, which set_model_state_dict's full_state_dict
    option uses, fails on the 2-D mesh's _StridedShard placements (an AssertionError in torch 2.14)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(ours, DTensor):
        return whole
    mesh = ours.device_mesh
    replicated = DTensor.from_local(whole.to(ours.dtype), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, ours.placements)
