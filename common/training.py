"""The bookkeeping around a recipe's training step, each piece named for what it does. The step itself
(forward, backward, clip, optimizer.step(), scheduler.step(), zero_grad) and the things done between
steps (log, checkpoint, stop on a signal) are written out in the recipe.

- `plan_run`: the run's plan, fresh or resumed, also with another number of processes, batch or
  accumulation than the checkpoint's: the data position is kept in samples of the epoch's order.
- `accumulation_windows`: the micro-batches of each optimizer step, fetched before the first forward
  so that the step's loss can be normalized by the items (samples, target tokens) of the whole step.
- `micro_batch`: gradients sync across processes only on a window's last micro-batch.
- `TrainLog`: the loss weighted by items over every micro-batch and process, the history, the
  progress bar and the rates.
- `Checkpoints`: when to save, what a checkpoint records, and resuming one.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .args import public_args
from .checkpoint import STATE_FILE, load_checkpoint, model_signature, save_checkpoint
from .data import EpochSampler, set_epoch
from .runtime import RecipeError, logger
from .scaling import TrainingPlan, describe_plan, plan_from_args, plan_training


@dataclass
class Progress:
    """Where the run is: optimizer steps taken, and samples trained, of the job (every process)."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0  # the first samples of this epoch's order (common.data.EpochSampler)
    samples_seen: int = 0  # since the run started: the schedule's clock (common.scaling.make_scheduler)


LAYOUT = ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps")


def plan_run(args, num_samples: int, num_processes: int, checkpoint: Path | None = None):
    """(plan, progress) of this run: a fresh plan from the arguments, or the continuation of the run
    that wrote `checkpoint`, whose layout (processes, per-device batch, accumulation) may differ.

    With the same layout the arguments' plan stands (a larger --num_train_epochs or
    --max_train_steps extends the run). With another, the run continues from the same sample of the
    same epoch; the learning rate follows the new effective batch by --lr_scaling; the schedule
    keeps its place in samples; and what is left (the rest of --num_train_epochs, or the samples
    --max_train_steps meant) is counted in steps of the new layout. One line says what changed.
    """
    plan = plan_from_args(args, num_samples, num_processes)
    if checkpoint is None:
        logger.info(describe_plan(plan, args))
        return plan, Progress()
    state = json.loads((Path(checkpoint) / STATE_FILE).read_text())
    saved_args = state.get("args", {})
    if saved_args.get("seed", args.seed) != args.seed:
        raise RecipeError(
            f"checkpoint {checkpoint} was written with --seed {saved_args['seed']}, which fixes the order "
            f"of the data it has not trained yet; resume with --seed {saved_args['seed']}"
        )
    if state.get("num_samples", num_samples) != num_samples:
        raise RecipeError(
            f"checkpoint {checkpoint} was written for a training set of {state['num_samples']:,} samples, "
            f"this one has {num_samples:,}; resume with the data that wrote it, or start a new --output_dir"
        )
    old = {key: state.get(key) for key in LAYOUT}
    new = dict(zip(LAYOUT, (num_processes, args.per_device_train_batch_size, args.gradient_accumulation_steps)))
    progress = _progress_from(state, plan, old)
    if old == new:
        logger.info(describe_plan(plan, args))
        return plan, progress

    notes = []
    if (num_samples - progress.samples_in_epoch) < plan.round_samples:  # no full round left in this epoch
        notes.append(
            f"the {num_samples - progress.samples_in_epoch} samples left in epoch {progress.epoch} do not "
            f"fill a round of {plan.round_samples}: continuing at epoch {progress.epoch + 1}, as every "
            "epoch drops its remainder"
        )
        progress = replace(progress, epoch=progress.epoch + 1, samples_in_epoch=0)
    if args.max_train_steps is None:
        steps, samples, end = plan.steps_from(
            progress.epoch, progress.samples_in_epoch, until_epoch=args.num_train_epochs
        )
    else:
        if saved_args.get("max_train_steps") == args.max_train_steps and "total_samples" in state:
            budget = state["total_samples"] - progress.samples_seen  # what --max_train_steps meant for that run
        else:  # a new length: the extra steps are steps of this layout
            budget = (args.max_train_steps - progress.step) * plan.effective_batch_size
        steps, samples, end = plan.steps_from(progress.epoch, progress.samples_in_epoch, samples=max(budget, 0))
    warmup_samples = state.get("warmup_samples", plan.warmup_samples)
    plan = replace(
        plan,
        max_train_steps=progress.step + steps,
        num_epochs=max(end, progress.epoch),
        total_samples=progress.samples_seen + samples,
        warmup_samples=warmup_samples,
        warmup_steps=round(warmup_samples / plan.effective_batch_size),
    )
    was = f"{old['world_size']} x {old['per_device_train_batch_size']} x {old['gradient_accumulation_steps']}"
    old_batch = state.get("effective_batch_size")
    old_lr = state.get("learning_rate")
    lr = (
        f"learning rate {old_lr:.4g} -> {plan.learning_rate:.4g} ({args.lr_scaling})"
        if old_lr is not None
        else f"learning rate {plan.learning_rate:.4g}"
    )
    logger.warning(
        f"resuming {checkpoint.name} with another layout: processes x per-device batch x accumulation {was} -> "
        f"{num_processes} x {args.per_device_train_batch_size} x {args.gradient_accumulation_steps}, effective batch "
        f"{old_batch} -> {plan.effective_batch_size}; {lr}; continuing epoch {progress.epoch} at sample "
        f"{progress.samples_in_epoch:,} of its order, schedule at sample {progress.samples_seen:,} of "
        f"{plan.total_samples:,}; {steps} more steps" + "".join(f"; {note}" for note in notes)
    )
    return plan, progress


def _progress_from(state: dict, plan: TrainingPlan, old_layout: dict) -> Progress:
    if "samples_in_epoch" in state:
        return Progress(state["step"], state["epoch"], state["samples_in_epoch"], state["samples_seen"])
    # A checkpoint of an earlier version of the recipes: its position in batches of its own layout.
    world, batch, accumulation = (old_layout[key] for key in LAYOUT)
    old_plan = plan_training(
        num_samples=plan.num_samples,
        per_device_batch_size=batch,
        num_processes=world,
        gradient_accumulation_steps=accumulation,
        learning_rate=1.0,
        reference_batch_size=1,
        lr_scaling="none",
        num_train_epochs=1,
    )
    return Progress(
        state["step"],
        state["epoch"],
        state["batches_in_epoch"] * world * batch,
        old_plan.samples_for_steps(state["step"]),
    )


class Window(list):
    """The micro-batches of one optimizer step on this process, and the samples of the whole step."""

    samples: int = 0


def accumulation_windows(train_dl, accumulation_steps: int, epoch: int, progress: Progress):
    """This epoch's batches, `accumulation_steps` at a time (the last window of an epoch may be
    shorter), starting where `progress` says the run stopped. `progress` counts each window's
    samples as trained when it is handed out: a checkpoint is only ever saved after its step."""
    set_epoch(train_dl, epoch)
    if epoch != progress.epoch:
        progress.epoch, progress.samples_in_epoch = epoch, 0
    _epoch_sampler(train_dl).resume_at(epoch, progress.samples_in_epoch)
    window = Window()
    for batch in train_dl:
        window.append(batch)
        if len(window) == accumulation_steps:
            yield _counted(window, train_dl, progress)
            window = Window()
    if window:
        yield _counted(window, train_dl, progress)


def _counted(window: Window, train_dl, progress: Progress) -> Window:
    window.samples = len(window) * train_dl.total_batch_size  # every process's batch is full (drop_last)
    progress.samples_in_epoch += window.samples
    progress.samples_seen += window.samples
    return window


def _epoch_sampler(dataloader) -> EpochSampler:
    sampler = dataloader
    while not isinstance(sampler, EpochSampler):  # DataLoaderShard -> BatchSamplerShard -> BatchSampler -> ours
        sampler = getattr(sampler, "batch_sampler", None) or getattr(sampler, "sampler", None)
        if sampler is None:
            raise TypeError("the training DataLoader needs an EpochSampler (common.make_dataloader(train=True))")
    return sampler


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool):
    """One micro-batch of an accumulation window: the gradients are reduced across processes only on
    the `last` (before it DDP's no_sync, FSDP2's requires_gradient_sync(False)), and Accelerate's
    optimizer and DeepSpeed's engine step only there. The recipe's windows are fetched before their
    first forward, so Accelerate's own `accumulate`, which looks at the loader's end, cannot tell."""
    accelerator.sync_gradients = last
    with contextlib.nullcontext() if last else accelerator.no_sync(model):
        yield


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The tokens a causal LM is trained to predict in a batch: the labels after the first position
    (the model shifts them by one) that are not masked with -100."""
    return (labels[..., 1:] != -100).sum()


def window_tokens(accelerator, window) -> torch.Tensor:
    """The target tokens of a whole optimizer step: every micro-batch of the window on every process
    (one scalar all-reduce, on the device: no host sync), at least 1 so a step without any is a zero
    update rather than NaN. transformers' causal-LM losses divide their sum by it when passed as
    `num_items_in_batch`, so every token of the step weighs the same, however the step's samples are
    split into processes, per-device batches and accumulation."""
    local = sum(target_tokens(batch["labels"]) for batch in window)
    return accelerator.reduce(local, reduction="sum").clamp(min=1)


class TrainLog:
    """The loss, weighted by items (samples, target tokens) across every micro-batch and process since
    the last log; the log history (results.json, trackers); the progress bar; the training rates."""

    def __init__(self, accelerator, plan: TrainingPlan, progress: Progress, logging_steps: int):
        self.accelerator, self.plan, self.logging_steps = accelerator, plan, logging_steps
        self.train_loss, self.history, self.train_seconds = None, [], 0.0
        self._sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # loss x items, items
        self._start_step = progress.step
        self._samples = 0  # trained by this process's run, and at its first step (one-time costs)
        self._first = None
        self._clock = time.perf_counter()
        self._bar = tqdm(
            total=plan.max_train_steps,
            initial=progress.step,
            disable=not accelerator.is_local_main_process,
            mininterval=0.1 if sys.stderr.isatty() else 30,
        )  # batch logs (Slurm): a line per 30 s

    def add(self, loss_sum: torch.Tensor, items) -> None:
        """One micro-batch: the sum of its per-item losses and its number of items (this process's)."""
        self._sums[0] += loss_sum.detach().double()
        self._sums[1] += items

    def step(self, progress: Progress, window: Window, lr: float) -> None:
        """After each optimizer step: the rates, the progress bar, and every --logging_steps (and at the
        end of an epoch or of the run) the loss in the history and the trackers."""
        now = time.perf_counter()
        self.train_seconds += now - self._clock
        self._clock = now
        self._samples += window.samples
        if self._first is None:
            self._first = (self.train_seconds, self._samples)
        self._bar.update(1)
        end_of_epoch = self.plan.num_samples - progress.samples_in_epoch < self.plan.round_samples
        if progress.step % self.logging_steps and progress.step < self.plan.max_train_steps and not end_of_epoch:
            return
        self.train_loss = self._mean_loss(progress.step)
        # train_seconds: this run's training time so far, read after the loss reached the host (a device
        # sync), so consecutive logs time the steps between them (benchmarks/)
        self.history.append(
            {
                "step": progress.step,
                "samples_seen": progress.samples_seen,
                "train_loss": self.train_loss,
                "lr": lr,
                "train_seconds": round(self.train_seconds, 4),
            }
        )
        self.accelerator.log(self.history[-1], step=progress.step)
        self._bar.set_postfix(loss=f"{self.train_loss:.4f}")

    def check_finite(self, step: int, model) -> None:
        """Before a checkpoint or the final save: raise if the loss since the last log, or the weights
        (each process checks what it holds: its ZeRO-3 or FSDP shard, or the whole model), are NaN or
        inf, so nothing of a diverged run is saved."""
        bad = torch.zeros(1, device=self.accelerator.device)
        for p in model.parameters():
            local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
            if local.numel() and not torch.isfinite(local).all():
                bad += 1
                break
        sums = self.accelerator.reduce(torch.cat([self._sums, bad.double()]), reduction="sum")
        loss = float(sums[0] / sums[1].clamp(min=1))
        if not math.isfinite(loss):
            raise self._diverged(step, f"the training loss became {loss}")
        if sums[2] > 0:
            raise self._diverged(step, "the weights hold NaN or inf")

    def _mean_loss(self, step: int) -> float:
        sums = self.accelerator.reduce(self._sums.clone(), reduction="sum")  # one all-reduce per log
        self._sums.zero_()
        loss = float(sums[0] / sums[1]) if sums[1] > 0 else 0.0
        if not math.isfinite(loss):
            raise self._diverged(step, f"the training loss became {loss}")
        return loss

    def _diverged(self, step: int, what: str) -> RecipeError:
        return RecipeError(
            f"{what} by step {step}; nothing was saved after it: lower --learning_rate, raise "
            "--warmup_steps, set --max_grad_norm, or check the data for bad values"
        )

    def end_epoch(self, epoch: int, step: int, metrics: dict) -> None:
        """The epoch's evaluation in the trackers and the log; the training clock restarts after it."""
        self.accelerator.log({**metrics, "epoch": epoch}, step=step)
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        loss = "n/a" if self.train_loss is None else f"{self.train_loss:.4f}"
        logger.info(f"epoch {epoch}: step {step}, train_loss {loss}, {shown}")
        self._clock = time.perf_counter()

    def summary(self, progress: Progress, tokens_per_sample: int | None = None) -> dict:
        """What results.json reports about training. samples_per_second spans every step of this run;
        steady_samples_per_second leaves out the first, whose one-time costs (kernel selection, the
        allocator, torch.compile) a short run cannot amortize."""
        self._bar.close()
        rate = self._samples / self.train_seconds if self.train_seconds else None
        steady = None
        if self._first and progress.step - self._start_step > 1 and self.train_seconds > self._first[0]:
            steady = (self._samples - self._first[1]) / (self.train_seconds - self._first[0])
        epoch_samples = self.plan.epoch_rounds * self.plan.round_samples
        summary = {
            "steps": progress.step,
            "epochs": round(progress.samples_seen / epoch_samples, 2),
            "samples_seen": progress.samples_seen,
            "train_loss": self.train_loss,
            "samples_per_second": rate,
            "steady_samples_per_second": steady,
            "log_history": self.history,
        }
        if tokens_per_sample:
            summary["tokens_per_second"] = rate * tokens_per_sample if rate else None
            summary["steady_tokens_per_second"] = steady * tokens_per_sample if steady else None
        return summary


class Checkpoints:
    """When the full training state is saved (every --checkpointing_steps N steps, or each epoch), what
    a checkpoint records beside it, and resuming one.

    A checkpoint records the position in samples (common.data.EpochSampler), the layout that wrote
    it, the plan's length and warmup in samples, the recipe's declared name and the model's
    signature: another recipe or model is refused, another layout continues (plan_run)."""

    def __init__(self, accelerator, args, plan: TrainingPlan, recipe: str):
        self.accelerator, self.args, self.plan = accelerator, args, plan
        every = args.checkpointing_steps or ""
        self.every = int(every) if every.isdigit() else 0
        self.each_epoch = every == "epoch"
        self.identity = {"recipe": recipe, **model_signature(accelerator)}
        self._saved_step = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, progress: Progress, log: TrainLog, model) -> Path:
        """Save the state at this step (once: a stop right after a scheduled save reuses it); refuse to
        save a run whose loss or weights are no longer finite."""
        path = Path(self.args.output_dir) / f"checkpoint-{progress.step}"
        if self._saved_step == progress.step:
            return path
        log.check_finite(progress.step, model)
        position = asdict(progress)
        if self.plan.num_samples - progress.samples_in_epoch < self.plan.round_samples:  # epoch done: the next
            position.update(epoch=progress.epoch + 1, samples_in_epoch=0)
        plan = self.plan
        state = {
            **position,
            **self.identity,
            "world_size": self.accelerator.num_processes,
            "per_device_train_batch_size": plan.per_device_batch_size,
            "gradient_accumulation_steps": plan.gradient_accumulation_steps,
            "effective_batch_size": plan.effective_batch_size,
            "learning_rate": plan.learning_rate,
            "num_samples": plan.num_samples,
            "total_samples": plan.total_samples,
            "warmup_samples": plan.warmup_samples,
            "args": public_args(self.args),
        }
        self._saved_step = progress.step
        return save_checkpoint(
            self.accelerator, self.args.output_dir, progress.step, state, total_limit=self.args.save_total_limit
        )

    def restore(self, path: Path, optimizer, scheduler) -> None:
        """Load the state saved at `path` into the prepared objects, then apply this run's optimizer
        settings: the checkpoint's param groups would otherwise bring back its learning rate, weight
        decay and momentum, silently overriding the command line. What differs is logged."""
        skip = ("params", "lr", "initial_lr")
        fresh = [{k: v for k, v in group.items() if k not in skip} for group in optimizer.param_groups]
        schedule = getattr(scheduler, "scheduler", scheduler)
        ours = hasattr(schedule, "lr_lambdas")  # common.scaling.make_scheduler's, not a DeepSpeed config's
        base_lrs = list(schedule.base_lrs) if ours else []
        load_checkpoint(self.accelerator, path, self.identity)
        changed = set()
        for group, settings in zip(optimizer.param_groups, fresh):
            for key, value in settings.items():
                if group.get(key) != value:
                    changed.add(f"{key} {group.get(key)} -> {value}")
                group[key] = value
        if ours:
            if schedule.base_lrs != base_lrs:
                changed.add(f"learning rate {schedule.base_lrs[0]:.4g} -> {base_lrs[0]:.4g}")
            schedule.base_lrs = base_lrs
            for group, base, factor in zip(optimizer.param_groups, base_lrs, schedule.lr_lambdas):
                group["initial_lr"], group["lr"] = base, base * factor(schedule.last_epoch)
            schedule._last_lr = [group["lr"] for group in optimizer.param_groups]
        if changed:
            logger.warning(f"resumed {path} with this run's optimizer settings: {', '.join(sorted(changed))}")
