"""What a run reports: the training log (loss, learning rate, rates, progress bar), peak memory, results.json."""

from __future__ import annotations

import atexit
import json
import math
import os
import resource
import socket
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from .args import public_args
from .checkpoint import read_state, write_json
from .runtime import RecipeError, library_versions, logger

INPUT_BOUND = 0.2  # of a step spent waiting for data, on the median rank: the run is input-bound


class TrainLog:
    """The training loss weighted by items (samples, or target tokens) over micro-batches and processes, its
    history, the progress bar, the rates, and each rank's step and data times (naming a straggler). The loop hands
    it each micro-batch's loss and each step; a log costs one collective. Resumed (`resume_from`, a checkpoint), it
    goes on with the checkpoint's history and the loss since its last log, as if never stopped."""

    def __init__(self, accelerator, plan, start, logging_steps: int, resume_from=None, loader_fixes: str = ""):
        self.accelerator, self.plan, self.logging_steps = accelerator, plan, logging_steps
        self.loader_fixes, self._logs = loader_fixes, 0  # said with a run whose steps wait for their data
        self.hosts = gather_object([socket.gethostname()])
        # each micro-batch's loss (on its device), its weight and its items since the last log: a log sums them,
        # so a step adds three list entries and makes no host sync and no tensor
        self.train_loss, self.history, self._losses, self._weights, self._items = None, [], [], [], []
        self.eval_history = []  # each evaluation's metrics, at its step
        self.window, self._offset = [0.0, 0.0], 0.0  # (loss x per, items) since the last log, all processes
        if resume_from is not None:
            state = read_state(resume_from)
            self.history, (loss, items) = state.get("log_history", []), state.get("log_window", [0.0, 0.0])
            self.eval_history = state.get("eval_history", [])
            self.train_loss = self.history[-1]["train_loss"] if self.history else None  # if nothing is left to train
            if items:  # every process's sums, added once; the others add nothing, as every process must log then
                share = items if accelerator.is_main_process else 0
                self.add(torch.tensor(loss / items, device=accelerator.device), share)
            self._offset = state.get("train_seconds", self.history[-1]["train_seconds"] if self.history else 0.0)
        self._start = self._at = (start.step, start.seen, None)  # this run's start, its last step: (step, seen, lr)
        self._first = None  # (train_seconds, seen) after the first step
        self.train_seconds, self.data_seconds, self._clock = 0.0, 0.0, time.perf_counter()
        self.per_rank = torch.zeros(accelerator.num_processes, 3, dtype=torch.float64)  # steps, seconds, data s
        self._streak = (None, 0)  # a rank slow to get its data, and for how many logs in a row
        self._bar = tqdm(
            total=plan.max_train_steps,
            initial=start.step,
            disable=not accelerator.is_local_main_process,
            mininterval=0.1 if sys.stderr.isatty() else 30,  # batch logs (Slurm): a line per 30 s
        )
        atexit.register(self._bar.close)  # a run stopped early ends the bar's line: launch.sh's own starts a new one

    def add(self, loss: torch.Tensor, items, per=None) -> None:
        """A micro-batch's loss, a mean over `per` items (default `items`; an LM's is a share of the step's mean
        over every process's target tokens)."""
        self._losses.append(loss.detach())
        self._weights.append(items if per is None else per)
        self._items.append(items)

    def step(self, step: int, seen: int, lr: float | None = None, waited: float = 0.0, now: float | None = None):
        """After each optimizer step: the clock, the bar, and every --logging_steps a log. `lr`: a DeepSpeed
        config's own scheduler's rate (else the plan's); `waited`: the seconds this step waited for its data; `now`:
        time.perf_counter() as the step ended (the loop's, which also beats the watchdog with it)."""
        now = time.perf_counter() if now is None else now
        self.train_seconds += now - self._clock
        self.data_seconds += waited
        self._clock, self._at = now, (step, seen, lr)
        self._first = self._first or (self.train_seconds, seen)
        self._bar.update(1)
        if step % self.logging_steps == 0 or step >= self.plan.max_train_steps:
            self._flush()
        if step >= self.plan.max_train_steps:  # its rate is training's: the final evaluation and save are not
            self._bar.close()

    @property
    def seconds(self) -> float:
        """The run's training time so far, its stopped attempts' included (a checkpoint keeps it)."""
        return self._offset + self.train_seconds

    def _flush(self) -> None:
        """The loss since the last log into the history; train_seconds is read after the loss reached the host (a
        device sync), so consecutive logs time the steps between them."""
        if not self._losses:
            return
        step, seen, lr = self._at
        sums, times = self._sums()
        self._losses, self._weights, self._items = [], [], []
        self.train_loss = float(sums[0] / sums[1]) if sums[1] > 0 else None  # no items: no mean
        if self.train_loss is not None and not math.isfinite(self.train_loss):
            raise _diverged(step, f"the training loss became {self.train_loss}")
        record = {"step": step, "samples_seen": seen, "train_loss": self.train_loss}
        record.update(lr=self.plan.lr_at(seen) if lr is None else lr, **self._stragglers(times))
        self.history.append({**record, "train_seconds": round(self.seconds, 4)})
        self.accelerator.log({k: v for k, v in record.items() if v is not None}, step=step)
        self._bar.set_postfix(loss="n/a" if self.train_loss is None else f"{self.train_loss:.4f}")

    def _sums(self, extra=0.0) -> tuple:
        """(loss x per, items, extra) summed over the micro-batches since the last log and every process, and each
        process's (steps, step seconds, data seconds) since the last gather: one all-gather."""
        times = [self._at[0] - self._start[0], self.train_seconds, self.data_seconds]
        local = torch.tensor([0, 0, extra, *times], dtype=torch.float64, device=self.accelerator.device)
        if self._losses:
            losses = torch.stack(self._losses).double()
            local[0] = (losses * as_column(self._weights, local.device)).sum()
            local[1] = as_column(self._items, local.device).sum()
        everyone = self.accelerator.gather(local).view(-1, 6).cpu()
        since, self.per_rank = everyone[:, 3:] - self.per_rank, everyone[:, 3:]
        return everyone[:, :3].sum(0), since

    def _stragglers(self, times: torch.Tensor) -> dict:
        """Each process's mean step and data wait since the last log; a warning, once, for a rank that waits for its
        data a fifth of a step longer than the median rank three logs in a row: every rank waits for it."""
        per_step = times[:, 1:] / times[:, :1].clamp(min=1)
        (step_rank, rank), (median_step, median_data) = per_step.argmax(0).tolist(), per_step.median(0).values.tolist()
        self._input_bound(median_step, median_data)
        if len(times) < 2:
            return {}
        slowest_step, slowest_data = per_step[step_rank, 0].item(), per_step[rank, 1].item()
        slow = slowest_data - median_data > 0.2 * median_step
        self._streak = (rank, self._streak[1] + 1 if slow and self._streak[0] == rank else int(slow))
        if self._streak[1] == 3:
            logger.warning(
                f"rank {rank} ({self.hosts[rank]}) is a straggler: it waits {slowest_data:.3f} s a step for its data "
                f"where the median rank waits {median_data:.3f} s (a step takes {median_step:.3f} s), and every rank "
                "waits for it at each gradient all-reduce; give it more loader workers (--dataloader_num_workers), "
                "use --data_on_device, or check its node's filesystem and CPU load"
            )
        return {
            "step_seconds_slowest_rank": step_rank,
            "step_seconds_slowest": round(slowest_step, 4),
            "step_seconds_median": round(median_step, 4),
            "data_seconds_slowest_rank": rank,
            "data_seconds_slowest": round(slowest_data, 4),
            "data_seconds_median": round(median_data, 4),
        }

    def _input_bound(self, step: float, waited: float) -> None:
        """A warning, once, when the median rank's steps spend more than INPUT_BOUND of their time waiting for data
        (every rank, not one straggler): the accelerator idles that share of the run. Not at the first log, whose
        steps wait for loader workers to start."""
        self._logs += 1
        if self._logs == 2 and step > 0 and waited / step > INPUT_BOUND:
            logger.warning(
                f"the steps wait for their data: {waited / step:.0%} of each step ({waited:.3f} s of {step:.3f} s, "
                f"the median rank) is spent waiting for the next batch, while the model idles; {self.loader_fixes}"
            )

    def check_finite(self, step: int, model) -> None:
        """Before a save: raise if the loss since the last log or the weights this process holds are NaN or inf."""
        sums, _ = self._sums(
            float(any(t.numel() and not torch.isfinite(t).all() for t in local_parameter_tensors(model)))
        )
        self.window = [float(sums[0]), float(sums[1])]  # what a checkpoint keeps of the log (save_checkpoint)
        if not math.isfinite(loss := float(sums[0] / sums[1].clamp(min=1))):
            raise _diverged(step, f"the training loss became {loss}")
        if sums[2] > 0:
            raise _diverged(step, "the weights hold NaN or inf")

    def evaluated(self, position, metrics: dict) -> None:
        """An evaluation's metrics (its numbers: per-class tables go to results.json alone), with the loss since the
        last log, in the trackers and the log; the training clock restarts after it (evaluation time is not training
        time)."""
        self._flush()
        epoch = self.plan.epochs(position)
        metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}  # tables: results.json's alone
        self.accelerator.log({**metrics, "epoch": epoch}, step=position.step)
        self.eval_history.append(
            {"step": position.step, "samples_seen": position.seen, "epoch": round(epoch, 4), **metrics}
        )
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        loss = "n/a" if self.train_loss is None else f"{self.train_loss:.4f}"
        logger.info(f"epoch {position.epoch}: step {position.step}, train_loss {loss}, {shown}")
        self._clock = time.perf_counter()

    def summary(self, position, tokens_per_sample: int | None = None) -> dict:
        """What results.json reports about training; steady_samples_per_second leaves out the first step, whose
        one-time costs (kernel selection, the allocator, torch.compile) a short run cannot amortize."""
        self._bar.close()
        atexit.unregister(self._bar.close)
        steps, samples = position.step - self._start[0], position.seen - self._start[1]
        rate = samples / self.train_seconds if steps and self.train_seconds else None
        per_step = self.per_rank[:, 1:] / self.per_rank[:, :1].clamp(min=1)  # each rank's mean step and data wait
        median_step, median_data = per_step.median(0).values.tolist()
        steady = None
        if steps > 1 and self.train_seconds > self._first[0]:
            steady = (position.seen - self._first[1]) / (self.train_seconds - self._first[0])
        summary = {
            "steps": position.step,
            "epochs": round(self.plan.epochs(position), 2),
            "samples_seen": position.seen,
            "train_loss": self.train_loss,
            "samples_per_second": rate,
            "steady_samples_per_second": steady,
            "data_wait_share": round(median_data / median_step, 4) if median_step else None,  # the median rank's
            "log_history": self.history,
            "eval_history": self.eval_history,
            "per_rank": [
                {"rank": r, "host": host, "step_seconds": round(s, 4), "data_seconds": round(d, 4)}
                for r, (host, (s, d)) in enumerate(zip(self.hosts, per_step.tolist()))
            ],
        }
        if tokens_per_sample:
            summary["tokens_per_second"] = rate * tokens_per_sample if rate else None
            summary["steady_tokens_per_second"] = steady * tokens_per_sample if steady else None
        return summary


def as_column(values: list, device) -> torch.Tensor:
    """Numbers (a batch's samples) or tensors (an LM's target tokens, counted on the device) as one float64 tensor:
    numbers in one call, not one tensor each."""
    if not any(isinstance(v, torch.Tensor) for v in values):
        return torch.tensor(values, dtype=torch.float64, device=device)
    return torch.stack([torch.as_tensor(v, device=device).double() for v in values])


def _diverged(step: int, what: str) -> RecipeError:
    return RecipeError(
        f"{what} by step {step}; nothing was saved after it: lower --learning_rate, raise --warmup_steps, set "
        "--max_grad_norm, or check the data for bad values",
        subject="--learning_rate",
    )


def count_parameters(model, trainable_only=False) -> int:
    """Parameters, also under ZeRO-3, where a process holds a shard (`ds_numel`: the full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable_only)


def parameters_per_process(accelerator, model) -> list:
    """Parameter elements each process holds: all of them under DDP, about 1/N under ZeRO-3 or FSDP."""
    return accelerator.gather(
        torch.tensor([sum(t.numel() for t in local_parameter_tensors(model))], device=accelerator.device)
    ).tolist()


def local_parameter_tensors(model):
    """The parameter tensors this process holds in memory: its ZeRO-3 or FSDP shard of each, or under DDP the whole
    of each. What a per-process count or a finiteness check must look at: model.parameters() alone are empty
    placeholders under ZeRO-3 and sharded DTensors under FSDP2."""
    return (
        p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
        for p in model.parameters()
    )


PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 per GPU (datasheets, SXM)


def memory_estimates(accelerator, model) -> dict:
    """DeepSpeed's own estimate of model-state memory (weights, gradients, Adam states; not
    activations) per GPU and per node's CPU, in GiB, for ZeRO-2 and ZeRO-3 with and without offload,
    for this run's processes spread over nodes as the launcher placed them; logged and returned ({} without
    DeepSpeed installed: the recipe also trains under DDP and FSDP)."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2
    except ImportError:
        logger.info("no memory estimate: DeepSpeed is not installed (pip install -e '.[deepspeed]' adds it)")
        return {}

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    where = {"num_gpus_per_node": per_node, "num_nodes": max(1, accelerator.num_processes // per_node)}
    total = count_parameters(model)
    largest = max(sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False)) for m in model.modules())
    cases = {
        "zero2": zero2(total, cpu_offload=False, **where),
        "zero2_offload_optimizer": zero2(total, cpu_offload=True, **where),
        "zero3": zero3(total, largest, cpu_offload=False, **where)[:2],
        "zero3_offload_optimizer": zero3(total, largest, cpu_offload=True, cpu_offload_params=False, **where)[:2],
        "zero3_offload_all": zero3(total, largest, cpu_offload=True, **where)[:2],
    }
    estimates = {
        **where,
        "parameters": total,
        "largest_layer_parameters": largest,
        **{name: {"gpu_gb": gpu / 2**30, "cpu_gb": cpu / 2**30} for name, (cpu, gpu) in cases.items()},
    }
    logger.info(
        f"DeepSpeed's model-state memory estimate for {estimates['parameters'] / 1e6:.1f}M parameters on "
        f"{estimates['num_nodes']} node(s) x {estimates['num_gpus_per_node']} device(s), activations not included:\n"
        + "\n".join(
            f"  {name:<24} {e['gpu_gb']:8.2f} GiB per device {e['cpu_gb']:8.2f} GiB CPU per node"
            for name, e in estimates.items()
            if isinstance(e, dict)
        )
    )
    return estimates


def mfu(accelerator, tokens_per_second: float | None, flops_per_token: float):
    """Model FLOPs utilisation: training FLOP/s over the devices' peak; None where the peak is unknown."""
    if accelerator.device.type != "cuda" or not tokens_per_second:
        return None
    name = torch.cuda.get_device_name(accelerator.device)
    peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
    return None if peak is None else tokens_per_second * flops_per_token / (peak * accelerator.num_processes)


def peak_memory_gb(accelerator) -> dict:
    """Peak memory of every process: the accelerator's allocator on GPU, the resident set on CPU."""
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
    """results.json, written atomically by the main process: what every run reports and the recipe's `metrics`
    (a number that is not finite as null: JSON has no NaN, json.dumps writes one all the same)."""
    record = {
        "world_size": accelerator.num_processes,  # the group that formed: make_accelerator refuses a smaller one
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "effective_batch_size": plan.effective_batch_size,
        "learning_rate": plan.learning_rate,
        "max_train_steps": plan.max_train_steps,
        "warmup_steps": plan.warmup_steps,
        "data_fingerprint": plan.data_fingerprint,  # what a checkpoint records of the training data (common.data)
        **metrics,
        **peak_memory_gb(accelerator),  # a gather: every process takes part
        "versions": library_versions(),
        "args": public_args(args),
        "finished_at": time.time(),  # a copy of the folder has new file times: `latest` compares this
    }
    path = Path(args.output_dir) / "results.json"  # the folder OutputDir claimed
    if accelerator.is_main_process:
        number = lambda v: v.tolist() if hasattr(v, "tolist") else str(v)  # noqa: E731  a tensor's or numpy's
        write_json(path, json.loads(json.dumps(record, default=number), parse_constant=lambda nan: None))
    accelerator.wait_for_everyone()
    return path
