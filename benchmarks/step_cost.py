"""What the recipes' machinery costs per optimizer step, measured where nothing else is: a model
so small that a step is almost all overhead, trained in one process once by the recipes' loop
(accelerator.prepare, the accumulation windows, backward, the prepared optimizer and scheduler, the
training log, the checkpoint schedule and the stop check) and once by a bare PyTorch loop, alternating.
The difference is microseconds per step, a fixed cost: it is under 2% of any step 50 times longer.

    python benchmarks/step_cost.py --out step_cost.json        # overhead.py runs it
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate import Accelerator  # noqa: E402
from benchlib import load_recipe  # noqa: E402

import common  # noqa: E402

BATCH, FEATURES = 8, 16


def make(seed=0):
    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(4096, FEATURES), torch.randint(0, 4, (4096,)))
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return data, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def bare(steps, device):
    data, model, optimizer = make()
    model.to(device)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    done, tic = 0, time.perf_counter()
    while done < steps:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    loss.item()
    return (time.perf_counter() - tic) / steps


def recipe(steps, accelerator, out):
    parser = common.training_parser("step cost")
    parser.set_defaults(**load_recipe("cifar").HYPERPARAMETERS)  # the shared arguments' values, a recipe's
    args = parser.parse_args(
        [
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            str(BATCH),
            "--max_train_steps",
            str(steps),
            "--num_train_epochs",
            "1000",
            "--logging_steps",
            "20",
        ],
    )
    data, model, optimizer = make()
    train_dl = common.make_dataloader(data, BATCH, train=True, seed=0, num_workers=0)
    plan, progress = common.plan_run(args, len(data), accelerator.num_processes)
    scheduler = common.make_scheduler(optimizer, "constant", plan, progress)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    checkpoints = common.Checkpoints(accelerator, args, plan, "step_cost")
    stop = common.StopOnSignal(accelerator)
    log = common.TrainLog(accelerator, plan, progress, args.logging_steps)
    tic = time.perf_counter()
    for epoch in range(progress.epoch, plan.num_epochs):  # the recipes' loop, less the model's own work
        for window in common.accumulation_windows(train_dl, args.gradient_accumulation_steps, epoch, progress):
            for i, (x, y) in enumerate(window):
                with common.micro_batch(accelerator, model, last=i == len(window) - 1):
                    loss = F.cross_entropy(model(x), y)
                    accelerator.backward(loss * args.gradient_accumulation_steps / len(window))
                log.add(loss * len(y), len(y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            log.step(progress, window, scheduler.get_last_lr()[0])
            if checkpoints.due(progress.step):
                checkpoints.save(progress, log, model)
            if stop.requested():
                raise SystemExit("stopped")
            if progress.step >= plan.max_train_steps:
                break
        if progress.step >= plan.max_train_steps:
            break
    log.summary(progress)
    return (time.perf_counter() - tic) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)  # a step this small only waits for more threads
    accelerator = Accelerator(cpu=True)
    measured = {"bare": [], "recipe": []}
    for rep in range(args.repeats + 1):  # the first round warms both up and is dropped
        for name in ("bare", "recipe") if rep % 2 else ("recipe", "bare"):
            seconds = (
                bare(args.steps, accelerator.device)
                if name == "bare"
                else recipe(args.steps, accelerator, args.out.parent / "step_cost_run")
            )
            if rep:
                measured[name].append(seconds)
    differences = [r - b for r, b in zip(measured["recipe"], measured["bare"])]
    args.out.write_text(
        json.dumps(
            {
                "device": str(accelerator.device),
                "steps": args.steps,
                "repeats": args.repeats,
                "bare_us_per_step": [s * 1e6 for s in measured["bare"]],
                "recipe_us_per_step": [s * 1e6 for s in measured["recipe"]],
                "machinery_us_per_step": statistics.median(differences) * 1e6,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
