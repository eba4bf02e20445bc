"""Batch arithmetic, learning-rate scaling and the warmup + decay schedule.

Learning rates are stated for a reference batch (`--reference_batch_size`) and converted here,
once, to the effective batch the launch actually produces, so the same command line means the
same training on 1 GPU or 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .args import LR_SCALING_RULES
from .runtime import RecipeError


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
    """What the loop needs to know in advance. The job's samples come in rounds of one batch per
    process (`round_samples`), an optimizer step takes up to `gradient_accumulation_steps` rounds, and
    an epoch's last step may take fewer (Accelerate steps at the end of the loader)."""

    num_samples: int  # in the training set
    per_device_batch_size: int
    num_processes: int
    gradient_accumulation_steps: int
    effective_batch_size: int
    learning_rate: float
    steps_per_epoch: int  # optimizer steps
    max_train_steps: int
    num_epochs: int
    warmup_steps: int
    total_samples: int  # what max_train_steps trains: the schedule's length
    warmup_samples: int

    @property
    def round_samples(self) -> int:
        return self.per_device_batch_size * self.num_processes

    @property
    def epoch_rounds(self) -> int:  # the incomplete last round of an epoch is dropped
        return self.num_samples // self.round_samples

    def samples_for_steps(self, steps: int) -> int:
        """Samples trained by the first `steps` optimizer steps of a run started at an epoch's start."""
        epochs, rest = divmod(steps, self.steps_per_epoch)
        rounds = epochs * self.epoch_rounds + min(rest * self.gradient_accumulation_steps, self.epoch_rounds)
        return rounds * self.round_samples

    def steps_from(self, epoch: int, sample: int, *, until_epoch: int | None = None, samples: int | None = None):
        """Walk the run forward from position `sample` of `epoch`: to the end of epoch `until_epoch - 1`,
        or until at least `samples` more samples are trained. Returns (optimizer steps, samples they
        train, the epoch after the last one trained in)."""
        steps = trained = 0
        while (until_epoch is None or epoch < until_epoch) and (samples is None or trained < samples):
            rounds = (self.num_samples - sample) // self.round_samples
            if samples is not None:  # whole steps, only as many as the budget needs
                needed_rounds = -(-(samples - trained) // self.round_samples)
                accumulation = self.gradient_accumulation_steps
                rounds = min(rounds, -(-needed_rounds // accumulation) * accumulation)
            steps += -(-rounds // self.gradient_accumulation_steps)
            trained += rounds * self.round_samples
            epoch, sample = epoch + 1, 0
        return steps, trained, epoch


def plan_training(
    *,
    num_samples: int,
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
    """The plan of a run that starts at step 0, from the size of the training set.

    Batches of `per_device_batch_size` are dealt round-robin to the processes and an incomplete
    round is dropped, so an epoch is num_samples // (batch x processes) rounds; an optimizer step
    closes every `gradient_accumulation_steps` rounds and at the end of the epoch. The plan is made
    before `accelerator.prepare` because DeepSpeed needs the loaders, model and optimizer in one call.
    """
    rounds = num_samples // (per_device_batch_size * num_processes)
    if rounds == 0:
        raise RecipeError(
            f"the training set holds {num_samples} samples, fewer than one batch of {per_device_batch_size} for each "
            f"of the {num_processes} process(es); lower --per_device_train_batch_size or use more data"
        )
    if gradient_accumulation_steps > rounds:  # a step would be the whole epoch, at a rate scaled for more
        raise RecipeError(
            f"the training set holds {num_samples} samples: {rounds} batch(es) of {per_device_batch_size} for each of "
            f"the {num_processes} process(es) an epoch, fewer than --gradient_accumulation_steps "
            f"{gradient_accumulation_steps}, so no optimizer step would see the effective batch of "
            f"{per_device_batch_size * num_processes * gradient_accumulation_steps} that the learning rate is scaled "
            f"for; lower --gradient_accumulation_steps to {rounds} or less"
        )
    steps_per_epoch = math.ceil(rounds / gradient_accumulation_steps)
    if max_train_steps is None:
        max_train_steps = steps_per_epoch * num_train_epochs
    if warmup_steps is None:
        warmup_steps = math.ceil(warmup_ratio * max_train_steps)
    batch = effective_batch_size(per_device_batch_size, num_processes, gradient_accumulation_steps)
    plan = TrainingPlan(
        num_samples=num_samples,
        per_device_batch_size=per_device_batch_size,
        num_processes=num_processes,
        gradient_accumulation_steps=gradient_accumulation_steps,
        effective_batch_size=batch,
        learning_rate=scale_lr(learning_rate, batch, reference_batch_size, lr_scaling),
        steps_per_epoch=steps_per_epoch,
        max_train_steps=max_train_steps,
        num_epochs=math.ceil(max_train_steps / steps_per_epoch),
        warmup_steps=warmup_steps,
        total_samples=0,
        warmup_samples=0,
    )
    return replace(
        plan,
        total_samples=plan.samples_for_steps(max_train_steps),
        warmup_samples=plan.samples_for_steps(warmup_steps),
    )


def plan_from_args(args, num_samples: int, num_processes: int) -> TrainingPlan:
    """plan_training with the shared training arguments (common.training_parser)."""
    return plan_training(
        num_samples=num_samples,
        per_device_batch_size=args.per_device_train_batch_size,
        num_processes=num_processes,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        reference_batch_size=args.reference_batch_size,
        lr_scaling=args.lr_scaling,
        num_train_epochs=args.num_train_epochs,
        max_train_steps=args.max_train_steps,
        warmup_steps=args.warmup_steps,
        warmup_ratio=args.warmup_ratio,
    )


def describe_plan(plan: TrainingPlan, args) -> str:
    return (
        f"{plan.num_processes} process(es) x {plan.per_device_batch_size} per device x "
        f"{plan.gradient_accumulation_steps} accumulation = effective batch {plan.effective_batch_size}; "
        f"learning rate {args.learning_rate} at batch {args.reference_batch_size} -> {plan.learning_rate:.4g} "
        f"({args.lr_scaling}); {plan.max_train_steps} steps of which {plan.warmup_steps} warmup"
    )


def make_scheduler(optimizer, name: str, plan: TrainingPlan, progress):
    """transformers' schedule `name` (cosine, linear, constant_with_warmup, ...) as a function of the
    samples trained so far (`progress.samples_seen`), not of the step count: a run resumed with another
    effective batch then continues the schedule where it was instead of replaying warmup or decay.
    The recipe steps it once per optimizer step, after counting the step's samples."""
    from transformers import get_scheduler  # here: importing transformers takes seconds a parse error need not wait

    schedule = get_scheduler(
        name, optimizer, num_warmup_steps=plan.warmup_samples, num_training_steps=plan.total_samples
    )
    schedule.lr_lambdas = [lambda _, by_samples=f: by_samples(progress.samples_seen) for f in schedule.lr_lambdas]
    return schedule


def decay_groups(model, weight_decay: float) -> list:
    """Optimizer parameter groups: weight decay on matrices and kernels, none on biases and
    normalisation weights (decaying those only pulls activations' scale toward zero)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = lambda p: len(getattr(p, "ds_shape", p.shape))  # noqa: E731  ZeRO-3 leaves an empty placeholder in p
    groups = [
        {"params": [p for p in params if ndim(p) > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if ndim(p) <= 1], "weight_decay": 0.0},
    ]
    # DeepSpeed drops empty groups; the scheduler must not see them
    return [group for group in groups if group["params"]]
