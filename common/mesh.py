"""The device mesh of an N-D parallel accelerate config (its `parallelism_config:`): HSDP shards a model within a group
of processes and replicates it across groups; tensor parallelism splits each layer. Read once, sized to a job's
nodes and processes, and checked against the processes that started. Imports no torch: launch.sh and the doctor use
it before any process starts, the recipes before the Accelerator is built."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

from .errors import RecipeError

DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "cp")  # accelerate's ParallelismConfig sizes, outermost first
TESTED_ACCELERATE = (1, 15)  # HSDP and TP on parallelism_config: 1.10's FSDP2 cannot load weights on a 2-D mesh
LAUNCH_OPTION = "--parallelism_config_{}_size"  # accelerate launch's option for a dimension (it overrides the YAML's)
ENV = "PARALLELISM_CONFIG_{}_SIZE"  # how accelerate launch passes each size on to the processes


def from_config(yaml_config: dict) -> dict | None:
    """The sizes an accelerate YAML's `parallelism_config:` sets (1 where it is silent), or None without one."""
    section = yaml_config.get("parallelism_config") or {}
    if not section:
        return None
    return {dim: int(section.get(f"parallelism_config_{dim}_size", 1) or 1) for dim in DIMENSIONS}


def from_environment(environ=os.environ) -> dict | None:
    """The sizes accelerate launch passed on to this process, or None when the config has no parallelism_config."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() not in ("1", "true", "yes"):
        return None
    sizes = {dim: environ.get(ENV.format(dim.upper()), "1") or "1" for dim in DIMENSIONS}
    if bad := [dim for dim, size in sizes.items() if not size.isdigit() or int(size) < 1]:
        # refused here, before accelerate's own int() would be a traceback
        raise RecipeError(
            f"the accelerate config's parallelism_config_{bad[0]}_size is {sizes[bad[0]]!r}: its sizes must be whole "
            "numbers of processes, as accelerate_configs/tp.yaml sets them",
            subject=f"parallelism_config_{bad[0]}_size",
        )
    return {dim: int(size) for dim, size in sizes.items()}


def describe(mesh: dict) -> str:
    """'2 x 4 (dp_replicate x dp_shard)': the dimensions larger than one, outermost first."""
    used = [dim for dim in DIMENSIONS if mesh[dim] > 1] or ["dp_shard"]
    return f"{' x '.join(str(mesh[d]) for d in used)} ({' x '.join(used)})"


def data_parallel_size(mesh: dict) -> int:
    """The processes that each see other data: tensor-parallel ranks share their batch."""
    return mesh["dp_replicate"] * mesh["dp_shard"]


class Fit(NamedTuple):
    """A mesh for a job; when none fits, what is wrong and the processes per node that would fit (the fix)."""

    mesh: dict
    problem: str | None = None
    per_node: int | None = None


def fitted(mesh: dict, nodes: int, per_node: int) -> Fit:
    """The config's mesh sized to a job of `nodes` x `per_node` processes. Tensor parallelism stays within a node (its
    collectives run at every layer); across several nodes HSDP replicates once a node and shards within it; the shard
    dimension takes the processes that are left, and HSDP needs at least 2 of them (one is plain data parallelism)."""
    mesh = dict(mesh)
    if nodes > 1 and mesh["dp_replicate"] > 1:
        mesh["dp_replicate"] = nodes
    within = mesh["tp"] * (mesh["dp_replicate"] if nodes == 1 else 1) * mesh["cp"]  # the processes one shard needs
    least = 2 if mesh["dp_replicate"] > 1 else 1  # processes in a shard group
    better = within * max(least, round(per_node / within))
    if mesh["tp"] > 1 and per_node % mesh["tp"]:
        why = f"tensor parallelism of {mesh['tp']} must divide the {per_node} processes of a node (a layer's split "
        return Fit(mesh, why + "across nodes would cross the network at every layer)", better)
    if per_node % within:
        why = f"{within}, the processes of a shard group's replicas and splits (dp_replicate x tp x cp), must divide"
        return Fit(mesh, f"{why} the {per_node} processes of a node", better)
    mesh["dp_shard"] = nodes * per_node // (mesh["dp_replicate"] * mesh["tp"] * mesh["cp"])
    if mesh["dp_shard"] < least:
        why = f"{nodes * per_node} processes in {mesh['dp_replicate']} replicas leave one process a shard"
        return Fit(mesh, f"{why}, which is plain data parallelism", better)
    return Fit(mesh)


def options(mesh: dict) -> list[str]:
    """accelerate launch's options for a mesh (they override the YAML's)."""
    return [word for dim in DIMENSIONS for word in (LAUNCH_OPTION.format(dim), str(mesh[dim]))]


def mismatch(mesh: dict, processes: int) -> str | None:
    """What is wrong when a mesh does not cover the job's processes exactly (accelerate would refuse it after the
    group has formed, in a line that names no option), with the options that make it fit."""
    total = math.prod(mesh.values())
    if total == processes:
        return None
    fit = fitted(mesh, 1, processes)
    fix = fitted(mesh, 1, fit.per_node).mesh if fit.problem else fit.mesh
    change = [f"--num_processes {fit.per_node}"] if fit.problem else []
    change += [f"{LAUNCH_OPTION.format(d)} {fix[d]}" for d in DIMENSIONS if fix[d] != mesh[d]]
    also = f", and {fit.problem}" if fit.problem else ""
    return (
        f"the accelerate config's parallelism_config is a mesh of {describe(mesh)} = {total} processes, but this job "
        f"has {processes}{also}: pass {' '.join(change)} to accelerate launch, or start it with ./launch.sh, which "
        "sizes the mesh to the job"
    )


def not_built(mesh: dict) -> str | None:
    """What is wrong with a mesh these recipes do not train right: context parallelism needs each batch's sequences
    split across the cp processes (accelerate's maybe_context_parallel around every forward), which no recipe does,
    so each cp process would train the whole sequences again."""
    if mesh["cp"] > 1:
        return (
            f"the accelerate config's parallelism_config_cp_size is {mesh['cp']}: context parallelism is not built "
            "into these recipes (their forward does not split sequences); set it to 1, and for long sequences use "
            "--gradient_checkpointing or tensor parallelism (tp.yaml)"
        )
    return None


def untested_accelerate(mesh: dict, installed: str) -> str | None:
    """What is wrong when the installed accelerate is older than the one HSDP and tensor parallelism were tested with
    (accelerate 1.10's FSDP2 fails on a 2-D mesh, in a traceback, after the model has loaded)."""
    from packaging.version import Version

    if (mesh["dp_replicate"] > 1 or mesh["tp"] > 1) and Version(installed).release < TESTED_ACCELERATE:
        tested = ".".join(map(str, TESTED_ACCELERATE))
        return (
            f"accelerate {installed} is installed, and the config's mesh of {describe(mesh)} is tested with "
            f"accelerate {tested} and later (1.10's FSDP2 fails on a 2-D mesh); pip install 'accelerate>={tested}', "
            "or use --config fsdp"
        )
    return None
