"""What a run reports: peak memory, library versions, and results.json."""

from __future__ import annotations

import math
import resource
import sys
from pathlib import Path

import torch

from .args import public_args
from .checkpoint import write_json
from .runtime import library_versions


def count_parameters(model, trainable_only=False) -> int:
    """Parameter count, also under ZeRO-3, where each process holds only a shard (`ds_numel` is the full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable_only)


def parameters_per_process(accelerator, model) -> list:
    """Parameter elements each process holds: all of them under DDP, about 1/N under ZeRO-3 or FSDP."""
    local = sum(
        p.ds_tensor.numel()
        if hasattr(p, "ds_tensor")
        else p.to_local().numel()
        if hasattr(p, "to_local")
        else p.numel()
        for p in model.parameters()
    )
    return accelerator.gather(torch.tensor([local], device=accelerator.device)).tolist()


# Dense bf16 tensor-core peak per GPU (vendor datasheets, SXM parts), for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def mfu(accelerator, tokens_per_second: float, flops_per_token: float):
    """Model FLOPs utilisation: achieved training FLOP/s over the devices' peak, or None where the
    peak is unknown (CPU, unlisted GPUs)."""
    if accelerator.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(accelerator.device)
    peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
    return None if peak is None else tokens_per_second * flops_per_token / (peak * accelerator.num_processes)


def peak_memory_gb(accelerator) -> dict:
    """Peak memory of every process: the accelerator's allocator on GPU, the resident set on CPU.

    Gathered, so the record shows the most loaded device, not just process 0.
    """
    if accelerator.device.type == "cuda":
        kind, value = "cuda_max_allocated", torch.cuda.max_memory_allocated(accelerator.device) / 2**30
    else:
        scale = 2**30 if sys.platform == "darwin" else 2**20  # ru_maxrss: bytes on macOS, KiB on Linux
        kind, value = "host_max_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale
    per_process = accelerator.gather(torch.tensor([value], device=accelerator.device)).tolist()
    return {
        "peak_memory_gb": round(max(per_process), 3),
        "peak_memory_gb_per_process": [round(v, 3) for v in per_process],
        "peak_memory_kind": kind,
    }


def tracker_config(args) -> dict:
    """public_args in the plain types every tracker takes (tensorboard's hparams take no lists)."""
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in public_args(args).items()}


def write_results(accelerator, args, plan, **metrics) -> Path:
    """results.json in --output_dir, from the main process, written atomically: what every run
    reports (processes, distributed type, precision, effective batch, learning rate, peak memory of
    every process, library versions, the arguments) and the recipe's own `metrics`. A number that is
    not finite is written as null: JSON has no NaN."""
    dist = torch.distributed
    record = {
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "effective_batch_size": plan.effective_batch_size,
        "learning_rate": plan.learning_rate,
        "max_train_steps": plan.max_train_steps,
        **metrics,
        **peak_memory_gb(accelerator),  # a gather: every process takes part
        "versions": library_versions(),
        "args": public_args(args),
    }
    path = Path(args.output_dir) / "results.json"
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, _finite(record))
    accelerator.wait_for_everyone()
    return path


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
