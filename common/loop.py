"""The bookkeeping around a recipe's training loop; the loop itself (forward, backward, clip,
step) stays in the recipe.

    loop = common.TrainLoop(accelerator, args, plan, train_dl, scheduler)
    loop.resume(resume_from)
    for epoch in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                ...forward, backward, clip, optimizer.step(), zero_grad()
            if loop.end_of_batch(loss):
                break
        loop.end_epoch(evaluate(...))
    summary = loop.finish()

What it keeps right: on SIGTERM/SIGUSR1 every process stops after the same optimizer step, saves a
checkpoint there and raises Preempted (see preemption.py); the position saved with a checkpoint
is the next batch to train, so a resumed run replays exactly the batches it had not seen; the
scheduler advances once per optimizer step;
the logged loss is averaged over every micro-batch and every process since the last log; epochs
are set on the sampler and the dataset so shuffling and augmentation follow the epoch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import load_checkpoint, model_signature, save_checkpoint
from .data import set_epoch
from .metrics import public_args
from .preemption import Preempted, StopAgreement
from .runtime import logger


class TrainLoop:
    def __init__(self, accelerator, args, plan, train_dl, scheduler):
        self.accelerator, self.args, self.plan, self.train_dl, self.scheduler = accelerator, args, plan, train_dl, scheduler
        self.step = self.start_step = self.start_epoch = self.skip_batches = self.batches_in_epoch = self.epoch = 0
        self.train_loss, self.history, self.train_seconds = float("nan"), [], 0.0
        # Counted in batches, not steps x effective batch: at an epoch's end Accelerate steps the
        # optimizer after fewer micro-batches than --gradient_accumulation_steps.
        self._batches, self._epoch_tic, self._first_step = 0, 0.0, None  # (seconds, batches) at step 1
        self._loss_sum, self._loss_count = torch.zeros((), device=accelerator.device), 0
        every = args.checkpointing_steps or ""
        self.checkpoint_every = int(every) if every.isdigit() else 0
        # A saved data position means something only with the same processes and batch layout.
        self.must_match = {"world_size": accelerator.num_processes,
                           "per_device_train_batch_size": args.per_device_train_batch_size,
                           "gradient_accumulation_steps": args.gradient_accumulation_steps}
        # ...and the weights mean something only to the same recipe and model.
        self.identity = {"recipe": Path(sys.argv[0]).stem, **model_signature(accelerator)}
        self.stop = StopAgreement(accelerator)
        self.saved_step = None
        self.progress = None

    @property
    def done(self) -> bool:
        return self.step >= self.plan.max_train_steps

    def resume(self, path) -> None:
        """Restore the state saved at `path` (None: start at step 0) and open the progress bar."""
        if path:
            state = load_checkpoint(self.accelerator, path, self.must_match, self.identity)
            self.step, self.start_epoch, self.skip_batches = state["step"], state["epoch"], state["batches_in_epoch"]
        self.start_step = self.step
        self.progress = tqdm(total=self.plan.max_train_steps, initial=self.step,
                             disable=not self.accelerator.is_local_main_process,
                             mininterval=0.1 if sys.stderr.isatty() else 30)  # batch logs (Slurm): a line per 30 s

    def epochs(self):
        for epoch in range(self.start_epoch, self.plan.num_epochs):
            if self.done:  # also when resumed from the last checkpoint
                break
            self.epoch = epoch
            set_epoch(self.train_dl, epoch)
            yield epoch
        self.progress.close()

    def batches(self):
        """This epoch's batches, starting after those a resumed checkpoint had already trained."""
        loader = self.accelerator.skip_first_batches(self.train_dl, self.skip_batches) if self.skip_batches else self.train_dl
        self.batches_in_epoch, self.skip_batches = self.skip_batches, 0
        self._epoch_tic = time.perf_counter()
        try:
            yield from loader
        finally:
            self.train_seconds += time.perf_counter() - self._epoch_tic

    def end_of_batch(self, loss) -> bool:
        """Call after each batch's optimizer.step(); returns True once max_train_steps is reached."""
        self.batches_in_epoch += 1
        self._batches += 1
        self._loss_sum += loss.detach()
        self._loss_count += 1
        if not self.accelerator.sync_gradients:  # an accumulation micro-step: no optimizer step yet
            return False
        self.scheduler.step()
        self.step += 1
        if self.step == self.start_step + 1:  # one-time costs: kernel selection, allocator, torch.compile
            self._first_step = (self.train_seconds + time.perf_counter() - self._epoch_tic, self._batches)
        self.progress.update(1)
        if self.step % self.args.logging_steps == 0 or self.done or self.batches_in_epoch == len(self.train_dl):
            self.train_loss = self.accelerator.reduce(self._loss_sum / self._loss_count, reduction="mean").item()
            self._loss_sum.zero_()
            self._loss_count = 0
            # train_seconds: this run's training time so far, read after the loss reached the host
            # (a device sync), so consecutive logs time the steps between them (benchmarks/)
            self.history.append({"step": self.step, "train_loss": self.train_loss, "lr": self.scheduler.get_last_lr()[0],
                                 "train_seconds": round(self.train_seconds + time.perf_counter() - self._epoch_tic, 4)})
            self.accelerator.log(self.history[-1], step=self.step)
            self.progress.set_postfix(loss=f"{self.train_loss:.4f}")
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self.save_checkpoint()
        stop_signal = self.stop.poll()
        if stop_signal:
            raise Preempted(stop_signal, self.step, self.save_checkpoint())
        return self.done

    def end_epoch(self, metrics: dict) -> None:
        self.accelerator.log({**metrics, "epoch": self.epoch}, step=self.step)
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        logger.info(f"epoch {self.epoch}: step {self.step}, train_loss {self.train_loss:.4f}, {shown}")
        if self.args.checkpointing_steps == "epoch":
            self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        path = Path(self.args.output_dir) / f"checkpoint-{self.step}"
        if self.saved_step == self.step:  # e.g. a stop signal right after a scheduled save
            return path
        epoch, batches = self.epoch, self.batches_in_epoch
        if batches == len(self.train_dl):  # a finished epoch resumes at the start of the next
            epoch, batches = epoch + 1, 0
        self.saved_step = self.step
        return save_checkpoint(self.accelerator, self.args.output_dir, self.step,
                               {"epoch": epoch, "batches_in_epoch": batches, **self.must_match, **self.identity,
                                "effective_batch_size": self.plan.effective_batch_size, "args": public_args(self.args)},
                               total_limit=getattr(self.args, "save_total_limit", None))

    def finish(self, tokens_per_sample: int | None = None) -> dict:
        """What results.json reports about training (tokens/s too, given the tokens in a sample).
        samples_per_second spans every training batch of this run; steady_samples_per_second leaves
        out the first optimizer step, whose one-time costs a short run cannot amortize."""
        self.stop.close()
        per_batch = self.args.per_device_train_batch_size * self.accelerator.num_processes  # drop_last: all full
        per_second = self._batches * per_batch / self.train_seconds if self.train_seconds else None
        first_seconds, first_batches = self._first_step or (0.0, 0)
        steady_seconds = self.train_seconds - first_seconds
        steady = ((self._batches - first_batches) * per_batch / steady_seconds
                  if self.step - self.start_step > 1 and steady_seconds > 0 else None)
        summary = {
            "steps": self.step,
            "epochs": round(self.step / self.plan.steps_per_epoch, 2),
            "train_loss": self.train_loss,
            "samples_per_second": per_second,
            "steady_samples_per_second": steady,
            "log_history": self.history,
        }
        if tokens_per_sample:
            summary["tokens_per_second"] = per_second * tokens_per_sample if per_second else None
            summary["steady_tokens_per_second"] = steady * tokens_per_sample if steady else None
        return summary
