"""Image classification: ResNet-18 on CIFAR-10/100 or any ImageFolder, from one CPU to many GPUs.

    accelerate launch --config_file accelerate_configs/1gpu.yaml recipes/cifar.py      # one GPU
    accelerate launch --config_file accelerate_configs/4gpu.yaml recipes/cifar.py      # 4 GPUs, DDP
    ./launch.sh cifar                  # config chosen from the GPUs present; N CPU processes without
    ./launch.sh cifar --dataset imagefolder --train_dir data/train --val_dir data/val --model resnet50 --image_size 224

The learning rate is given for --reference_batch_size samples and scaled to the effective batch
(per-device batch x processes x accumulation) by --lr_scaling, so one command line trains the
same model on any number of devices. Run with --help for every option.

Measured (README quick start, scikit-learn digits as an ImageFolder, stock ResNet-18, 3 epochs):
eval accuracy 0.83-0.92 in 16-25 s in 1 or 2 CPU processes on a 2-core VM, about 300 samples/s.
CIFAR-10 on GPUs: not measured yet in this repository (no GPU was available); see benchmarks/.
"""

import argparse
import difflib
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator
from accelerate.utils import set_seed
from PIL import Image
from torchvision import transforms as T

import common
from common import RecipeError
from common.args import fraction_below_one, nonempty, positive_int

RECIPE = "cifar"  # checkpoints name the recipe that wrote them: a copy renamed to train.py still resumes them

DATASETS = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def parse_args(argv=None):
    p = common.training_parser(__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=[*DATASETS, "imagefolder"], default="cifar10")
    p.add_argument("--data_dir", type=nonempty, default="data", help="where CIFAR is (or is downloaded to)")
    p.add_argument("--train_dir", type=nonempty, help="ImageFolder training images (--dataset imagefolder)")
    p.add_argument("--val_dir", type=nonempty, help="ImageFolder validation images (--dataset imagefolder)")
    p.add_argument("--image_size", type=positive_int, default=32, help="ImageFolder images are resized to this")
    p.add_argument("--model", default="resnet18_cifar",
                   help="resnet18_cifar (3x3 stem, no max-pool, for 32x32) or any torchvision model name")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--momentum", type=fraction_below_one, default=0.9)
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--label_smoothing", type=fraction_below_one, default=0.0)
    p.add_argument("--data_on_device", action="store_true",
                   help="keep the whole dataset on the accelerator as uint8 and crop/flip there: no loader workers, "
                        "no host-to-device copies (images of 64 px or less)")
    p.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile (inductor)")
    p.add_argument("--norm_layer", choices=["batch", "sync_batch", "group"], default="batch",
                   help="the model's BatchNorm as built, synced across processes (GPUs only), or GroupNorm: statistics "
                        "per process, of the whole step's batch, or per sample")
    p.set_defaults(output_dir="outputs/cifar", per_device_train_batch_size=128, per_device_eval_batch_size=256,
                   learning_rate=0.1, reference_batch_size=128, lr_scaling="linear", warmup_ratio=0.05,
                   weight_decay=5e-4, max_grad_norm=0.0, num_train_epochs=30, logging_steps=20)
    args = common.parse(p, argv)
    if args.dataset == "imagefolder":
        if not (args.train_dir and args.val_dir):
            p.error("--dataset imagefolder needs --train_dir and --val_dir, folders with one sub-folder of images "
                    "per class")
    elif args.train_dir or args.val_dir:
        p.error(f"--train_dir and --val_dir are read with --dataset imagefolder, not {args.dataset}; "
                "add --dataset imagefolder")
    elif args.image_size != 32:
        p.error(f"--image_size applies to --dataset imagefolder; {args.dataset} images are 32 px")
    if args.optimizer == "sgd" and args.nesterov and args.momentum == 0:
        p.error("--nesterov needs --momentum above 0; pass --no-nesterov for plain SGD")
    if args.data_on_device and args.image_size > 64:
        p.error(f"--data_on_device does CIFAR-style pad-and-crop, for images of 64 px or less, not "
                f"--image_size {args.image_size}")
    problem = model_problem(args.model, args.image_size, args.per_device_train_batch_size, args.dataset)
    if problem:
        p.error(problem)
    return args


def to_rgb(image, path):
    """An 8-bit RGB copy of a PIL image. 16-bit greyscale (mode I;16, as in 16-bit PNGs) keeps its
    high byte, as PIL does for 16-bit colour: PIL's own convert would clip every value above 255."""
    if image.mode.startswith("I;16"):
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8), "L")
    elif image.mode in ("I", "F"):  # 32-bit integers or floats: no one scale maps them to 8 bits
        raise common.DataError(f"{path}: 32-bit pixels (PIL mode {image.mode}) have no single 8-bit scale; "
                               "convert the images to 8 or 16 bits per channel")
    return image.convert("RGB")


def load_image(path):
    """ImageFolder's loader, naming the file it cannot read (the error comes from a loader worker)."""
    try:
        with warnings.catch_warnings():
            # above Image.MAX_IMAGE_PIXELS PIL warns, above twice that it refuses: either way a
            # decode this large per sample per epoch is a mistake (a scan, a panorama, a bomb)
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                return to_rgb(image, path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise common.DataError(f"{path}: too large to decode ({err}); shrink it first: every image is resized to "
                               "--image_size anyway") from err
    except (OSError, SyntaxError, ValueError) as err:  # not an image, truncated, an unsupported variant
        raise common.DataError(f"{path}: unreadable image ({err}); remove or replace the file") from err


def load_images(args):
    """(train, eval, image size, mean, std, num_classes), the images not yet transformed."""
    if args.dataset == "imagefolder":
        for flag, folder in (("--train_dir", args.train_dir), ("--val_dir", args.val_dir)):
            if not folder or not Path(folder).is_dir():
                raise RecipeError(f"{flag} {folder}: no such folder; --dataset imagefolder needs class sub-folders of images")
        datasets = []
        for flag, folder in (("--train_dir", args.train_dir), ("--val_dir", args.val_dir)):
            try:
                datasets.append(torchvision.datasets.ImageFolder(folder, loader=load_image))
            except FileNotFoundError as err:  # no class folders, or no images in them
                raise RecipeError(f"{flag} {folder}: {err}; --dataset imagefolder needs class sub-folders "
                                  "holding images") from err
        train, evals = datasets
        if train.classes != evals.classes:
            only_val = sorted(set(evals.classes) - set(train.classes))
            only_train = sorted(set(train.classes) - set(evals.classes))
            raise RecipeError(
                f"{args.train_dir} and {args.val_dir} have different class folders ("
                + "; ".join(f"only in {where}: {', '.join(names)}" for where, names in
                            (("--val_dir", only_val), ("--train_dir", only_train)) if names)
                + "); give both the same class sub-folders, so that a label means the same class in each")
        if len(train.classes) < 2:
            raise RecipeError(f"--train_dir {args.train_dir} has {len(train.classes)} class folder; a classifier "
                              "needs two or more (one sub-folder of images per class)")
        size, mean, std, num_classes = args.image_size, IMAGENET_MEAN, IMAGENET_STD, len(train.classes)
    else:
        try:
            train = DATASETS[args.dataset](args.data_dir, train=True, download=True)
            evals = DATASETS[args.dataset](args.data_dir, train=False, download=True)
        except (OSError, RuntimeError) as err:
            raise RecipeError(
                f"{args.dataset} is not in {args.data_dir} and could not be downloaded ({err}); "
                f"download it where there is network and pass --data_dir, or use --dataset imagefolder"
            ) from err
        size, mean, std, num_classes = 32, CIFAR_MEAN, CIFAR_STD, len(train.classes)
    return train, evals, size, mean, std, num_classes


def build_datasets(args):
    """(train, eval, num_classes); augmentation is seeded per sample so resumes replay it exactly."""
    train, evals, size, mean, std, num_classes = load_images(args)
    if size <= 64:  # CIFAR-style: pad-and-crop keeps the whole object in a small image
        train_tf = [T.Resize((size, size)), T.RandomCrop(size, padding=size // 8)]
        eval_tf = [T.Resize((size, size))]
    else:  # ImageNet-style
        train_tf = [T.RandomResizedCrop(size)]
        eval_tf = [T.Resize(round(size / 0.875)), T.CenterCrop(size)]
    tail = [T.ToTensor(), T.Normalize(mean, std)]
    train = common.SeededTransform(train, T.Compose([*train_tf, T.RandomHorizontalFlip(), *tail]), args.seed)
    evals.transform = T.Compose([*eval_tf, *tail])
    return train, evals, num_classes


def as_uint8(dataset, size):
    """All images of a torchvision dataset as one (N, H, W, C) uint8 tensor, and the labels."""
    if getattr(dataset, "data", None) is not None:  # CIFAR: already an NHWC uint8 array
        return torch.from_numpy(dataset.data), torch.tensor(dataset.targets)
    dataset.transform = T.Compose([T.Resize((size, size)), T.PILToTensor()])
    try:
        images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    except common.DataError as err:  # every process reads every image here: the same error on each
        raise RecipeError(str(err)) from err
    return torch.stack(images).permute(0, 2, 3, 1).contiguous(), torch.tensor(labels)


def build_device_datasets(args, device):
    """--data_on_device: (train, eval, num_classes) held on `device` as uint8. A batch is padded,
    cropped and flipped on the device in one gather, from numbers seeded per (seed, epoch, sample)."""
    train, evals, size, mean, std, num_classes = load_images(args)
    if size > 64:
        raise RecipeError(f"--data_on_device does CIFAR-style pad-and-crop, for images of 64 px or less, not {size}")
    pad = size // 8
    mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255
    steps = torch.arange(size, device=device)
    layout = torch.channels_last if device.type == "cuda" else torch.contiguous_format  # as the model's, see main

    def normalize(images):  # NHWC uint8 -> NCHW float (permuted, NHWC is channels_last already)
        return ((images.permute(0, 3, 1, 2).float() - mean) / std).contiguous(memory_format=layout)

    def crop_flip(batch, u):
        images, labels = batch
        padded = torch.nn.functional.pad(images, (0, 0, pad, pad, pad, pad))
        rows = (u[:, 0] * (2 * pad + 1)).long()[:, None] + steps
        cols = (u[:, 1] * (2 * pad + 1)).long()[:, None] + torch.where(u[:, 2:] < 0.5, steps.flip(0), steps)
        cropped = padded[torch.arange(len(images), device=device)[:, None, None], rows[:, :, None], cols[:, None, :]]
        return normalize(cropped), labels

    train = common.DeviceTensorDataset(*(t.to(device) for t in as_uint8(train, size)), transform=crop_flip, draws=3,
                                       seed=args.seed)
    evals = common.DeviceTensorDataset(*(t.to(device) for t in as_uint8(evals, size)),
                                       transform=lambda batch, _: (normalize(batch[0]), batch[1]))
    return train, evals, num_classes


def get_dataloaders(args, accelerator):
    with common.prepare_data_first(accelerator):
        train, evals, num_classes = (build_device_datasets(args, accelerator.device) if args.data_on_device
                                     else build_datasets(args))
    train_dl = common.make_dataloader(train, args.per_device_train_batch_size, train=True, seed=args.seed,
                                      num_workers=args.dataloader_num_workers)
    eval_dl = common.make_dataloader(evals, args.per_device_eval_batch_size, train=False,
                                     num_workers=args.dataloader_num_workers)
    return train_dl, eval_dl, num_classes


def build_model(name, num_classes):
    if name == "resnet18_cifar":  # 32x32 inputs: a 7x7/2 stem and max-pool would discard 3/4 of them
        model = torchvision.models.resnet18(num_classes=num_classes)
        model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
        return model
    # Inception and GoogLeNet add auxiliary heads in training, which a plain cross-entropy cannot take.
    extra = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
    try:
        return torchvision.models.get_model(name, num_classes=num_classes, **extra)
    except ValueError as err:
        raise RecipeError(f"--model {name}: {err}") from err


def set_norm_layer(model, kind: str, on_gpu: bool):
    """BatchNorm normalizes each process's micro-batch by its own statistics, so N processes x batch b
    do not train exactly as 1 x Nb. sync_batch computes them over every process (an all-reduce per
    layer, GPUs only in torch); group (GroupNorm, up to 32 groups) needs no batch statistics at all."""
    if kind == "sync_batch":
        if not on_gpu:
            raise RecipeError("--norm_layer sync_batch needs GPUs (torch's SyncBatchNorm); use group or batch on CPU")
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if kind == "group":
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if isinstance(child, torch.nn.modules.batchnorm._BatchNorm):
                    groups = max(g for g in range(1, 33) if child.num_features % g == 0)
                    setattr(parent, name, torch.nn.GroupNorm(groups, child.num_features))
    return model


def model_problem(name, size, batch, dataset="imagefolder"):
    """Why --model cannot train on `size`-pixel images in batches of `batch`, or None. Checked by
    running the model on the meta device (shapes only: no memory, no compute), where too small an
    input fails as it would in training, or reaches a layer that strides over a single pixel."""
    models = torchvision.models.list_models(module=torchvision.models)  # the classification models
    if name != "resnet18_cifar" and name not in models:
        close = difflib.get_close_matches(name, models, n=3)
        return (f"--model {name}: not a torchvision classification model"
                + (f" (did you mean {' or '.join(close)}?)" if close else "")
                + "; pass resnet18_cifar or a name from torchvision.models.list_models(module=torchvision.models)")
    try:
        with torch.device("meta"):
            model = build_model(name, 10)
    except Exception:  # a model whose construction needs real data cannot be checked this way
        return None

    def fails(size, batch=2):
        collapsed = []

        def check(module, inputs):
            stride = module.stride if isinstance(module.stride, tuple) else (module.stride, module.stride)
            if any(s > 1 and n < s for n, s in zip(inputs[0].shape[-2:], stride)):
                collapsed.append(f"a {type(module).__name__} strides over a single pixel")

        hooks = [m.register_forward_pre_hook(check) for m in model.modules()
                 if isinstance(m, (torch.nn.Conv2d, torch.nn.MaxPool2d, torch.nn.AvgPool2d))]
        try:
            model(torch.empty(batch, 3, size, size, device="meta"))
        except Exception as err:  # the model's own shape errors: a kernel larger than its input, ViT's fixed size, ...
            return (str(err).strip().splitlines() or [type(err).__name__])[0]
        finally:
            for hook in hooks:
                hook.remove()
        return collapsed[0] if collapsed else None

    model.train()  # batch norm's check of the values per channel is a training-mode one
    problem = fails(size)
    if problem:
        sizes = (8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 299, 384, 512)
        fits = next((s for s in sizes if s > size and not fails(s)), None)
        if fits is None:
            return None  # no size passes on the meta device: this model cannot be checked there
        if dataset != "imagefolder":
            return (f"--model {name} cannot take {dataset}'s {size}x{size} images ({problem}); it takes {fits} px: "
                    "use --model resnet18_cifar, or an ImageFolder (--dataset imagefolder) with --image_size "
                    f"{fits}")
        return (f"--model {name} cannot take {size}x{size} images ({problem}); pass --image_size {fits} (a size "
                "it takes), or choose another --model")
    if batch == 1 and fails(size, batch=1):
        return (f"--model {name} on {size}x{size} images leaves batch norm one value per channel with "
                "--per_device_train_batch_size 1; pass 2 or more")
    return None


def build_optimizer(args, model, lr, fused=False):
    """fused (on CUDA): one kernel updates every parameter, instead of several launches per tensor."""
    groups = common.decay_groups(model, args.weight_decay)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused)
    return torch.optim.SGD(groups, lr=lr, momentum=args.momentum, nesterov=args.nesterov, fused=fused)


def evaluate(model, eval_dl, accelerator, stop=None):
    """Loss and accuracy over the whole eval set, each sample counted exactly once; None if `stop` (a
    common.StopOnSignal) reports a signal, which every process sees at the same batch."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in eval_dl:
            if stop is not None and stop.requested():
                model.train()
                return None
            logits = model(images)
            losses = F.cross_entropy(logits, labels, reduction="none")
            # gather_for_metrics drops the samples Accelerate repeated to even out the last batch
            losses, preds, labels = accelerator.gather_for_metrics((losses, logits.argmax(-1), labels))
            loss_sum += losses.float().sum().item()
            correct += (preds == labels).sum().item()
            count += labels.numel()
    model.train()
    return {"eval_loss": loss_sum / count, "eval_accuracy": correct / count, "eval_samples": count}


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        step_scheduler_with_optimizer=False,  # stepped below, once per optimizer step
        kwargs_handlers=[common.process_group_kwargs(args.ddp_timeout)],
    )
    common.setup_logging(accelerator)
    common.check_launch(accelerator, args.gradient_accumulation_steps, args.max_grad_norm)
    set_seed(args.seed)  # every process builds the same initial model
    resume_from = common.prepare_output_dir(accelerator, args)

    train_dl, eval_dl, num_classes = get_dataloaders(args, accelerator)
    plan, progress = common.plan_run(args, len(train_dl.dataset), accelerator.num_processes, resume_from)

    on_gpu = accelerator.device.type == "cuda"
    model = set_norm_layer(build_model(args.model, num_classes), args.norm_layer, on_gpu)
    if on_gpu:  # channels_last (NHWC) lets cuDNN use tensor cores
        model = model.to(memory_format=torch.channels_last)
    if args.torch_compile:  # in place, so state-dict names, checkpoints and the saved weights stay unchanged
        model.compile()
    optimizer = build_optimizer(args, model, plan.learning_rate, fused=on_gpu)
    scheduler = common.make_scheduler(optimizer, args.lr_scheduler_type, plan, progress)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    checkpoints = common.Checkpoints(accelerator, args, plan, RECIPE)
    if resume_from:
        checkpoints.restore(resume_from, optimizer, scheduler)
    accelerator.init_trackers(RECIPE, config=common.tracker_config(args))
    stop = common.StopOnSignal(accelerator)
    log = common.TrainLog(accelerator, plan, progress, args.logging_steps)

    metrics = {}
    for epoch in range(progress.epoch, plan.num_epochs):
        if progress.step >= plan.max_train_steps:  # resumed from the last step
            break
        for window in common.accumulation_windows(train_dl, args.gradient_accumulation_steps, epoch, progress):
            for i, (images, labels) in enumerate(window):
                if on_gpu:
                    images = images.contiguous(memory_format=torch.channels_last)
                with common.micro_batch(accelerator, model, last=i == len(window) - 1):
                    loss = F.cross_entropy(model(images), labels, label_smoothing=args.label_smoothing)
                    # Accelerate divides by the accumulation steps: an epoch's shorter last window is
                    # weighted up, so every step's gradient is the mean over the samples it trained
                    accelerator.backward(loss * args.gradient_accumulation_steps / len(window))
                log.add(loss * len(labels), len(labels))
            if args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            log.step(progress, window, scheduler.get_last_lr()[0])
            if checkpoints.due(progress.step):
                checkpoints.save(progress, log, model)
            if stop.requested():  # on every process at the same step
                raise common.Preempted(stop.signal, progress.step, checkpoints.save(progress, log, model))
            if progress.step >= plan.max_train_steps:
                break
        last = progress.step >= plan.max_train_steps  # a stop during the final evaluation lets it finish
        metrics = evaluate(model, eval_dl, accelerator, None if last else stop)
        if metrics is None:
            raise common.Preempted(stop.signal, progress.step, checkpoints.save(progress, log, model), "evaluation")
        log.end_epoch(epoch, progress.step, metrics)
        if checkpoints.each_epoch:
            checkpoints.save(progress, log, model)
    if not metrics:  # resumed from the final checkpoint: nothing left to train
        metrics = evaluate(model, eval_dl, accelerator)

    log.check_finite(progress.step, model)
    common.save_model(accelerator, model, args.output_dir)
    common.write_results(accelerator, args, plan, **log.summary(progress), **metrics, num_classes=num_classes)
    accelerator.end_training()


if __name__ == "__main__":
    with common.exit_codes():  # a mistake of the user's: one error line, exit 2; a stop on a signal: exit 75
        main()
