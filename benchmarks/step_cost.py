"""What the recipes' machinery costs per optimizer step, measured where nothing else is: a model
so small that a step is almost all overhead, trained in one process once by the recipes' loop
(accelerator.prepare, the accumulation windows, backward, the prepared optimizer and scheduler, the
training log, the checkpoint schedule and the stop check) and once by a bare PyTorch loop, alternating.
The difference is microseconds per step, a fixed cost: it is under 2% of any step 50 times longer.
Timed in the CPU time of the thread that trains (time.thread_time), which other work on the machine
disturbs less than the wall clock; each round runs every loop once, each loop first in turn.

    python benchmarks/step_cost.py --out step_cost.json        # overhead.py runs it
    python benchmarks/step_cost.py --out step_cost.json --files  # the files a plain step runs code of
"""

import collections
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchlib import load_recipe  # noqa: E402

import common  # noqa: E402
from common.args import ArgumentParser  # noqa: E402

BATCH, FEATURES, LOGGING_STEPS = 8, 16, 20
OURS = ("common", "recipes", "scripts")  # the code a recipe runs (this file stands for a recipe)


def make(seed=0):
    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(4096, FEATURES), torch.randint(0, 4, (4096,)))
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return data, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def bare(steps, device):
    data, model, optimizer = make()
    model.to(device)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    done, tic = 0, time.thread_time()
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
    return (time.thread_time() - tic) / steps


def bare_accelerate(steps, accelerator):
    """The bare loop through Accelerate's prepared model, optimizer and loader: what any Accelerate
    script pays, before the recipes' own machinery."""
    data, model, optimizer = make()
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    done, tic = 0, time.thread_time()
    while done < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    loss.item()
    seconds = time.thread_time() - tic
    accelerator.free_memory()  # forget the prepared objects (not timed)
    return seconds / steps


def recipe_args(steps, out):
    parser = common.training_parser("step_cost", "step cost")
    from common.args import TRAINING_HYPERPARAMETERS as shared  # the shared arguments' values, a recipe's

    parser.set_defaults(**{k: v for k, v in load_recipe("cifar").HYPERPARAMETERS.items() if k in shared})
    argv = ["--output_dir", str(out), "--per_device_train_batch_size", str(BATCH), "--max_train_steps", str(steps)]
    return parser.parse_args([*argv, "--num_train_epochs", "1000", "--logging_steps", str(LOGGING_STEPS)])


def recipe(steps, accelerator, out, profile=None):
    """The recipes' loop (recipes/cifar.py's main, less the model's own work), line for line. `profile(position)`, if
    given, returns a sys.setprofile function for the loop (files_a_plain_step_runs)."""
    args = recipe_args(steps, out)
    data, model, optimizer = make()
    train_dl = common.make_dataloader(data, BATCH, train=True, seed=0, num_workers=0)
    plan, position = common.plan_run(args, data, accelerator.num_processes)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    no_saves = SimpleNamespace(resume_from=None)  # the run ends before its first checkpoint (none is asked for)
    loop = common.TrainingLoop(
        accelerator, args, plan, position, no_saves, model, evaluate=lambda stop: {"eval_loss": 0.0}
    )
    sys.setprofile(profile(position) if profile is not None else None)
    tic = time.thread_time()
    for step in loop.steps(train_dl, optimizer):
        for x, y in step.micro_batches():
            step.backward(F.cross_entropy(model(x), y), items=y.shape[0])
        optimizer.step()
        model.zero_grad()
    sys.setprofile(None)
    loop.summary()
    seconds = time.thread_time() - tic
    accelerator.free_memory()  # forget the prepared objects (not timed)
    return seconds / steps


def files_a_plain_step_runs(accelerator, out, steps: int = 60) -> list[str]:
    """The files of this repository (common/, recipes/, scripts/) whose functions a plain optimizer step of `recipe`'s
    loop calls: a step that neither logs (every LOGGING_STEPS), checkpoints, evaluates nor stops; the recipe's own
    body runs in its frame, not called, and is the third. Each call counts in the step the position was at when it
    started (the end of step v's bookkeeping, then step v+1's batches and body); the first and last steps are left
    out."""
    by_step = collections.defaultdict(set)

    def profile(position):
        def hook(frame, event, arg):
            path = Path(frame.f_code.co_filename)
            if event == "call" and path.is_relative_to(REPO) and path.relative_to(REPO).parts[0] in OURS:
                by_step[position.step].add(path.relative_to(REPO).as_posix())

        return hook

    recipe(steps, accelerator, out, profile)
    plain = [files for step, files in by_step.items() if step % LOGGING_STEPS and 0 < step < steps - 1]
    return sorted(set().union(*plain))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type="positive_int", default=300)
    p.add_argument("--repeats", type="positive_int", default=9)
    p.add_argument("--files", action="store_true", help="print the files a plain step runs code of, and exit")
    return p


def main():
    args = build_parser().parse_args()
    torch.set_num_threads(1)  # a step this small only waits for more threads
    accelerator = common.make_accelerator(recipe_args(args.steps, args.out.parent / "step_cost_run"), cpu=True)
    if args.files:
        print(" ".join(files_a_plain_step_runs(accelerator, args.out.parent / "step_cost_run")))
        return
    loops = {
        "bare": lambda: bare(args.steps, accelerator.device),
        "bare_accelerate": lambda: bare_accelerate(args.steps, accelerator),
        "recipe": lambda: recipe(args.steps, accelerator, args.out.parent / "step_cost_run"),
    }
    measured = {name: [] for name in loops}
    for rep in range(args.repeats + 1):  # the first round warms every loop up and is dropped
        for name in list(loops)[rep % 3 :] + list(loops)[: rep % 3]:  # each loop first in turn
            seconds = loops[name]()
            if rep:
                measured[name].append(seconds * 1e6)

    def median_gap(a, b):  # rounds pair the loops run side by side: the machine's drift cancels
        return statistics.median(x - y for x, y in zip(measured[a], measured[b]))

    result = {
        "device": str(accelerator.device),
        "steps": args.steps,
        "repeats": args.repeats,
        **{f"{name}_us_per_step": values for name, values in measured.items()},
        "bare_us_per_step_median": statistics.median(measured["bare"]),
        "machinery_us_per_step": median_gap("recipe", "bare"),
        "accelerate_us_per_step": median_gap("bare_accelerate", "bare"),
        "recipes_own_us_per_step": median_gap("recipe", "bare_accelerate"),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        {
            k: round(v, 1)
            for k, v in result.items()
            if k.endswith(("median", "machinery_us_per_step", "own_us_per_step"))
        }
    )


if __name__ == "__main__":
    main()
    # as a recipe's process ends: torch's C++ threads can abort the interpreter's teardown (exit 134) after the
    # results are written
    from common.runtime import exit_without_teardown

    exit_without_teardown(0)
