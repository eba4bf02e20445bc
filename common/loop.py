"""The training loop's bookkeeping, written once: what a recipe shows is its data, forward, loss, backward and
update; what carries the guarantees (the rate by samples trained, gradient sync on the last micro-batch only, the
run's position, the log, the stop every process agrees on, checkpoints and evaluation points) is here.

    plan, position = common.plan_run(args, train_dl.dataset, accelerator.num_processes, out.resume_from)
    loop = common.TrainingLoop(accelerator, args, plan, position, out, model, partial(evaluate, model, eval_dl))
    for step in loop.steps(train_dl, optimizer):
        for x, y in step.micro_batches():
            step.backward(loss_fn(model(x), y), items=len(y))
        optimizer.step()
        model.zero_grad()
    metrics = loop.finish()

Between steps a recipe may do what its update needs (clipping, EMA, a second optimizer): the loop moves the position
only once the body of `for step in ...` is done.

Its machinery is paid at every step (benchmarks/step_cost.py), so a step that neither logs, checkpoints, evaluates nor
stops runs code of this file and the TrainLog alone: the loop reads its batches, the rate's schedule, the signal
flags and the watchdog's beats as data (in several processes StopOnSignal.agreed() also all-reduces the flags)."""

from __future__ import annotations

import contextlib
import itertools
import time

from .data import epoch_batches, reading_failed
from .metrics import TrainLog
from .preemption import StopOnSignal
from .runtime import RecipeError
from .watchdog import start_watchdog


class TrainingLoop:
    """The run from `start` (a plan.Position this loop alone moves, in place: an `evaluate` may read the step and
    samples seen from it) to `plan.max_train_steps`. `evaluate(stop)` returns the held-out metrics, or None when
    `stop.requested()` reported a signal; it runs after the last step of each epoch, or every --eval_steps steps where
    the arguments have it, and after the run's last step."""

    def __init__(self, accelerator, args, plan, start, out, model, evaluate):
        self.accelerator, self.plan, self.position, self.out, self.model = accelerator, plan, start, out, model
        self.evaluate, self.metrics = evaluate, {}
        self.checkpointing_steps = args.checkpointing_steps  # None, "epoch" or N optimizer steps
        self.checkpoint_every = self.checkpointing_steps if self.checkpointing_steps != "epoch" else None
        self.eval_steps = getattr(args, "eval_steps", None)
        self.accumulation, self.batch = args.gradient_accumulation_steps, plan.effective_batch_size  # per step
        # signals agreed on by every process; a stalled process named (the watchdog)
        self.stop = StopOnSignal(accelerator, start_watchdog(accelerator, args))
        self.beats = self.stop.watchdog.beats if self.stop.watchdog is not None else None  # appended at each step
        self.optimizer = None  # the one steps() updates
        self.log = TrainLog(accelerator, plan, start, args.logging_steps, out.resume_from, loader_fixes(args))

    def steps(self, train_dl, optimizer=None, scheduler=None):
        """A Step per optimizer step. The rate of each of `optimizer`'s groups is set from the plan (times the group's
        `lr_scale`), unless `scheduler` (a DeepSpeed config's own, stepped by DeepSpeed) sets it."""
        position, plan, self.optimizer = self.position, self.plan, optimizer  # a TP checkpoint saves it by itself
        if self._evaluation_due():  # resumed from a stop at an evaluation point
            self._evaluate()
        groups = optimizer.param_groups if optimizer is not None and scheduler is None else ()
        accumulation, lr, peak, schedule = self.accumulation, None, plan.learning_rate, plan.schedule
        while position.step < plan.max_train_steps:
            batches, ended = epoch_batches(train_dl, position.epoch, position.sample), False
            while position.step < plan.max_train_steps:
                asked = time.perf_counter()  # the data wait: from here until the step's batches are in hand
                window = _read_window(batches, accumulation, position.sample == 0, self.batch)
                waited = time.perf_counter() - asked
                if ended := window is None:
                    break
                if scheduler is None:
                    lr = peak * schedule(position.seen)  # plan.lr_at: by samples, exact on any layout, resumed or not
                    for group in groups:
                        group["lr"] = lr * group.get("lr_scale", 1.0)
                yield Step(self, window)
                self._stepped(waited, scheduler.get_last_lr()[0] if scheduler is not None else None)
            if self._evaluates_at_epoch_end():
                self._evaluate()
            # the epoch is over, not one --max_train_steps cut short (its checkpoint resumes it there)
            if ended or plan.epoch_done(position):
                position.epoch, position.sample = position.epoch + 1, 0
            if self.checkpointing_steps == "epoch":
                self._save_checkpoint()

    def _stepped(self, waited: float, lr: float | None) -> None:
        """After the recipe's update: the position, the log, the watchdog's beat, the agreed stop, an evaluation, a
        checkpoint."""
        position, batch, now = self.position, self.batch, time.perf_counter()
        position.step += 1
        position.sample += batch
        position.seen += batch
        self.log.step(position.step, position.seen, lr, waited, now)
        if self.beats is not None:
            self.beats.append((position.step, now))  # what watchdog.beat(step) records, without the call
        # on every process at the same step; in one process a signal received here is the stop
        if (self.stop.agreeing or self.stop.received) and self.stop.agreed():
            saved = self._save_checkpoint()
            raise self.stop.preempted(position.step, saved)
        if self.eval_steps and self._evaluation_due():
            self._evaluate()
        if self.checkpoint_every and position.step % self.checkpoint_every == 0:
            self._save_checkpoint()  # after the evaluation: it records its metrics

    def _save_checkpoint(self):
        return self.out.save_checkpoint(self.model, self.plan, self.position, self.log, self.optimizer)

    def _evaluation_due(self) -> bool:
        """An --eval_steps point before the run's last step (which the epoch's end evaluates) not yet evaluated: a
        run stopped there evaluates it first when resumed."""
        position, history = self.position, self.log.eval_history
        due = (
            self.eval_steps
            and position.step
            and position.step % self.eval_steps == 0
            and position.step < self.plan.max_train_steps
        )
        return bool(due) and not (history and history[-1]["step"] == position.step)

    def _evaluates_at_epoch_end(self) -> bool:
        """The run's end always; each epoch's end unless --eval_steps sets the points."""
        return self.position.step >= self.plan.max_train_steps or not self.eval_steps

    def _evaluate(self) -> None:
        """Held-out metrics into the log and trackers; a stop during it saves a checkpoint and ends the run, except
        during the final evaluation, which it lets finish."""
        last = self.position.step >= self.plan.max_train_steps
        metrics = self.evaluate(self.stop.progress_only if last else self.stop)
        if metrics is None:
            saved = self._save_checkpoint()
            raise self.stop.preempted(self.position.step, saved, "evaluation")
        self.metrics = metrics
        self.log.evaluated(self.position, metrics)

    def finish(self) -> dict:
        """The final held-out metrics (evaluated now if the run resumed at its end: nothing was left to train), once
        the loss and the weights are checked finite: what the run saves next is worth saving."""
        if not self.metrics:
            self.metrics = self.evaluate(self.stop.progress_only)
        self.log.check_finite(self.position.step, self.model)
        return self.metrics

    def summary(self, tokens_per_sample: int | None = None) -> dict:
        """What results.json reports about training (common.metrics.TrainLog.summary)."""
        return self.log.summary(self.position, tokens_per_sample)


def _read_window(batches, accumulation: int, epoch_start: bool, step_samples: int) -> list | None:
    """The next step's micro-batches from `batches`, or None at the epoch's end (too few left for a whole step)."""
    try:
        window = list(itertools.islice(batches, accumulation))
    except (RecipeError, ValueError) as err:
        window = reading_failed(err)  # a stream's end, or an error raised as what it means
    if len(window) == accumulation:
        return window
    if epoch_start:  # a stream with less than one step (a dataset's size was checked by the plan)
        raise RecipeError(
            f"the training data holds fewer samples than one step trains ({step_samples}); add data, or lower "
            "--per_device_train_batch_size or --gradient_accumulation_steps",
            subject="--per_device_train_batch_size",
        )
    return None


def loader_fixes(args) -> str:
    """What a run whose steps wait for their data can do, as its arguments allow."""
    workers = f"now {args.dataloader_num_workers}" if args.dataloader_num_workers is not None else "default: by CPUs"
    fixes = [f"give the loader more workers (--dataloader_num_workers, {workers})"]
    if getattr(args, "data_on_device", True) is False:
        fixes.append("keep the set on the accelerator with --data_on_device (CIFAR, or images of 64 px or less)")
    if getattr(args, "dataset", None) == "imagefolder":
        fixes.append("read --train_dir from a faster filesystem (a local disk, not a network share)")
    return "; ".join(fixes)


class Step:
    """One optimizer step: `batches`, one per micro-batch of the accumulation window."""

    def __init__(self, loop: TrainingLoop, batches: list):
        self.loop, self.batches = loop, batches

    def micro_batches(self):
        """Each batch, inside the context its backward needs: the gradients are reduced across processes after the
        last micro-batch's backward only (the others run under no_sync)."""
        accelerator, last = self.loop.accelerator, len(self.batches) - 1
        if not last:  # one micro-batch: its backward syncs; a list, no generator to step through
            accelerator.sync_gradients = True
            return self.batches
        return self._under_no_sync(accelerator, last)

    def _under_no_sync(self, accelerator, last: int):
        for i, batch in enumerate(self.batches):
            accelerator.sync_gradients = i == last
            with contextlib.nullcontext() if i == last else accelerator.no_sync(self.loop.model):
                yield batch

    def backward(self, loss, items, of=None) -> None:
        """Backward of a micro-batch's `loss`, logged with its weight. `loss` is the mean over its `items` (samples,
        tokens) when every micro-batch holds as many, or, with `of`, its share of the step's mean over `of` items on
        every process (a loss divided by the step's all-reduced token count)."""
        accelerator = self.loop.accelerator
        if of is None:
            accelerator.backward(loss)  # Accelerate divides by the accumulation steps, DDP averages over processes
        else:  # already this micro-batch's share of the step's mean: undo both. Under tensor parallelism
            # window_tokens counts each token once per process of its TP group, and the gradients are averaged over
            # the data-parallel processes alone (FSDP2 across the groups, or none): the TP degree cancels
            accelerator.backward(loss * len(self.batches) * accelerator.num_processes)
        self.loop.log.add(loss, items, per=of)
