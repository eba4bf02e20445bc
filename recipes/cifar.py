"""Image classification: ResNet-18 on CIFAR-10/100 or any ImageFolder, from one CPU to many GPUs.

    accelerate launch --config_file accelerate_configs/1gpu.yaml recipes/cifar.py      # one GPU
    accelerate launch --config_file accelerate_configs/4gpu.yaml recipes/cifar.py      # 4 GPUs, DDP
    ./launch.sh cifar                  # config chosen from the GPUs present; N CPU processes without
    ./launch.sh cifar --dataset imagefolder --train_dir data/train --val_dir data/val --model resnet50 --image_size 224

The learning rate is given for --reference_batch_size samples and scaled to the effective batch
(per-device batch x processes x accumulation) by --lr_scaling, so one command line trains the
same model on any number of devices. Run with --help for every option.

Measured (README quick start, scikit-learn digits as an ImageFolder, stock ResNet-18, 3 epochs, 2 CPU
processes of a 2-core VM, about 280 samples/s): eval accuracy 0.94-0.96 with --hflip 0, 0.81-0.85 flipping.
CIFAR-10 on GPUs: not measured yet in this repository (no GPU was available); see benchmarks/.
"""

import argparse
import contextlib
import difflib
import os
import pickle
import warnings
from pathlib import Path
from unittest.mock import patch

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed
from PIL import Image
from safetensors.torch import load_file
from torchvision import transforms as T

import common
from common import RecipeError, logger
from common.args import fraction_below_one, nonempty, positive_float, positive_int, probability
from common.runtime import one_line

RECIPE = "cifar"  # checkpoints name the recipe that wrote them: a copy renamed to train.py still resumes them

# Hyperparameters: every default of this recipe, with its reason; each is the command-line flag of its name.
HYPERPARAMETERS = dict(
    model="resnet18_cifar",  # ResNet-18 with a 3x3 stem and no max-pool: a 7x7/2 stem would discard 3/4 of 32x32
    per_device_train_batch_size=128,  # the batch CIFAR ResNets are tuned at; fills a GPU without accumulation
    per_device_eval_batch_size=256,  # nothing kept for a backward pass: twice the training batch fits
    gradient_accumulation_steps=1,
    optimizer="sgd",  # SGD with Nesterov momentum: what ResNets on CIFAR are trained with
    momentum=0.9,
    nesterov=True,
    learning_rate=0.1,  # the usual rate for SGD on CIFAR ResNets ...
    reference_batch_size=128,  # ... at 128 samples a step; scaled from there to the effective batch
    lr_scaling="linear",  # SGD's rate grows with the batch (Goyal et al., 2017)
    lr_scheduler_type="cosine",  # decays to zero at the last step: no decay points to choose
    warmup_ratio=0.05,  # the first steps at a large scaled rate diverge without a warmup
    weight_decay=5e-4,  # the usual value for ResNets on CIFAR; not on biases and norm weights
    max_grad_norm=0.0,  # no clipping: ResNets with BatchNorm train stably under SGD
    label_smoothing=0.0,
    num_train_epochs=30,  # a short schedule; the cosine decay makes its end count
    hflip=0.5,  # a mirrored photo shows the same class: CIFAR and most ImageFolders (not digits or text: 0)
    random_crop=True,  # pad-and-crop: the standard CIFAR augmentation
    norm_layer="batch",  # the model's own BatchNorm
    head_lr_scale=1.0,  # fine-tuning: the new head at the backbone's rate unless asked
    output_dir="outputs/cifar",
    logging_steps=20,
)

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
    p.add_argument(
        "--model",
        help="resnet18_cifar (3x3 stem, no max-pool, for 32x32), "
        "any torchvision model name, or timm/NAME for a timm model (pip install -e '.[timm]')",
    )
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="start from --model's published weights (torchvision's "
        "DEFAULT, or timm's), normalizing as they were trained, with a new head",
    )
    p.add_argument(
        "--pretrained_path",
        type=nonempty,
        help="start from weights on disk for --model (.safetensors, "
        "or a torch.save'd state dict); the head is new unless it has as many classes as the data",
    )
    p.add_argument(
        "--freeze_backbone",
        action="store_true",
        help="train only the head; the backbone keeps the loaded weights and BatchNorm statistics (FrozenBatchNorm2d)",
    )
    p.add_argument(
        "--head_lr_scale",
        type=positive_float,
        help="the head's learning rate is --learning_rate times this (timm's lr_scale), e.g. 10",
    )
    p.add_argument("--optimizer", choices=["sgd", "adamw"])
    p.add_argument("--momentum", type=fraction_below_one)
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction)
    p.add_argument("--label_smoothing", type=fraction_below_one)
    p.add_argument(
        "--hflip",
        type=probability,
        help="probability of a horizontal flip in training: "
        "0.5 for CIFAR and, as in torchvision's and timm's recipes, for ImageFolder, since a mirrored photo "
        "shows the same class; 0 where it does not (digits, text)",
    )
    p.add_argument(
        "--random_crop",
        action=argparse.BooleanOptionalAction,
        help="pad-and-crop in training (scale-and-crop above 64 px)",
    )
    p.add_argument(
        "--data_on_device",
        action="store_true",
        help="keep the whole dataset on the accelerator as uint8 and crop/flip there: no loader workers, "
        "no host-to-device copies (images of 64 px or less)",
    )
    p.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile (inductor)")
    p.add_argument(
        "--norm_layer",
        choices=["batch", "sync_batch", "group"],
        help="the model's BatchNorm as built, synced across processes (GPUs only), or GroupNorm: statistics "
        "per process, of the whole step's batch, or per sample",
    )
    p.set_defaults(**HYPERPARAMETERS)
    args = common.parse(p, argv)
    if args.dataset == "imagefolder":
        if not (args.train_dir and args.val_dir):
            p.error(
                "--dataset imagefolder needs --train_dir and --val_dir, folders with one sub-folder of images "
                "per class"
            )
    elif args.train_dir or args.val_dir:
        p.error(
            f"--train_dir and --val_dir are read with --dataset imagefolder, not {args.dataset}; "
            "add --dataset imagefolder"
        )
    elif args.image_size != 32:
        p.error(f"--image_size applies to --dataset imagefolder; {args.dataset} images are 32 px")
    if args.optimizer == "sgd" and args.nesterov and args.momentum == 0:
        p.error("--nesterov needs --momentum above 0; pass --no-nesterov for plain SGD")
    if args.data_on_device and args.image_size > 64:
        p.error(
            f"--data_on_device does CIFAR-style pad-and-crop, for images of 64 px or less, not "
            f"--image_size {args.image_size}"
        )
    tuned = args.pretrained or args.pretrained_path
    for wrong, message in (
        (
            args.pretrained and args.pretrained_path,
            "pass --pretrained (published weights) or --pretrained_path (a file), not both",
        ),
        (
            (args.freeze_backbone or args.head_lr_scale != 1) and not tuned,
            "--freeze_backbone and --head_lr_scale fine-tune loaded weights: add --pretrained or --pretrained_path",
        ),
        (
            args.freeze_backbone and args.head_lr_scale != 1,
            "--freeze_backbone trains the head alone, at --learning_rate: drop --head_lr_scale",
        ),
        (
            tuned and args.norm_layer == "group",
            "--norm_layer group replaces the BatchNorm layers, and the weights "
            "loaded into them; fine-tune with --norm_layer batch or sync_batch",
        ),
    ):
        if wrong:
            p.error(message)
    problem = model_problem(
        args.model, args.image_size, args.per_device_train_batch_size, args.dataset, args.pretrained
    )
    if problem:
        p.error(problem)
    return args


def to_rgb(image, path):
    """An 8-bit RGB copy of a PIL image. 16-bit greyscale (mode I;16, as in 16-bit PNGs) keeps its
    high byte, as PIL does for 16-bit colour: PIL's own convert would clip every value above 255."""
    if image.mode.startswith("I;16"):
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8), "L")
    elif image.mode in ("I", "F"):  # 32-bit integers or floats: no one scale maps them to 8 bits
        raise common.DataError(
            f"{path}: 32-bit pixels (PIL mode {image.mode}) have no single 8-bit scale; "
            "convert the images to 8 or 16 bits per channel"
        )
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
        raise common.DataError(
            f"{path}: too large to decode ({err}); shrink it first: every image is resized to --image_size anyway"
        ) from err
    except (OSError, SyntaxError, ValueError) as err:  # not an image, truncated, an unsupported variant
        raise common.DataError(f"{path}: unreadable image ({err}); remove or replace the file") from err


def load_images(args):
    """(train, eval, image size, mean, std, num_classes), the images not yet transformed."""
    if args.dataset == "imagefolder":
        for flag, folder in (("--train_dir", args.train_dir), ("--val_dir", args.val_dir)):
            if not folder or not Path(folder).is_dir():
                raise RecipeError(
                    f"{flag} {folder}: no such folder; --dataset imagefolder needs class sub-folders of images"
                )
        datasets = []
        for flag, folder in (("--train_dir", args.train_dir), ("--val_dir", args.val_dir)):
            try:
                datasets.append(torchvision.datasets.ImageFolder(folder, loader=load_image))
            except FileNotFoundError as err:  # no class folders, or no images in them
                raise RecipeError(
                    f"{flag} {folder}: {err}; --dataset imagefolder needs class sub-folders holding images"
                ) from err
        train, evals = datasets
        if train.classes != evals.classes:
            only_val = sorted(set(evals.classes) - set(train.classes))
            only_train = sorted(set(train.classes) - set(evals.classes))
            raise RecipeError(
                f"{args.train_dir} and {args.val_dir} have different class folders ("
                + "; ".join(
                    f"only in {where}: {', '.join(names)}"
                    for where, names in (("--val_dir", only_val), ("--train_dir", only_train))
                    if names
                )
                + "); give both the same class sub-folders, so that a label means the same class in each"
            )
        if len(train.classes) < 2:
            raise RecipeError(
                f"--train_dir {args.train_dir} has {len(train.classes)} class folder; a classifier "
                "needs two or more (one sub-folder of images per class)"
            )
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
    if args.pretrained:  # the weights expect the inputs they were trained on
        cfg = (
            timm_weights(args.model)
            if args.model.startswith("timm/")
            else torchvision.models.get_model_weights(args.model).DEFAULT.transforms()
        )
        mean, std = tuple(cfg.mean), tuple(cfg.std)
    return train, evals, size, mean, std, num_classes


def build_datasets(args):
    """(train, eval, num_classes); augmentation is seeded per sample so resumes replay it exactly."""
    train, evals, size, mean, std, num_classes = load_images(args)
    if size <= 64:  # CIFAR-style: pad-and-crop keeps the whole object in a small image
        eval_tf = [T.Resize((size, size))]
        train_tf = [*eval_tf, T.RandomCrop(size, padding=size // 8)] if args.random_crop else eval_tf
    else:  # ImageNet-style
        eval_tf = [T.Resize(round(size / 0.875)), T.CenterCrop(size)]
        train_tf = [T.RandomResizedCrop(size)] if args.random_crop else eval_tf
    flip = [T.RandomHorizontalFlip(args.hflip)] if args.hflip else []
    tail = [T.ToTensor(), T.Normalize(mean, std)]
    train = common.SeededTransform(train, T.Compose([*train_tf, *flip, *tail]), args.seed)
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
    pad = size // 8 if args.random_crop else 0
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
        cols = (u[:, 1] * (2 * pad + 1)).long()[:, None] + torch.where(u[:, 2:] < args.hflip, steps.flip(0), steps)
        cropped = padded[torch.arange(len(images), device=device)[:, None, None], rows[:, :, None], cols[:, None, :]]
        return normalize(cropped), labels

    train = common.DeviceTensorDataset(
        *(t.to(device) for t in as_uint8(train, size)), transform=crop_flip, draws=3, seed=args.seed
    )
    evals = common.DeviceTensorDataset(
        *(t.to(device) for t in as_uint8(evals, size)), transform=lambda batch, _: (normalize(batch[0]), batch[1])
    )
    return train, evals, num_classes


def get_dataloaders(args, accelerator):
    with common.prepare_data_first(accelerator):
        train, evals, num_classes = (
            build_device_datasets(args, accelerator.device) if args.data_on_device else build_datasets(args)
        )
    train_dl = common.make_dataloader(
        train, args.per_device_train_batch_size, train=True, seed=args.seed, num_workers=args.dataloader_num_workers
    )
    eval_dl = common.make_dataloader(
        evals, args.per_device_eval_batch_size, train=False, num_workers=args.dataloader_num_workers
    )
    return train_dl, eval_dl, num_classes


def timm_weights(name):
    """timm's config of the weights of timm/NAME[.TAG] (mean, std, where they are), or None if it has none."""
    try:
        import timm
    except ImportError as err:
        raise RecipeError(
            f"--model {name} is a timm model, and timm is not installed: pip install -e '.[timm]'"
        ) from err
    try:
        cfg = timm.models.get_pretrained_cfg(name[5:])
    except RuntimeError:  # an unknown tag
        return None
    return cfg if cfg and (cfg.hf_hub_id or cfg.url) else None


def build_model(name, num_classes, pretrained=False):
    """--model `name` with `num_classes` outputs: random, or (`pretrained`) its published weights and a new head."""
    if name.startswith("timm/"):
        cfg = timm_weights(name)  # and import timm, or say how to install it
        import timm

        try:  # timm reads safetensors or torch.load(weights_only=True), and makes the new head itself
            return timm.create_model(name[5:], pretrained=pretrained, num_classes=num_classes)
        except Exception as err:  # not in the cache and offline, a damaged download
            if not pretrained:
                raise
            raise RecipeError(
                f"--pretrained: timm's weights for --model {name} could not be loaded ({one_line(err)}); "
                f"where there is network, fetch {cfg.hf_hub_id or cfg.url} into the Hugging Face cache "
                "(hf download; HF_HOME sets the folder), or pass --pretrained_path"
            ) from err
    if name == "resnet18_cifar":  # 32x32 inputs: a 7x7/2 stem and max-pool would discard 3/4 of them
        model = torchvision.models.resnet18(num_classes=num_classes)
        model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
        return model
    # Inception and GoogLeNet add auxiliary heads in training, which a plain cross-entropy cannot take.
    extra = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
    if not pretrained:
        try:
            return torchvision.models.get_model(name, num_classes=num_classes, **extra)
        except ValueError as err:
            raise RecipeError(f"--model {name}: {err}") from err
    weights = torchvision.models.get_model_weights(name).DEFAULT
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    try:  # torchvision's builders load with weights_only=False: torch's own switch makes it True
        with patch.dict(os.environ, TORCH_FORCE_WEIGHTS_ONLY_LOAD="1"):
            model = torchvision.models.get_model(name, weights=weights)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:  # offline, damaged, pickled code
        why = "not plain weights" if isinstance(err, pickle.UnpicklingError) else one_line(err)
        raise RecipeError(
            f"--pretrained: torchvision's weights for --model {name} ({weights}) "
            + ("cannot be loaded" if path.is_file() else "are not in the cache and could not be downloaded")
            + f" ({why}); download {weights.url} where there is network and put it at {path} (TORCH_HOME sets the "
            "folder), or pass --pretrained_path"
        ) from err
    for aux in ("AuxLogits", "aux1", "aux2"):  # the weights come with the auxiliary heads: drop them as above
        if getattr(model, aux, None) is not None:
            setattr(model, aux, None)
            model.aux_logits = False
    (head,) = head_names(model)
    old, (parent, _, leaf) = model.get_submodule(head), head.rpartition(".")
    setattr(
        model.get_submodule(parent),
        leaf,
        torch.nn.Linear(old.in_features, num_classes)
        if isinstance(old, torch.nn.Linear)
        else torch.nn.Conv2d(old.in_channels, num_classes, old.kernel_size),
    )
    return model


def head_names(model) -> list:
    """The classification layer(s): timm's get_classifier(), else the last Linear or Conv2d (in which every
    torchvision classifier ends)."""
    if hasattr(model, "get_classifier"):
        heads = model.get_classifier() if isinstance(model.get_classifier(), tuple) else (model.get_classifier(),)
        return [name for name, m in model.named_modules() if any(m is head for head in heads)]
    return [[name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))][-1]]


def head_parameters(model) -> set:
    return {id(p) for name in head_names(model) for p in model.get_submodule(name).parameters()}


def load_weights(model, path, name):
    """--pretrained_path into `model`: every tensor must fit but the head's, which stays new if the file's is
    for another number of classes (or missing)."""
    if not Path(path).is_file():
        raise RecipeError(f"--pretrained_path {path}: no such file")
    try:
        state = load_file(path) if path.endswith(".safetensors") else torch.load(path, "cpu", weights_only=True)
        state = {k.removeprefix("module."): v.detach() for k, v in state.items()}  # DDP's names; tensors only
    except Exception as err:  # safetensors', zip's and pickle's errors, a dict of other things: not weights
        why = "not plain tensors" if isinstance(err, (AttributeError, pickle.UnpicklingError)) else one_line(err)
        raise RecipeError(
            f"--pretrained_path {path}: not a file of weights ({why}); pass a .safetensors file or a "
            "state dict saved with torch.save"
        ) from err
    own = model.state_dict()
    head = {f"{n}.{k}" for n in head_names(model) for k in model.get_submodule(n).state_dict()}
    new_head = sorted(k for k in head if k not in state or state[k].shape != own[k].shape)
    counted = lambda k: k not in head and "num_batches_tracked" not in k  # noqa: E731
    misfits = {
        "missing": [k for k in own if k not in state and counted(k)],
        "not in the model": [k for k in state if k not in own and counted(k)],
        "of another shape": [
            f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here"
            for k in state
            if k in own and counted(k) and state[k].shape != own[k].shape
        ],
    }
    if any(misfits.values()):
        raise RecipeError(
            f"--pretrained_path {path}: does not fit --model {name} ("
            + "; ".join(f"{len(keys)} tensor(s) {what}, such as {keys[0]}" for what, keys in misfits.items() if keys)
            + "); pass weights of that architecture, or the --model they belong to"
        )
    model.load_state_dict({k: v for k, v in state.items() if k not in new_head}, strict=False)
    new = f"; {', '.join(new_head)} new: the file's head has other classes" if new_head else ""
    logger.info(f"loaded {path}{new}")


def load_model(args, num_classes):
    """The model to train. --pretrained downloads once per node (the others wait, then read the cache).
    --freeze_backbone sets requires_grad before prepare, so DDP neither syncs nor waits for the frozen
    parameters, and makes BatchNorm FrozenBatchNorm2d: the backbone computes what it was trained to,
    whatever the batch and the number of processes."""
    with common.prepare_data_first(PartialState()) if args.pretrained else contextlib.nullcontext():
        model = build_model(args.model, num_classes, pretrained=args.pretrained)
    if args.pretrained_path:
        load_weights(model, args.pretrained_path, args.model)
    if args.freeze_backbone:
        head, total = head_parameters(model), common.count_parameters(model)
        for p in model.parameters():
            p.requires_grad_(id(p) in head)
        if hasattr(model, "get_classifier"):  # timm's own, which also knows its BatchNormAct2d
            import timm

            model = timm.layers.freeze_batch_norm_2d(model)
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if type(child) is torch.nn.BatchNorm2d:
                    setattr(parent, name, torchvision.ops.FrozenBatchNorm2d(child.num_features, child.eps))
                    getattr(parent, name).load_state_dict(child.state_dict())
        logger.info(
            f"--freeze_backbone: training {', '.join(head_names(model))} only, "
            f"{common.count_parameters(model, True):,} of {total:,} parameters"
        )
    return model


def set_norm_layer(model, kind: str, on_gpu: bool):
    """BatchNorm normalizes each process's micro-batch by its own statistics, so N processes x batch b
    do not train exactly as 1 x Nb. sync_batch computes them over every process (an all-reduce per
    layer, GPUs only in torch); group (GroupNorm, up to 32 groups) needs no batch statistics at all."""
    if kind == "sync_batch":
        if not on_gpu:
            raise RecipeError("--norm_layer sync_batch needs GPUs (torch's SyncBatchNorm); use group or batch on CPU")
        if hasattr(model, "get_classifier"):  # timm's converter keeps the activation of its BatchNormAct2d
            import timm

            return timm.layers.convert_sync_batchnorm(model)
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if kind == "group":
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if isinstance(child, torch.nn.modules.batchnorm._BatchNorm):
                    groups = max(g for g in range(1, 33) if child.num_features % g == 0)
                    norm = torch.nn.GroupNorm(groups, child.num_features)  # timm's BatchNormAct2d also activates:
                    setattr(
                        parent,
                        name,
                        torch.nn.Sequential(norm, child.drop, child.act) if hasattr(child, "act") else norm,
                    )
    return model


def model_problem(name, size, batch, dataset="imagefolder", pretrained=False):
    """Why --model cannot train on `size`-pixel images in batches of `batch`, or None. Checked by
    running the model on the meta device (shapes only: no memory, no compute), where too small an
    input fails as it would in training, or reaches a layer that strides over a single pixel."""
    models = torchvision.models.list_models(module=torchvision.models)  # the classification models
    if name.startswith("timm/"):
        try:
            timm_weights(name)
        except RecipeError as err:  # timm is not installed
            return str(err)
        import timm

        if not timm.is_model(name[5:]):
            close = difflib.get_close_matches(name[5:], timm.list_models(), n=3)
            return (
                f"--model {name}: not a timm model"
                + (f" (did you mean timm/{' or timm/'.join(close)}?)" if close else "")
                + "; pass timm/ and a name from timm.list_models()"
            )
        if ("." in name or pretrained) and timm_weights(name) is None:  # an unknown tag fails even without
            return (
                f"--model {name}: timm has no pretrained weights of that name; pass timm/ and a name from "
                f"timm.list_pretrained('{name[5:].split('.')[0]}*')"
            )
    elif pretrained and name == "resnet18_cifar":
        return (
            "--model resnet18_cifar has no published weights (its stem is not resnet18's); pass --model resnet18 "
            "(or another torchvision or timm/ model) with --pretrained, or --pretrained_path"
        )
    elif name != "resnet18_cifar" and name not in models:
        close = difflib.get_close_matches(name, models, n=3)
        return (
            f"--model {name}: not a torchvision classification model"
            + (f" (did you mean {' or '.join(close)}?)" if close else "")
            + "; pass resnet18_cifar or a name from torchvision.models.list_models(module=torchvision.models)"
        )
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

        hooks = [
            m.register_forward_pre_hook(check)
            for m in model.modules()
            if isinstance(m, (torch.nn.Conv2d, torch.nn.MaxPool2d, torch.nn.AvgPool2d))
        ]
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
            return (
                f"--model {name} cannot take {dataset}'s {size}x{size} images ({problem}); it takes {fits} px: "
                "use --model resnet18_cifar, or an ImageFolder (--dataset imagefolder) with --image_size "
                f"{fits}"
            )
        return (
            f"--model {name} cannot take {size}x{size} images ({problem}); pass --image_size {fits} (a size "
            "it takes), or choose another --model"
        )
    if batch == 1 and fails(size, batch=1):
        return (
            f"--model {name} on {size}x{size} images leaves batch norm one value per channel with "
            "--per_device_train_batch_size 1; pass 2 or more"
        )
    return None


def build_optimizer(args, model, lr, fused=False):
    """fused (on CUDA): one kernel updates every parameter, instead of several launches per tensor. Frozen
    parameters are in no group; the head's come last, at lr x --head_lr_scale (the rate logged is the first's)."""
    groups = common.decay_groups(model, args.weight_decay)
    if args.head_lr_scale != 1:
        head = head_parameters(model)
        groups = [
            {
                **g,
                "params": [p for p in g["params"] if (id(p) in head) == is_head],
                "lr": lr * args.head_lr_scale if is_head else lr,
            }
            for is_head in (False, True)
            for g in groups
        ]
        groups = [g for g in groups if g["params"]]
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
    model = set_norm_layer(load_model(args, num_classes), args.norm_layer, on_gpu)
    if on_gpu:  # channels_last (NHWC) lets cuDNN use tensor cores
        model = model.to(memory_format=torch.channels_last)
    if args.torch_compile:  # in place, so state-dict names, checkpoints and the saved weights stay unchanged
        model.compile()
    optimizer = build_optimizer(args, model, plan.learning_rate, fused=on_gpu)
    scheduler = common.make_scheduler(optimizer, args.lr_scheduler_type, plan, progress)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
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
