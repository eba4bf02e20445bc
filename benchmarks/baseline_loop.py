"""The hand-written loops the CIFAR recipe is measured against: plain PyTorch in one process, or
torch.nn.parallel.DistributedDataParallel with a DistributedSampler under torchrun. Same model,
data, augmentation, batch and precision as recipes/cifar.py (it builds them with the recipe's
own functions); no Accelerate anywhere in the loop.

    python benchmarks/baseline_loop.py --out OUT.json -- RECIPE_ARGS...
    torchrun --nproc_per_node 2 benchmarks/baseline_loop.py --out OUT.json --variants ddp accum_no_sync \\
        -- RECIPE_ARGS...

Variants (timed alternately, --repeats times each, as the recipe's TrainLoop times itself: every
training batch, no evaluation; the same without the first optimizer step; and each optimizer step,
whose median gives the rate at the median step):
  ddp                    one optimizer step per batch (or plain PyTorch in one process)
  accum_no_sync          --gradient_accumulation_steps micro-batches per step, DDP's no_sync on all
                         but the last: one gradient all-reduce per optimizer step
  accum_sync_every_step  the same accumulation without no_sync: an all-reduce after every micro-batch
"""

import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from benchlib import load_recipe
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from common import vision
from common.args import ArgumentParser  # benchlib put the repository on the path
from common.data import DeviceTensorDataset, default_num_workers
from common.plan import scale_lr

VARIANTS = ("ddp", "accum_no_sync", "accum_sync_every_step")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["ddp"])
    p.add_argument(
        "--accumulation", type="positive_int", default=4, help="micro-batches per step of the accum_* variants"
    )
    p.add_argument(
        "--accumulation_max_steps",
        type="positive_int",
        help="optimizer steps of the accum_* variants (default: --max_train_steps)",
    )
    p.add_argument("--repeats", type="positive_int", default=1)
    return p


def main():
    own, recipe_argv = build_parser().parse_known_args()
    cifar = load_recipe("cifar")
    args = cifar.parse_args([a for a in recipe_argv if a != "--"])

    world, rank, local_rank = (
        int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0))
    )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(args.seed)

    if args.data_on_device:
        train, _, num_classes = cifar.build_device_datasets(args, cifar.load_images(args), device)
    else:
        train, _, num_classes = cifar.build_datasets(args, cifar.load_images(args))
    on_device = isinstance(train, DeviceTensorDataset)
    workers = (
        0
        if on_device
        else (default_num_workers() if args.dataloader_num_workers is None else args.dataloader_num_workers)
    )
    generator = torch.Generator().manual_seed(args.seed)
    sampler = (
        DistributedSampler(train, shuffle=True, drop_last=True, seed=args.seed)
        if world > 1
        else RandomSampler(train, generator=generator)
    )
    loader = DataLoader(
        train,
        batch_size=args.per_device_train_batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda and not on_device,
        persistent_workers=workers > 0,
        collate_fn=(lambda batch: batch) if on_device else None,
    )

    model = vision.new_model(args.model, num_classes).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    if args.torch_compile:
        model.compile()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    lr = scale_lr(
        args.learning_rate, args.per_device_train_batch_size * world, args.reference_batch_size, args.lr_scaling
    )
    optimizer = cifar.build_optimizer(args, model, lr)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def samples_per_second(variant):
        """(every step, after the first step): the two rates TrainLoop reports."""
        accumulation = 1 if variant == "ddp" else own.accumulation
        max_steps = args.max_train_steps if variant == "ddp" else own.accumulation_max_steps or args.max_train_steps
        steps, batches, seconds, epoch, first_step, step_ends = 0, 0, 0.0, 0, (0.0, 0), []
        while steps < max_steps:
            if world > 1:
                sampler.set_epoch(epoch)
            if hasattr(train, "set_epoch"):
                train.set_epoch(epoch)
            tic = time.perf_counter()
            for i, (images, labels) in enumerate(loader):
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                if cuda:
                    images = images.contiguous(memory_format=torch.channels_last)
                batches += 1
                micro = (i + 1) % accumulation != 0
                skip_sync = micro and world > 1 and variant == "accum_no_sync"
                with model.no_sync() if skip_sync else contextlib.nullcontext():
                    with autocast:
                        loss = F.cross_entropy(model(images), labels)
                    (loss / accumulation).backward()
                if not micro:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    loss.item()  # the recipe benchmarked logs every step: the same device sync
                    steps += 1
                    step_ends.append(seconds + time.perf_counter() - tic)
                    if steps == 1:
                        first_step = (seconds + time.perf_counter() - tic, batches)
                    if steps >= max_steps:
                        break
            loss.item()  # wait for the device, as the recipe's last log does
            seconds += time.perf_counter() - tic
            epoch += 1
        samples = args.per_device_train_batch_size * world  # per batch: samples, as TrainLoop counts them
        step = statistics.median(b - a for a, b in zip(step_ends[:-1], step_ends[1:])) if steps > 2 else None
        return (
            batches * samples / seconds,
            (batches - first_step[1]) * samples / (seconds - first_step[0]),
            samples * accumulation / step if step else None,
        )

    measured = {v: [] for v in own.variants}
    for _ in range(own.repeats):
        for variant in own.variants:
            measured[variant].append(samples_per_second(variant))
    if rank == 0:
        with open(own.out, "w") as f:
            json.dump(
                {
                    "world_size": world,
                    "accumulation": own.accumulation,
                    "samples_per_second": {v: statistics.median(r[0] for r in m) for v, m in measured.items()},
                    "steady_samples_per_second": {v: statistics.median(r[1] for r in m) for v, m in measured.items()},
                    "median_step_samples_per_second": {
                        v: statistics.median(r[2] for r in m) for v, m in measured.items()
                    },
                    "all": measured,
                },
                f,
                indent=2,
            )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
