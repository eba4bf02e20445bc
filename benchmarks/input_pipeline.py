"""Input pipeline: the samples/s recipes/cifar.py's DataLoader delivers (decode, crop, flip,
normalize; the recipe's own datasets and transforms) for each num_workers, pin_memory and
persistent_workers, and the --data_on_device path, against the samples/s the model consumes
(training steps on a batch already in memory). A loader slower than the model makes the run
input-bound: more workers, persistent workers or the device-resident path help; a faster one
means compute sets the pace.

    .venv/bin/python benchmarks/input_pipeline.py
    .venv/bin/python benchmarks/input_pipeline.py --cifar_dir data    # CIFAR-10 instead of the digits

Each configuration is timed for --epochs epochs; the first epoch includes starting the workers,
later ones show what persistent_workers saves. In one process, alone: during training the
workers and the model share the same cores (on a CPU-only machine, all of them), so these are
upper bounds of what each side can do, not a combined rate. The recipe itself then runs on each path (one
process, --logging_steps 1): its samples/s and the share of each step it spent waiting for data (results.json's
data_wait_share), and which path it takes by default for this data on this device.
"""

import contextlib
import time
from types import SimpleNamespace

import benchlib
import torch
import torch.nn.functional as F

import common
from common import vision
from common.data import default_num_workers

NAME = "input_pipeline"


def build_parser():
    p = benchlib.parser(__doc__.split("\n")[0])
    p.add_argument("--per_device_train_batch_size", type="positive_int", help="default: 128 (smoke: 32)")
    p.add_argument("--num_workers", type="non_negative_int", nargs="+", help="default: 0, 1, 2, ... up to the cores")
    p.add_argument("--epochs", type="positive_int", help="epochs per configuration")
    p.add_argument(
        "--max_batches", type="positive_int", help="batches per epoch (default: the whole epoch, at most 100)"
    )
    p.add_argument("--model", help="the consumer: default resnet18 (CPU), resnet18_cifar (GPU)")
    p.add_argument("--cifar_dir", help="CIFAR-10 in this folder instead of the bundled digits")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    cuda = benchlib.has_cuda()
    args.per_device_train_batch_size = args.per_device_train_batch_size or (32 if args.smoke else 128)
    args.num_workers = args.num_workers or ([0, 1] if args.smoke else sorted({0, 1, 2, benchlib.cores()}))
    args.epochs = args.epochs or 2
    args.max_batches = args.max_batches or (2 if args.smoke else 100)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.model = args.model or ("resnet18_cifar" if cuda else "resnet18")
    args.work_dir = args.work_dir or args.out / "work"
    return args


def recipe_args(args):
    return [
        *benchlib.cifar_data_args(args),
        "--model",
        args.model,
        "--per_device_train_batch_size",
        str(args.per_device_train_batch_size),
    ]


def loader_rate(loader, epochs, max_batches, device):
    """Samples/s per epoch, each batch moved to the device as the recipe's prepared loader does."""
    rates = []
    for epoch in range(epochs):
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)
        samples, tic = 0, time.perf_counter()
        for i, (images, labels) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            samples += len(labels)
            if i + 1 == max_batches:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(samples / (time.perf_counter() - tic))
    return rates


def consumption_rate(cifar, args, num_classes, device, steps):
    """Samples/s of forward, backward and SGD step on one batch already on the device (bf16 and
    channels_last on CUDA, as the recipe)."""
    model = vision.new_model(args.model, num_classes).to(device)
    images = torch.randn(args.per_device_train_batch_size, 3, 32, 32, device=device)
    labels = torch.randint(0, num_classes, (args.per_device_train_batch_size,), device=device)
    if device.type == "cuda":
        model, images = (
            model.to(memory_format=torch.channels_last),
            images.contiguous(memory_format=torch.channels_last),
        )
    optimizer = cifar.build_optimizer(cifar.parse_args([]), model, 0.01)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step():
        with autocast:
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step().item()  # warm-up: allocator, kernel selection
    tic = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    return steps * len(labels) / (time.perf_counter() - tic)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(benchlib.cores())
    cifar = benchlib.load_recipe("cifar")
    recipe = cifar.parse_args(recipe_args(args))
    device = torch.device("cuda" if benchlib.has_cuda() else "cpu")
    images = cifar.load_images(recipe)
    train, _, num_classes = cifar.build_datasets(recipe, images)
    on_device, _, _ = cifar.build_device_datasets(recipe, images, device)

    configs = [
        SimpleNamespace(workers=w, pin=p, persistent=s)
        for w in args.num_workers
        for p in ([False, True] if device.type == "cuda" else [False])
        for s in ([False, True] if w > 0 else [False])
    ]
    measured = {}
    consumed = []
    for _ in range(args.repeats):  # interleaved, so a change in machine load hits every row alike
        consumed.append(consumption_rate(cifar, args, num_classes, device, 2 if args.smoke else 10))
        for c in configs:
            loader = torch.utils.data.DataLoader(
                train,
                batch_size=args.per_device_train_batch_size,
                shuffle=True,
                drop_last=True,
                num_workers=c.workers,
                pin_memory=c.pin,
                persistent_workers=c.persistent,
            )
            measured.setdefault(("loader", c.workers, c.pin, c.persistent), []).append(
                loader_rate(loader, args.epochs, args.max_batches, device)
            )
            del loader  # ends its workers
        loader = common.make_dataloader(on_device, args.per_device_train_batch_size, train=True, seed=recipe.seed)
        measured.setdefault(("device", 0, False, False), []).append(
            loader_rate(loader, args.epochs, args.max_batches, device)
        )

    consume = benchlib.median(consumed)
    # The path the recipe takes by default for this data on this device, and each path's share of a training step
    # spent waiting for data, measured in recipe runs (results.json's data_wait_share: the median rank's).
    held = vision.held_on_device(recipe, images, SimpleNamespace(device=device, num_processes=1, is_main_process=True))
    default_workers = default_num_workers()
    runs, steps = [], 4 if args.smoke else 40
    for on_device_path in (True, False):
        run_args = benchlib.cifar_args(args, args.per_device_train_batch_size, steps, data_on_device=on_device_path)
        reps = [benchlib.recipe_run(args, "cifar", 1, run_args, rep)[0] for rep in range(args.repeats)]
        runs.append(
            {
                "path": "--data_on_device"
                if on_device_path
                else f"DataLoader, {default_workers} worker(s), persistent",
                "default": on_device_path == held,
                "samples_per_second": benchlib.median([benchlib.median_step_rate(r) for r in reps]),
                "data_wait_share": benchlib.median([r["data_wait_share"] for r in reps]),
                "all": [{k: r[k] for k in ("data_wait_share", "samples_per_second")} for r in reps],
            }
        )
    results, rows = [], []
    for (kind, workers, pin, persistent), reps in measured.items():
        per_epoch = [benchlib.median([r[e] for r in reps]) for e in range(args.epochs)]
        steady = benchlib.median(per_epoch[1:] or per_epoch)
        verdict = "input-bound" if steady < consume else "compute-bound"
        # the recipe's DataLoader: its default workers, persistent when there are any, unpinned
        recipes_loader = workers == default_workers and persistent == (workers > 0) and not pin
        entry = {
            "path": "--data_on_device" if kind == "device" else "DataLoader",
            "num_workers": workers,
            "pin_memory": pin,
            "persistent_workers": persistent,
            "samples_per_second_per_epoch": per_epoch,
            "all": reps,
            "samples_per_second": steady,
            "model_samples_per_second": consume,
            "loader_over_model": steady / consume,
            "verdict": verdict,
            "default": held if kind == "device" else not held and recipes_loader,
        }
        results.append(entry)
        rows.append(
            [
                entry["path"],
                workers,
                "on" if pin else "off",
                "on" if persistent else "off",
                per_epoch[0],
                steady,
                steady / consume,
                verdict,
                "yes" if entry["default"] else "",
            ]
        )
    pin_note = "" if device.type == "cuda" else " pin_memory off only: no CUDA here, nothing to pin for."
    data = "CIFAR-10" if args.cifar_dir else "the digits as 32x32 PNGs (ImageFolder)"
    md = (
        f"### Input pipeline: recipes/cifar.py's loader against {args.model}'s consumption\n\n"
        f"{data}, batch {args.per_device_train_batch_size}, up to {args.max_batches} batches an epoch, "
        f"{args.epochs} epochs, median of {args.repeats}. The model consumes **{consume:,.0f} samples/s** "
        f"({device.type}, training steps on a batch already in memory). Steady = epochs after the first.{pin_note}\n\n"
        + benchlib.markdown_table(
            [
                "path",
                "num_workers",
                "pin_memory",
                "persistent_workers",
                "first epoch samples/s",
                "steady samples/s",
                "loader / model",
                "verdict",
                "the recipe's default",
            ],
            rows,
        )
        + f"\n\nThe recipe itself, {steps} steps of one process on each path, median of "
        f"{args.repeats} (samples/s at the median step; results.json's data_wait_share):\n\n"
        + benchlib.markdown_table(
            ["path", "recipe samples/s", "share of each step waiting for data", "the recipe's default"],
            [[r["path"], r["samples_per_second"], r["data_wait_share"], "yes" if r["default"] else ""] for r in runs],
        )
    )
    benchlib.save(
        args.out,
        NAME,
        {
            "settings": {k: str(v) for k, v in vars(args).items()},
            "model_samples_per_second": consume,
            "results": results,
            "recipe_runs": runs,
        },
        md,
    )


if __name__ == "__main__":
    main()
