"""The run's plan: batch arithmetic, the learning rate scaled to the effective batch and its schedule, and where
the run starts. Positions and the schedule count samples, not steps, so a run resumes in any layout (processes,
per-device batch, accumulation) at the first sample it had not trained, its schedule where it was."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from accelerate import PartialState

from .args import LR_SCALING_RULES
from .checkpoint import changed_settings, read_state
from .data import fingerprint
from .runtime import RecipeError, decide_on_main, logger, one_line


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


NEVER = 2**62  # a limit no run reaches
SHARED_STEPS = 100_000  # a longer run's processes each build the schedule: its table would take 10 MB a process


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
    """What the loop needs to know in advance. A step takes `gradient_accumulation_steps` rounds of one batch per
    process; an epoch's remainder too short for a step is dropped, as one process's batch of them all would be."""

    num_samples: int | None  # in the training set; None: a stream, whose epoch ends where it does
    per_device_batch_size: int
    num_processes: int
    gradient_accumulation_steps: int
    learning_rate: float  # scaled to effective_batch_size
    max_train_steps: int
    warmup_steps: int
    warmup_samples: int
    total_samples: int  # what max_train_steps trains: the schedule's length
    lr_scheduler_type: str
    data_fingerprint: str = ""  # common.data.fingerprint of the training set
    # (what decides the schedule, its factor at each step of this run by samples seen): made by the main process
    # alone (plan_run), so that the others need not import transformers, and peft with it (1.5 CPU-seconds a process)
    shared_schedule: tuple = field(default=(), compare=False, repr=False)

    @property
    def effective_batch_size(self) -> int:
        return effective_batch_size(self.per_device_batch_size, self.num_processes, self.gradient_accumulation_steps)

    @property
    def round_samples(self) -> int:
        return self.per_device_batch_size * self.num_processes

    @property
    def steps_per_epoch(self) -> int | None:
        if self.num_samples is None:
            return None
        return self.num_samples // self.round_samples // self.gradient_accumulation_steps

    def epoch_done(self, position: Position) -> bool:
        """Whether epoch `position.epoch` has no whole step left after sample `position.sample` of its order (a
        stream's: not known before it ends)."""
        return self.num_samples is not None and self.num_samples - position.sample < self.effective_batch_size

    def epochs(self, position: Position) -> float:
        """Epochs trained at `position`, as transformers counts them: the whole ones and the share of the current one's
        steps (one trained in several layouts is whole once no step is left in it); a stream's, the whole ones."""
        if self.num_samples is None:
            return float(position.epoch)
        if self.epoch_done(position):
            return position.epoch + 1.0
        return position.epoch + position.sample / (self.steps_per_epoch * self.effective_batch_size)

    def steps_and_samples_from(self, start: Position, *, steps=NEVER, samples=NEVER, epochs=NEVER) -> tuple[int, int]:
        """(optimizer steps, samples they train) from `start` on, as the loop takes them, until `steps` are taken,
        at least `samples` trained (in whole steps), or epoch `epochs` is reached."""
        k, per_round = self.gradient_accumulation_steps, self.round_samples
        epoch, sample, taken, trained = start.epoch, start.sample, 0, 0
        while taken < steps and trained < samples and epoch < epochs:
            left = (NEVER if self.num_samples is None else self.num_samples - sample) // (k * per_round)  # this epoch
            n = min(left, steps - taken, -(-(samples - trained) // (k * per_round)))  # a ceiling: whole steps
            taken, trained = taken + n, trained + n * k * per_round
            epoch, sample = epoch + 1, 0
        return taken, trained

    def lr_at(self, seen: int) -> float:
        """The learning rate of the step that follows `seen` trained samples."""
        return self.learning_rate * self.schedule(seen)

    def _schedule_inputs(self) -> tuple:
        return self.lr_scheduler_type, self.learning_rate, self.warmup_samples, self.total_samples

    @functools.cached_property
    def schedule(self):
        """The rate's fraction of `learning_rate` after a number of trained samples: transformers' schedule, or the
        factors the main process sent for this run's steps (shared_schedule), and transformers' between them."""
        decided_by, factors = self.shared_schedule or (None, {})
        if decided_by != self._schedule_inputs():  # none sent, or for another schedule (a plan made from this one)
            return self._transformers_schedule

        def shared(seen: int) -> float:
            factor = factors.get(seen)
            return self._transformers_schedule(seen) if factor is None else factor

        return shared

    @functools.cached_property
    def _transformers_schedule(self):
        """transformers' schedule (its LambdaLR's function) built over samples instead of steps."""
        import torch
        from transformers import get_scheduler  # here: a parse error need not wait for transformers

        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.learning_rate)
        return get_scheduler(self.lr_scheduler_type, dummy, self.warmup_samples, self.total_samples).lr_lambdas[0]


def plan_training(args, num_samples: int, num_processes: int) -> TrainingPlan:
    """The plan of a run of `args` (the shared training arguments) from step 0, made before `accelerator.prepare`."""
    batch, k = args.per_device_train_batch_size, args.gradient_accumulation_steps
    rounds = NEVER if num_samples is None else num_samples // (batch * num_processes)  # a stream: --max_train_steps
    if rounds < k:  # no step would train the effective batch the rate is scaled for
        lower = [f"--gradient_accumulation_steps to {rounds} or less"] if rounds else []
        lower += [] if rounds or batch == 1 else ["--per_device_train_batch_size"]
        lower += [] if rounds or num_processes == 1 else ["the number of processes"]
        fix = f"lower {' or '.join(lower)}, or " if lower else ""
        raise RecipeError(
            f"the training set holds {num_samples} samples: {rounds} batch(es) of {batch} for each of the "
            f"{num_processes} process(es) an epoch, fewer than --gradient_accumulation_steps {k}, so no optimizer "
            "step would see the effective batch the learning rate is scaled for",
            f"{fix}use more data",
            subject="--gradient_accumulation_steps",
        )
    lr = scale_lr(args.learning_rate, batch * num_processes * k, args.reference_batch_size, args.lr_scaling)
    plan = TrainingPlan(num_samples, batch, num_processes, k, lr, 0, 0, 0, 0, args.lr_scheduler_type)
    max_train_steps = args.max_train_steps or plan.steps_per_epoch * args.num_train_epochs
    warmup_steps = args.warmup_steps
    if warmup_steps is None:
        warmup_steps = math.ceil(args.warmup_ratio * max_train_steps)
    if args.lr_scheduler_type == "constant":  # transformers' constant has none (constant_with_warmup has)
        warmup_steps = 0
    plan = replace(
        plan,
        max_train_steps=max_train_steps,
        warmup_steps=warmup_steps,
        warmup_samples=plan.steps_and_samples_from(Position(), steps=warmup_steps)[1],
        total_samples=plan.steps_and_samples_from(Position(), steps=max_train_steps)[1],
    )
    decide_on_main(PartialState(), lambda: _check_schedule(plan, args))
    return plan


def _check_schedule(plan: TrainingPlan, args) -> None:
    """transformers builds the schedule now: what it refuses (polynomial's lr_end above the rate) before training."""
    try:
        plan.lr_at(0)
    except ValueError as err:
        raise RecipeError(
            f"--lr_scheduler_type {args.lr_scheduler_type}: {one_line(err)}",
            "pass another --learning_rate or --lr_scheduler_type",
            subject="--lr_scheduler_type",
        ) from err


def _share_schedule(plan: TrainingPlan, start: Position) -> TrainingPlan:
    """`plan` with its schedule made by the main process and sent to the others (shared_schedule)."""
    state = PartialState()
    if state.num_processes == 1 or plan.max_train_steps - start.step > SHARED_STEPS:
        return plan
    return with_schedule(plan, decide_on_main(state, lambda: schedule_factors(plan, start)))


def schedule_factors(plan: TrainingPlan, start: Position) -> dict:
    """The schedule's factor at each step the run takes from `start` (and at its end), by samples seen."""
    batch, steps = plan.effective_batch_size, plan.max_train_steps - start.step
    return {s: plan._transformers_schedule(s) for s in range(start.seen, start.seen + steps * batch + 1, batch)}


def with_schedule(plan: TrainingPlan, factors: dict) -> TrainingPlan:
    """`plan` taking its rates from `factors` (schedule_factors'); a rate asked for elsewhere, or of a plan made from
    it with another schedule, is transformers' own."""
    return replace(plan, shared_schedule=(plan._schedule_inputs(), factors))


def plan_run(args, dataset, num_processes: int, resume=None) -> tuple[TrainingPlan, Position]:
    """(plan, start) on `dataset`: from the arguments, or continuing checkpoint `resume` in any layout."""
    digest = decide_on_main(PartialState(), lambda: fingerprint(dataset))  # read once; a bad sample said once
    num_samples = len(dataset) if hasattr(dataset, "__len__") else None  # a stream has no length
    plan = replace(plan_training(args, num_samples, num_processes), data_fingerprint=digest)
    start = Position()
    if resume is not None:
        plan, start = _resumed(args, plan, read_state(resume), resume)
    # resumed, the warmup it keeps (in samples; a ratio's of the checkpoint's length): all of a --warmup_ratio 1 run
    if plan.warmup_samples > plan.total_samples or args.warmup_steps and plan.warmup_samples >= plan.total_samples:
        length = "--max_train_steps" if args.max_train_steps else f"--num_train_epochs {args.num_train_epochs}"
        option, flag, fix = "--warmup_steps", f"--warmup_steps {args.warmup_steps}", "fewer warmup steps"
        if not args.warmup_steps:
            option = "--warmup_ratio"
            flag = f"--warmup_ratio {args.warmup_ratio} (its {plan.warmup_samples:,} samples, of the checkpoint's run)"
            fix = "--warmup_steps, or another --warmup_ratio, for this length"
        raise RecipeError(
            f"{flag} leaves no step after the warmup of the {plan.max_train_steps} steps of {length}",
            f"pass {fix}",
            subject=option,
        )
    logger.info(
        f"{num_processes} process(es) x {plan.per_device_batch_size} per device x {plan.gradient_accumulation_steps} "
        f"accumulation = effective batch {plan.effective_batch_size}; learning rate {args.learning_rate} at batch "
        f"{args.reference_batch_size} -> {plan.learning_rate:.4g} ({args.lr_scaling}); {plan.max_train_steps} steps "
        f"of which {plan.warmup_steps} warmup"
    )
    return _share_schedule(plan, start), start


WARMUP_ARGS = ("warmup_steps", "warmup_ratio")


def _samples(count: int | None) -> str:
    return "a stream" if count is None else f"{count:,} samples"


def _resumed(args, plan: TrainingPlan, state: dict, resume) -> tuple[TrainingPlan, Position]:
    """Same data and seed (other changed settings listed); from the checkpoint's sample, the rest of
    --num_train_epochs, what its --max_train_steps meant, or the steps up to a new one, in steps of this layout, at
    this effective batch's rate (--lr_scaling); the schedule keeps its place and, unless --warmup_steps or
    --warmup_ratio changed, its warmup."""
    saved_args = state.get("args", {})
    if "data_fingerprint" not in state:  # earlier versions counted batches of their own layout
        raise RecipeError(
            f"checkpoint {resume} was written by an earlier version of the recipes",
            "resume it with that version, or start a new --output_dir",
            subject=str(resume),
        )
    if saved_args.get("seed", args.seed) != args.seed:
        raise RecipeError(
            f"the checkpoint was written with --seed {saved_args['seed']}, which fixes the order of the data it has "
            "not trained yet",
            f"resume with --seed {saved_args['seed']}",
            subject="--seed",
        )
    changed = changed_settings(saved_args, args)
    if state["data_fingerprint"] != plan.data_fingerprint:
        differs = f"; this run differs in {', '.join(changed)}" if changed else ""
        sizes = f"{_samples(state['num_samples'])}, this run has {_samples(plan.num_samples)}"
        if state["num_samples"] == plan.num_samples:  # the sampled contents, or the prepared blocks' inputs
            sizes += ": other contents, or blocks prepared from other inputs or by another version of the recipes"
        if state["num_samples"] is None and plan.num_samples is None:
            sizes = "another stream"
        raise RecipeError(
            f"checkpoint {resume} was written for other training data ({sizes}){differs}",
            "resume with the data and preprocessing that wrote it (its trainer_state.json lists the arguments), or "
            "start a new --output_dir",
            subject=str(resume),
        )
    if changed:
        logger.warning(f"resuming {resume} with settings that differ from the checkpoint's: {', '.join(changed)}")
    start = Position(state["step"], state["epoch"], state["samples_in_epoch"], state["samples_seen"])
    # past the length asked: it would only save these weights. The length the checkpoint's run was given is never
    # past: it means samples, whatever steps of other layouts took them (a resume with another batch, resumed again)
    same_length = args.max_train_steps is not None and saved_args.get("max_train_steps") == args.max_train_steps
    if args.max_train_steps is not None:
        flag, limit, enough = "--max_train_steps", args.max_train_steps, start.step + 1
        past = start.step > limit and not same_length
    else:  # the end of epoch e is epoch e+1 at sample 0
        flag, limit, enough = "--num_train_epochs", args.num_train_epochs, start.epoch + 1
        past = (start.epoch, start.sample) > (limit, 0)
    if past:
        trained = f"{start.epoch} epoch(s){f' and {start.sample:,} samples' if start.sample else ''} trained"
        raise RecipeError(
            f"checkpoint {resume} is at step {start.step} ({trained}), past {flag} {limit}: there is nothing to "
            "train, and the run's model would become this checkpoint's",
            f"pass {flag} {enough} or more, or an earlier checkpoint",
            subject=flag,
        )
    if args.max_train_steps is None:
        steps, samples = plan.steps_and_samples_from(start, epochs=args.num_train_epochs)
    elif same_length:  # the samples it meant for that run
        steps, samples = plan.steps_and_samples_from(start, samples=state["total_samples"] - start.seen)
    else:
        steps, samples = plan.steps_and_samples_from(start, steps=args.max_train_steps - start.step)
    plan = replace(plan, max_train_steps=start.step + steps, total_samples=start.seen + samples)
    if not steps:  # a run stopped in its final evaluation or save, or one resumed into another folder
        logger.info(
            f"checkpoint {resume} is at the end of {flag} {limit}: nothing left to train, its model is the run's"
        )
    warmup = state["warmup_samples"]  # the checkpoint's, unless --warmup_steps or --warmup_ratio changed
    if warmup != plan.warmup_samples and all(saved_args.get(k) == getattr(args, k) for k in WARMUP_ARGS):
        plan = replace(plan, warmup_samples=warmup, warmup_steps=round(warmup / plan.effective_batch_size))
    old = [state["world_size"], state["per_device_train_batch_size"], state["gradient_accumulation_steps"]]
    new = [plan.num_processes, plan.per_device_batch_size, plan.gradient_accumulation_steps]
    if old != new:
        logger.warning(
            f"resuming checkpoint-{start.step} with another layout: processes x per-device batch x accumulation "
            f"{' x '.join(map(str, old))} -> {' x '.join(map(str, new))}, effective batch "
            f"{state['effective_batch_size']} -> {plan.effective_batch_size}; learning rate "
            f"{state['learning_rate']:.4g} -> {plan.learning_rate:.4g} ({args.lr_scaling}); continuing epoch "
            f"{start.epoch} at sample {start.sample:,} of its order, schedule at sample {start.seen:,} of "
            f"{plan.total_samples:,}; {steps} more steps"
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
