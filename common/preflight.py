"""The launch and environment refusals, written once: each rule is a pure function of what it reads (the environment
mapping, the GPUs visible, the installed versions) that returns the refusal, a RecipeError naming its subject (the
variable as "$RANK", the option, the config's key), or None. make_accelerator runs them all (`check`) before any
process group forms; launch.sh's launcher (scripts/launcher.py) calls those that apply before it starts anything, so
both refuse the same inputs with the same line. Imports no torch: the launcher answers in milliseconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import mesh
from .errors import RecipeError

LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR")  # every launcher of a group sets them all


def flag(environ, name: str) -> bool:
    """An environment variable as accelerate reads a flag (parse_flag_from_env): 1, true, yes or on."""
    return environ.get(name, "").lower() in ("1", "true", "yes", "y", "on", "t")


def stale_ranks(environ) -> RecipeError | None:
    """A rank's variables set with no launcher around them (left from another job): torch would fail, or wait for a
    group that never forms."""
    ranks = [f"{name}={environ[name]}" for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if name in environ]
    missing = [name for name in LAUNCHER_VARIABLES if not environ.get(name)]
    if not (ranks and missing):
        return None
    names = [rank.partition("=")[0] for rank in ranks]
    return RecipeError(
        f"{' '.join(ranks)} {'is' if len(ranks) == 1 else 'are'} set, but no launcher started this process as one of "
        f"a group (no {' or '.join(missing)}): left from another job? unset {' and '.join(names)}, and start the "
        "processes with ./launch.sh or accelerate launch",
        subject=f"${names[0]}",
        same_on_every_rank=False,  # RANK is as stale: no process takes itself for rank 0
    )


def known_bad_torch(processes: int, torch_version: str, fsdp_on_cpu: bool) -> RecipeError | None:
    """A torch that would not fail but hang or train wrong, refused also when pip was told to ignore pyproject's
    floors. FSDP2 asks gloo for a reduce-scatter with ReduceOp.AVG, which gloo sums without a word before torch 2.9:
    on CPU every step would take N times the mean gradient (AdamW hides most of it: tests/test_fsdp.py's 2 x 2 run
    ended 5.5e-4 of the update off in 6 steps). NCCL averages: on GPUs torch 2.8 trains right."""
    from packaging.version import Version

    release = Version(torch_version).release
    if processes > 1 and release < (2, 8):
        return RecipeError(
            f"torch {torch_version} is installed, and with it a job of several processes hangs at exit in "
            "destroy_process_group; pip install 'torch>=2.8' (pyproject.toml lists the tested versions)"
        )
    if processes > 1 and fsdp_on_cpu and release < (2, 9):
        return RecipeError(
            f"torch {torch_version} is installed, and with it FSDP2 on CPU trains on the sum of the processes' "
            "gradients, not their mean (gloo's reduce-scatter ignores ReduceOp.AVG before torch 2.9); pip install "
            "'torch>=2.9', or shard with DeepSpeed instead: ./launch.sh --config zero3"
        )
    return None


def mesh_sizes(environ, processes: int, accelerate_version: str, args=None) -> RecipeError | None:
    """The mesh accelerate launch passed on (an N-D parallelism_config): sizes that are numbers, a mesh these recipes
    train right (with `args`, the recipe's arguments), covering the job's processes, on an accelerate it was tested
    with (accelerate would refuse the rest only after the group formed, or fail)."""
    try:
        sizes = mesh.from_environment(environ)
    except RecipeError as refusal:  # a size that is not a number
        return refusal
    if not sizes:
        return None
    if refusal := unbuilt_mesh(sizes) or unsplittable(sizes, flag(environ, "ACCELERATE_USE_FSDP"), args):
        return refusal
    if problem := mesh.mismatch(sizes, processes):
        return RecipeError(problem, subject=re.search(r"pass (--\S+)", problem)[1])  # the option its fix changes first
    return untested_mesh(sizes, accelerate_version)


def untested_mesh(sizes: dict, accelerate_version: str) -> RecipeError | None:
    """A 2-D mesh on an accelerate older than the one it was tested with (mesh.untested_accelerate): launch.sh says it
    before it starts the job, the processes of a plain accelerate launch before the model loads."""
    problem = mesh.untested_accelerate(sizes, accelerate_version)
    return RecipeError(problem) if problem else None


def unbuilt_mesh(sizes: dict) -> RecipeError | None:
    """A mesh these recipes do not train right (mesh.not_built: context parallelism)."""
    problem = mesh.not_built(sizes)
    return RecipeError(problem, subject="parallelism_config_cp_size") if problem else None


def unsplittable(sizes: dict, fsdp: bool, args=None) -> RecipeError | None:
    """What a mesh with tensor parallelism (tp above 1) cannot train here: with an FSDP config, replicas beside it
    (dp_shard x tp alone is built and tested), a new model from --config_name (transformers splits a model as
    from_pretrained loads it), a LoRA adapter (`args`: the recipe's arguments, None where they are not known)."""
    if sizes["tp"] == 1:
        return None
    if fsdp:  # see common.tensor_parallel's note
        return RecipeError(
            "an FSDP accelerate config with parallelism_config_tp_size: Accelerate 1.15's FSDP2 preparation of a "
            "tensor-parallel model fails (it imports transformers' ReplicateParallel, gone in transformers 5.24); "
            "use accelerate_configs/tp.yaml, whose runs shard the model with FSDP2 across the TP groups themselves",
            subject="parallelism_config_tp_size",
        )
    if sizes["dp_replicate"] > 1:
        return RecipeError(
            f"the accelerate config's mesh is {mesh.describe(sizes)}: with tensor parallelism only FSDP2 across the "
            "TP groups (dp_shard x tp) runs here; set parallelism_config_dp_replicate_size to 1, or use hsdp.yaml "
            "without tensor parallelism",
            subject="parallelism_config_dp_replicate_size",
        )
    if getattr(args, "config_name", None) and not getattr(args, "model_name_or_path", None):
        return RecipeError(
            "--config_name under tensor parallelism: transformers splits a model as from_pretrained loads it, and "
            "a new model is built from its config; save the new model once (save_pretrained) and pass its folder "
            "as --model_name_or_path, or use fsdp.yaml",
            subject="--config_name",
        )
    if getattr(args, "lora_r", 0):
        return RecipeError(
            "--lora_r under tensor parallelism: peft's adapters do not fit the layers transformers splits (their "
            "first forward fails on the split shapes); train the whole model under tp.yaml, or LoRA with fsdp.yaml",
            subject="--lora_r",
        )
    return None


def more_processes_than_gpus(processes: int, gpus: int, on_cpu: bool) -> RecipeError | None:
    """More processes on this node than GPUs visible, where they are to run on GPUs: else each process past the last
    GPU fails with 'invalid device ordinal', or a GPU config on a host without GPUs starts nothing useful."""
    if on_cpu or processes <= gpus:
        return None
    fix = f"pass --num_processes {gpus} or a config for {gpus} GPU(s), or check CUDA_VISIBLE_DEVICES" if gpus else (
        "use --config cpu"
    )  # fmt: skip
    return RecipeError(
        f"{processes} processes requested on this node but only {gpus} GPU(s) are visible", fix,
        subject="--num_processes",
    )  # fmt: skip


def sharding_left_out_on_cpu(environ, gpus: int) -> RecipeError | None:
    """A DeepSpeed or FSDP config under ACCELERATE_USE_CPU=true, which Accelerate would set up as plain CPU processes
    without a word: it applies DeepSpeed only off the CPU flag, and FSDP there only on a host without GPUs (where
    runtime.fsdp_on_cpu presents the gloo group as a GPU group)."""
    if not flag(environ, "ACCELERATE_USE_CPU"):
        return None
    for name, asked in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED")):
        if flag(environ, asked) and (name == "DEEPSPEED" or gpus):
            return RecipeError(  # the variable runtime's "formed no group" line sends users to set
                f"the accelerate config asks for {name}, which Accelerate leaves out under ACCELERATE_USE_CPU=true; "
                f"unset it: {name} runs on CPU without it (./launch.sh --config "
                f"{'zero3' if name == 'DEEPSPEED' else 'fsdp'})",
                subject="$ACCELERATE_USE_CPU",
            )
    return None


def fp16_on_cpu(precision: str, on_cpu: bool, deepspeed_file: str | None) -> RecipeError | None:
    """Mixed precision fp16 on the CPU, which Accelerate trains in fp32 while reporting fp16. `precision` is what
    accelerate launch passed on (--mixed_precision, the config's); under DeepSpeed a config file's fp16 section
    (`deepspeed_file`) decides instead, unless it leaves it to --mixed_precision ("auto")."""
    enabled = _deepspeed_fp16(deepspeed_file) if deepspeed_file else None
    if not on_cpu or not (enabled is True or (enabled in (None, "auto") and precision == "fp16")):
        return None
    if enabled is True:  # the file decides: --mixed_precision cannot turn it off
        fix = f'set fp16\'s "enabled" to false (or "auto") in the DeepSpeed config file {deepspeed_file}'
    else:
        fix = "pass --mixed_precision bf16 (or no) to accelerate launch, or set it in the config"
    return RecipeError(
        f"mixed precision fp16 needs a GPU: on CPU Accelerate trains in fp32 and would still report fp16; {fix}",
        subject=deepspeed_file if enabled is True else "--mixed_precision",
    )


def _deepspeed_fp16(path: str):
    """A DeepSpeed JSON config file's fp16 "enabled" (True, False or "auto"), or None where it says none (or the file
    cannot be read: DeepSpeed's own refusal is said later)."""
    try:
        return (_deepspeed_file(path) or {}).get("fp16", {}).get("enabled")
    except AttributeError:  # an fp16 that is no section
        return None


def _deepspeed_file(path: str) -> dict | None:
    """A DeepSpeed JSON config file, read; None if it cannot be read or holds no object (DeepSpeed refuses it later,
    in its words)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def deepspeed_config(environ) -> dict | None:
    """The DeepSpeed config Accelerate's plugin will start from, as accelerate launch passed it on ("auto" not yet
    filled): the config file it names, read, or the accelerate config's own deepspeed_config settings; None without
    DeepSpeed, or for a file that cannot be read (DeepSpeed refuses it later, in its words)."""
    if not flag(environ, "ACCELERATE_USE_DEEPSPEED") or flag(environ, "ACCELERATE_USE_CPU"):
        return None
    if path := environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        config = _deepspeed_file(path)
        return {"gradient_accumulation_steps": 1, **config} if config is not None else None  # Accelerate's 1
    steps = environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
    stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    gather = environ.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true"
    config = {
        "gradient_accumulation_steps": int(steps) if steps.isdigit() else steps,
        "zero_optimization": {"stage": int(stage) if stage.isdigit() else stage},
    }
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    try:  # Accelerate sets a clipping of 0 as none
        if clipping := float(environ.get("ACCELERATE_GRADIENT_CLIPPING", "0")):
            config["gradient_clipping"] = clipping
    except ValueError:  # "auto", or what Accelerate's float() refuses in its words
        pass
    return config


def deepspeed_settings(args, processes: int) -> list[tuple[str, object, str]]:
    """(key, the recipe's value, the flag that sets it) of each DeepSpeed setting the recipe's flags decide."""
    batch, k = args.per_device_train_batch_size, args.gradient_accumulation_steps
    effective = f"batch ({batch} per device x {processes} processes x {k} accumulation)"
    return [
        ("gradient_accumulation_steps", k, "--gradient_accumulation_steps"),
        ("train_micro_batch_size_per_gpu", batch, "--per_device_train_batch_size"),
        ("train_batch_size", batch * processes * k, effective),
        ("gradient_clipping", args.max_grad_norm, "--max_grad_norm"),
    ]


def deepspeed_against_arguments(config: dict, args, processes: int) -> RecipeError | None:
    """A DeepSpeed config whose batch, accumulation or clipping is not the recipe's flags' ("auto" or absent is
    theirs): DeepSpeed's own settings win over Accelerate's, so one would train what the other reported. ZeRO-3
    without the 16-bit gather too: the training would run to its end, and then accelerate would refuse to gather the
    weights to save them."""
    for key, value, option in deepspeed_settings(args, processes):
        if config.get(key, "auto") not in ("auto", value):
            fix = f"pass {option} {config[key]}" if option.startswith("--") else "pass flags that make it"
            return RecipeError(
                f"the DeepSpeed config sets {key}={config[key]} but the recipe's {option} is {value}; remove it "
                f'from the config or set it to "auto" (the recipe\'s value is then used), or {fix}',
                subject=option if option.startswith("--") else key,
            )
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        return RecipeError(
            "under ZeRO-3 the final save gathers the weights only with zero3_save_16bit_model: true in the "
            "accelerate config's deepspeed_config (stage3_gather_16bit_weights_on_model_save in a DeepSpeed "
            "config file); set it, as accelerate_configs/zero3.yaml does",
            subject="zero3_save_16bit_model",
        )
    return None


def refusals(environ, gpus: int, versions: dict, args=None) -> list[RecipeError]:
    """Every refusal of a process about to join a job, as the launcher started it (`environ`), with `gpus` visible
    and `versions` ({"torch": ..., "accelerate": ...}) installed, running a recipe with `args` (its parsed arguments,
    which a DeepSpeed config must agree with); in the order they are said."""
    processes = int(environ.get("WORLD_SIZE", "1"))
    on_cpu = flag(environ, "ACCELERATE_USE_CPU") or gpus == 0  # the config's use_cpu, as accelerate launch passes it
    deepspeed = flag(environ, "ACCELERATE_USE_DEEPSPEED") and not flag(environ, "ACCELERATE_USE_CPU")
    deepspeed_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if deepspeed else None  # its fp16 decides
    found = [
        known_bad_torch(processes, versions["torch"], flag(environ, "ACCELERATE_USE_FSDP") and gpus == 0),
        stale_ranks(environ),
        mesh_sizes(environ, processes, versions["accelerate"], args),
        more_processes_than_gpus(int(environ.get("LOCAL_WORLD_SIZE", "1")), gpus, on_cpu),
        sharding_left_out_on_cpu(environ, gpus),
        fp16_on_cpu(environ.get("ACCELERATE_MIXED_PRECISION", "no"), on_cpu, deepspeed_file),
    ]
    if args is not None and (config := deepspeed_config(environ)) is not None:
        found.append(deepspeed_against_arguments(config, args, processes))
    return [refusal for refusal in found if refusal is not None]


def check(environ, gpus: int, versions: dict, args=None) -> None:
    """Raise the first of `refusals`."""
    if found := refusals(environ, gpus, versions, args):
        raise found[0]
