"""Batch arithmetic, learning-rate scaling and the warmup + decay schedule.

Learning rates are stated for a reference batch (`--reference_batch_size`) and converted here,
once, to the effective batch the launch actually produces, so the same command line means the
same training on 1 GPU or 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import get_scheduler

from .runtime import RecipeError, logger

LR_SCALING_RULES = ("linear", "sqrt", "none")


def effective_batch_size(per_device_batch_size: int, num_processes: int, gradient_accumulation_steps: int) -> int:
    """Samples that contribute to one optimizer step."""
    return per_device_batch_size * num_processes * gradient_accumulation_steps


def scale_lr(learning_rate: float, batch_size: int, reference_batch_size: int, rule: str) -> float:
    """`linear`: lr x batch/reference (Goyal et al., 2017); `sqrt`: lr x sqrt(batch/reference),
    common for Adam; `none`: lr unchanged."""
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"unknown lr scaling rule {rule!r}; choose from {', '.join(LR_SCALING_RULES)}")
    if rule == "none":
        return learning_rate
    ratio = batch_size / reference_batch_size
    return learning_rate * (ratio if rule == "linear" else math.sqrt(ratio))


@dataclass(frozen=True)
class TrainingPlan:
    effective_batch_size: int
    learning_rate: float
    steps_per_epoch: int  # optimizer steps
    max_train_steps: int
    num_epochs: int
    warmup_steps: int


def plan_training(
    *,
    num_batches: int,
    per_device_batch_size: int,
    num_processes: int,
    gradient_accumulation_steps: int,
    learning_rate: float,
    reference_batch_size: int,
    lr_scaling: str,
    num_train_epochs: int,
    max_train_steps: int | None = None,
    warmup_steps: int | None = None,
    warmup_ratio: float = 0.0,
) -> TrainingPlan:
    """Everything the loop needs to know in advance, from the *unprepared* training loader.

    `num_batches` is `len(train_dataloader)` before `accelerator.prepare` (batches of
    `per_device_batch_size`, last partial batch dropped). Accelerate deals those batches out
    round-robin and drops an incomplete round, so each process gets num_batches // num_processes;
    an optimizer step closes every `gradient_accumulation_steps` batches and at the end of the
    epoch. The plan is computed before prepare because DeepSpeed needs the loaders, model and
    optimizer in one prepare call.
    """
    per_process = num_batches // num_processes
    if per_process == 0:
        raise RecipeError(
            f"the training set holds {num_batches} batch(es) of {per_device_batch_size}, fewer than "
            f"the {num_processes} process(es); lower --per_device_train_batch_size or use more data"
        )
    steps_per_epoch = math.ceil(per_process / gradient_accumulation_steps)
    if max_train_steps is None:
        max_train_steps = steps_per_epoch * num_train_epochs
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    batch = effective_batch_size(per_device_batch_size, num_processes, gradient_accumulation_steps)
    if warmup_steps is None:
        warmup_steps = math.ceil(warmup_ratio * max_train_steps)
    return TrainingPlan(
        effective_batch_size=batch,
        learning_rate=scale_lr(learning_rate, batch, reference_batch_size, lr_scaling),
        steps_per_epoch=steps_per_epoch,
        max_train_steps=max_train_steps,
        num_epochs=num_epochs,
        warmup_steps=warmup_steps,
    )


def plan_from_args(args, num_batches: int, num_processes: int) -> TrainingPlan:
    """plan_training with the shared training arguments (common.training_parser), logged once."""
    plan = plan_training(
        num_batches=num_batches, per_device_batch_size=args.per_device_train_batch_size, num_processes=num_processes,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
        reference_batch_size=args.reference_batch_size, lr_scaling=args.lr_scaling, num_train_epochs=args.num_train_epochs,
        max_train_steps=args.max_train_steps, warmup_steps=args.warmup_steps, warmup_ratio=args.warmup_ratio)
    logger.info(f"{num_processes} process(es) x {args.per_device_train_batch_size} per device x "
                f"{args.gradient_accumulation_steps} accumulation = effective batch {plan.effective_batch_size}; "
                f"learning rate {args.learning_rate} at batch {args.reference_batch_size} -> {plan.learning_rate:.4g} "
                f"({args.lr_scaling}); {plan.max_train_steps} steps of which {plan.warmup_steps} warmup")
    return plan


def make_scheduler(optimizer, name: str, plan: TrainingPlan):
    """transformers' schedule `name` (cosine, linear, constant_with_warmup, ...), counted in
    optimizer steps: the recipe steps it once per optimizer step, whatever the process count."""
    return get_scheduler(
        name, optimizer, num_warmup_steps=plan.warmup_steps, num_training_steps=plan.max_train_steps
    )


def decay_groups(model, weight_decay: float) -> list:
    """Optimizer parameter groups: weight decay on matrices and kernels, none on biases and
    normalisation weights (decaying those only pulls activations' scale toward zero)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = lambda p: len(getattr(p, "ds_shape", p.shape))  # noqa: E731  ZeRO-3 leaves an empty placeholder in p
    groups = [
        {"params": [p for p in params if ndim(p) > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if ndim(p) <= 1], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]  # DeepSpeed drops empty groups; the scheduler must not see them
