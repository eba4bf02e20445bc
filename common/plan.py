"""The run's plan: batch arithmetic, the learning rate scaled to the effective batch and its schedule, and where
the run starts, fresh or resumed in any layout (processes, per-device batch, accumulation). Positions and the
schedule count samples, not steps: a run resumed in another layout continues with the first sample it had not
trained (common.data.EpochSampler), its schedule where it was.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from .args import LR_SCALING_RULES
from .checkpoint import changed_settings, read_state
from .data import fingerprint
from .runtime import RecipeError, logger


def effective_batch_size(per_device_batch_size: int, num_processes: int, gradient_accumulation_steps: int) -> int:
    """Samples that contribute to one optimizer step."""
    return per_device_batch_size * num_processes * gradient_accumulation_steps


def scale_lr(learning_rate: float, batch_size: int, reference_batch_size: int, rule: str) -> float:
    """`linear`: lr x batch/reference (Goyal et al., 2017); `sqrt`: lr x sqrt(batch/reference), common for
    Adam; `none`: lr unchanged."""
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"unknown lr scaling rule {rule!r}; choose from {', '.join(LR_SCALING_RULES)}")
    ratio = batch_size / reference_batch_size
    return learning_rate * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


@dataclass
class Position:
    """Optimizer steps taken, the epoch, samples of its order trained, samples trained in all (the schedule's
    clock). Only the training loop moves it."""

    step: int = 0
    epoch: int = 0
    sample: int = 0
    seen: int = 0


@dataclass(frozen=True)
class TrainingPlan:
    """What the loop needs to know in advance. A step takes up to `gradient_accumulation_steps` rounds of one
    batch per process (an epoch's last may take fewer); an incomplete last round is dropped."""

    num_samples: int  # in the training set
    per_device_batch_size: int
    num_processes: int
    gradient_accumulation_steps: int
    effective_batch_size: int
    learning_rate: float  # scaled to effective_batch_size
    steps_per_epoch: int
    max_train_steps: int
    num_epochs: int
    warmup_steps: int
    warmup_samples: int
    total_samples: int  # what max_train_steps trains: the schedule's length
    lr_scheduler_type: str = "constant"
    data_fingerprint: str = ""  # common.data.fingerprint of the training set

    @property
    def round_samples(self) -> int:
        return self.per_device_batch_size * self.num_processes

    @property
    def epoch_rounds(self) -> int:
        return self.num_samples // self.round_samples

    def samples_for_steps(self, steps: int) -> int:
        """Samples trained by the first `steps` optimizer steps of a run started at an epoch's start."""
        epochs, rest = divmod(steps, self.steps_per_epoch)
        return (
            epochs * self.epoch_rounds + min(rest * self.gradient_accumulation_steps, self.epoch_rounds)
        ) * self.round_samples

    def steps_from(self, epoch: int, sample: int, *, until_epoch: int | None = None, samples: int | None = None):
        """Walk from `sample` of `epoch` to the end of epoch `until_epoch - 1`, or until at least `samples` more are
        trained: (optimizer steps, the samples they train, the epoch after)."""
        steps = trained = 0
        k = self.gradient_accumulation_steps
        while (until_epoch is None or epoch < until_epoch) and (samples is None or trained < samples):
            rounds = (self.num_samples - sample) // self.round_samples
            if samples is not None:  # whole steps, only as many as the budget needs
                needed = -(-(samples - trained) // self.round_samples)
                rounds = min(rounds, -(-needed // k) * k)
            steps, trained = steps + -(-rounds // k), trained + rounds * self.round_samples
            epoch, sample = epoch + 1, 0
        return steps, trained, epoch

    def lr_at(self, seen: int) -> float:
        """The learning rate of the step that follows `seen` trained samples."""
        return self.learning_rate * self._schedule(seen)

    @functools.cached_property
    def _schedule(self):
        """transformers' schedule (its LambdaLR's function) built over samples instead of steps."""
        import torch
        from transformers import get_scheduler  # here: a parse error need not wait for transformers

        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.learning_rate)
        return get_scheduler(self.lr_scheduler_type, dummy, self.warmup_samples, self.total_samples).lr_lambdas[0]


def plan_training(
    *, num_samples: int, per_device_batch_size: int, num_processes: int, gradient_accumulation_steps: int,
    learning_rate: float, reference_batch_size: int, lr_scaling: str, num_train_epochs: int,
    max_train_steps: int | None = None, warmup_steps: int | None = None, warmup_ratio: float = 0.0,
    lr_scheduler_type: str = "constant",
) -> TrainingPlan:  # fmt: skip
    """The plan of a run from step 0, made before `accelerator.prepare`."""
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
            f"{gradient_accumulation_steps}, so no optimizer step would see the effective batch the learning rate is "
            f"scaled for; lower --gradient_accumulation_steps to {rounds} or less"
        )
    steps_per_epoch = math.ceil(rounds / gradient_accumulation_steps)
    max_train_steps = max_train_steps or steps_per_epoch * num_train_epochs
    warmup_steps = math.ceil(warmup_ratio * max_train_steps) if warmup_steps is None else warmup_steps
    batch = effective_batch_size(per_device_batch_size, num_processes, gradient_accumulation_steps)
    plan = TrainingPlan(
        num_samples, per_device_batch_size, num_processes, gradient_accumulation_steps, batch,
        scale_lr(learning_rate, batch, reference_batch_size, lr_scaling), steps_per_epoch, max_train_steps,
        math.ceil(max_train_steps / steps_per_epoch), warmup_steps, 0, 0, lr_scheduler_type,
    )  # fmt: skip
    return replace(
        plan,
        warmup_samples=plan.samples_for_steps(warmup_steps),
        total_samples=plan.samples_for_steps(max_train_steps),
    )


LAYOUT = ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps")


def plan_run(args, dataset, num_processes: int, resume=None) -> tuple[TrainingPlan, Position]:
    """(plan, start) on `dataset`: from the arguments, or continuing checkpoint `resume` (same data and seed; other
    changed settings listed). In another layout the run continues at the same sample, the rate follows the new
    effective batch by --lr_scaling, the schedule keeps its place, and what is left is counted in steps of the new
    layout; one line says what changed."""
    num_samples = len(dataset)
    plan = plan_training(
        num_samples=num_samples, per_device_batch_size=args.per_device_train_batch_size,
        num_processes=num_processes, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, reference_batch_size=args.reference_batch_size, lr_scaling=args.lr_scaling,
        num_train_epochs=args.num_train_epochs, max_train_steps=args.max_train_steps, warmup_steps=args.warmup_steps,
        warmup_ratio=args.warmup_ratio, lr_scheduler_type=args.lr_scheduler_type,
    )  # fmt: skip
    plan = replace(plan, data_fingerprint=fingerprint(dataset))
    described = (
        f"{num_processes} process(es) x {plan.per_device_batch_size} per device x {plan.gradient_accumulation_steps} "
        f"accumulation = effective batch {plan.effective_batch_size}; learning rate {args.learning_rate} at batch "
        f"{args.reference_batch_size} -> {plan.learning_rate:.4g} ({args.lr_scaling}); "
        f"{plan.max_train_steps} steps of which {plan.warmup_steps} warmup"
    )
    if resume is None:
        logger.info(described)
        return plan, Position()
    state = read_state(resume)
    saved_args = state.get("args", {})
    if saved_args.get("seed", args.seed) != args.seed:
        raise RecipeError(
            f"the checkpoint was written with --seed {saved_args['seed']}, which fixes the order of the data it has "
            f"not trained yet; resume with --seed {saved_args['seed']}"
        )
    changed = changed_settings(saved_args, args)
    if state.get("data_fingerprint", plan.data_fingerprint) != plan.data_fingerprint or (
        state.get("num_samples", num_samples) != num_samples  # a checkpoint from before fingerprints
    ):
        differs = f"; this run differs in {', '.join(changed)}" if changed else ""
        raise RecipeError(
            f"checkpoint {resume} was written for other training data ({state['num_samples']:,} samples, this run "
            f"has {num_samples:,}, the contents differ){differs}; resume with the data and preprocessing that wrote "
            "it (its trainer_state.json lists the arguments), or start a new --output_dir"
        )
    if changed:
        logger.warning(f"resuming {resume} with settings that differ from the checkpoint's: {', '.join(changed)}")
    old = {key: state.get(key) for key in LAYOUT}
    new = dict(zip(LAYOUT, (num_processes, args.per_device_train_batch_size, args.gradient_accumulation_steps)))
    if "samples_seen" not in state:  # an earlier version counted batches of its own layout
        raise RecipeError(
            f"checkpoint {resume} was written by an earlier version of the recipes, which kept its position in "
            "batches; resume it with that version, or start a new --output_dir"
        )
    start = Position(state["step"], state["epoch"], state["samples_in_epoch"], state["samples_seen"])
    if args.max_train_steps is not None and start.step > args.max_train_steps:  # it would only save these weights
        raise RecipeError(
            f"checkpoint {resume} is at step {start.step}, past --max_train_steps {args.max_train_steps}: there is "
            f"nothing to train, and the run's model would become this checkpoint's; pass --max_train_steps "
            f"{start.step} or more, or an earlier checkpoint"
        )
    if old == new:
        logger.info(described)
        return plan, start
    note = ""
    if num_samples - start.sample < plan.round_samples:  # no full round of the new layout left in this epoch
        note = (
            f"; the {num_samples - start.sample} samples left in epoch {start.epoch} do not fill a round of "
            f"{plan.round_samples}: continuing at epoch {start.epoch + 1}, as every epoch drops its remainder"
        )
        start = replace(start, epoch=start.epoch + 1, sample=0)
    if args.max_train_steps is None:
        steps, samples, end = plan.steps_from(start.epoch, start.sample, until_epoch=args.num_train_epochs)
    else:
        if saved_args.get("max_train_steps") == args.max_train_steps and "total_samples" in state:
            budget = state["total_samples"] - start.seen  # what --max_train_steps meant for that run
        else:  # a new length: the extra steps are steps of this layout
            budget = (args.max_train_steps - start.step) * plan.effective_batch_size
        steps, samples, end = plan.steps_from(start.epoch, start.sample, samples=max(budget, 0))
    warmup = state.get("warmup_samples", plan.warmup_samples)
    plan = replace(
        plan, max_train_steps=start.step + steps, num_epochs=max(end, start.epoch), total_samples=start.seen + samples,
        warmup_samples=warmup, warmup_steps=round(warmup / plan.effective_batch_size),
    )  # fmt: skip
    lr = f"{state['learning_rate']:.4g} -> " if state.get("learning_rate") is not None else ""
    logger.warning(
        f"resuming checkpoint-{start.step} with another layout: processes x per-device batch x accumulation "
        f"{' x '.join(str(old[k]) for k in LAYOUT)} -> {' x '.join(str(new[k]) for k in LAYOUT)}, effective batch "
        f"{state.get('effective_batch_size')} -> {plan.effective_batch_size}; learning rate {lr}"
        f"{plan.learning_rate:.4g} ({args.lr_scaling}); continuing epoch {start.epoch} at sample {start.sample:,} of "
        f"its order, schedule at sample {start.seen:,} of {plan.total_samples:,}; {steps} more steps{note}"
    )
    return plan, start


def decay_groups(model, weight_decay: float) -> list:
    """Weight decay on trainable matrices and kernels, none on biases and norms (it would only pull activations'
    scale toward zero)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = lambda p: len(getattr(p, "ds_shape", p.shape))  # noqa: E731  ZeRO-3 leaves an empty placeholder in p
    groups = [
        {"params": [p for p in params if ndim(p) > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if ndim(p) <= 1], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]  # DeepSpeed drops empty groups
