"""Images and image classifiers for the vision recipe: image files, CIFAR or two ImageFolders, torchvision and timm
models with a new head, loaded weights, a frozen backbone, the norm layer, and a model probed at parse time."""

import argparse
import collections
import contextlib
import difflib
import functools
import os
import pickle
import unicodedata
import warnings
from pathlib import Path

import numpy as np
import torch
import torchvision
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env
from PIL import Image
from safetensors.torch import load_file
from torchvision import transforms
from torchvision.datasets.folder import IMG_EXTENSIONS

from .checkpoint import read_state
from .data import DeviceTensorDataset, default_num_workers, prepare_data_first
from .errors import DataError
from .metrics import count_parameters
from .plan import decay_groups
from .runtime import RecipeError, check_path, decide_on_main, logger, one_line

CIFAR = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# torchvision's image extensions and the other photo formats this PIL decodes (.heic with pillow-heif)
IMAGE_EXTENSIONS = {*IMG_EXTENSIONS} | (
    {".gif", ".jfif", ".jpe", ".apng", ".avif", ".heic", ".heif"}
    & {e for e, f in Image.registered_extensions().items() if f in Image.OPEN}
)


# Images -------------------------------------------------------------------------------------------


def load_image(path):
    """ImageFolder's loader, naming a file it cannot read; 16-bit grey keeps its high byte (PIL's convert clips)."""
    try:
        with warnings.catch_warnings():  # above PIL's pixel limit a decode per sample per epoch is a mistake
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                if image.mode in ("I", "F"):  # 32-bit integers or floats: no one scale maps them to 8 bits
                    raise DataError(
                        f"{path}: 32-bit pixels (PIL mode {image.mode}) have no single 8-bit scale; convert the "
                        "images to 8 or 16 bits per channel",
                        subject=str(path),
                    )
                if image.mode.startswith("I;16"):
                    return Image.fromarray((np.asarray(image) >> 8).astype(np.uint8), "L").convert("RGB")
                return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise DataError(
            f"{path}: too large to decode ({err}); shrink it first: every image is resized to --image_size anyway",
            subject=str(path),
        ) from err
    except (OSError, SyntaxError, ValueError) as err:  # not an image, truncated, an unsupported variant
        raise DataError(f"{path}: unreadable image ({err}); remove or replace the file", subject=str(path)) from err


def add_image_args(p) -> None:
    """The images: --dataset and where it is, --image_size, --data_on_device, and their rules."""
    add = p.add_argument_group("data").add_argument
    add("--dataset", choices=["cifar10", "cifar100", "imagefolder"], default="cifar10")
    add("--data_dir", default="data", help="where CIFAR is (or is downloaded to)")
    add("--train_dir", help="ImageFolder training images (--dataset imagefolder)")
    add("--val_dir", help="ImageFolder validation images (--dataset imagefolder)")
    add("--image_size", type="positive_int", default=32, help="ImageFolder images are resized to this")
    add(
        "--data_on_device",
        action=argparse.BooleanOptionalAction,
        help="keep the dataset on the accelerator as uint8 and crop/flip there (images of 64 px or less); default: "
        "when the set fits (said in one line), else decoding DataLoader workers",
    )
    folder = lambda a: a.dataset == "imagefolder"  # noqa: E731
    p.does_nothing_unless(["--data_dir"], lambda a: not folder(a), "with --dataset imagefolder (it is CIFAR's "
                          "folder; the images come from --train_dir and --val_dir)")  # fmt: skip
    p.does_nothing_unless(["--train_dir", "--val_dir"], folder, "without --dataset imagefolder (CIFAR comes from "
                          "--data_dir)", ", or add --dataset imagefolder")  # fmt: skip
    p.requires("--dataset imagefolder", lambda a: a.train_dir and a.val_dir, "--dataset imagefolder needs "
               "--train_dir and --val_dir, folders with one sub-folder of images per class")  # fmt: skip
    p.requires("--image_size", lambda a: folder(a) or a.image_size == 32, "--image_size applies to --dataset "
               "imagefolder", lambda a: f"{a.dataset} images are 32 px")  # fmt: skip
    p.requires("--data_on_device", lambda a: a.image_size <= 64, lambda a: f"--data_on_device does CIFAR-style "
               f"pad-and-crop, for images of 64 px or less, not --image_size {a.image_size}", "leave it out (larger "
               "images are cropped by PIL in the DataLoader), or pass --image_size 64 or less")  # fmt: skip


def load_images(args):
    """(train, eval, image size, mean, std, num_classes) of --dataset, not yet transformed, normalized as
    --pretrained's weights were trained; read by the main process first (a download, a scan), then the others."""
    with prepare_data_first(PartialState(), args.ddp_timeout):
        train, evals = _image_sets(args)
    return train, evals, *image_size_and_stats(args), len(train.classes)


def image_size_and_stats(args) -> tuple:
    """(size, mean, std) the model sees images at: CIFAR's 32 px or --image_size, normalized with CIFAR's or ImageNet's
    statistics or, --pretrained, those the weights were trained with (timm's config, torchvision's preset)."""
    folder = args.dataset == "imagefolder"
    size, mean, std = (args.image_size, IMAGENET_MEAN, IMAGENET_STD) if folder else (32, CIFAR_MEAN, CIFAR_STD)
    if args.pretrained:
        cfg = (
            timm_weights(args.model, pretrained=True)
            if args.model.startswith("timm/")
            else torchvision.models.get_model_weights(args.model).DEFAULT.transforms()
        )
        mean, std = tuple(cfg.mean), tuple(cfg.std)
    return size, mean, std


def _image_sets(args):
    if args.dataset != "imagefolder":
        try:
            return [CIFAR[args.dataset](args.data_dir, train=split, download=True) for split in (True, False)]
        except (OSError, RuntimeError) as err:
            folder = Path(args.data_dir, CIFAR[args.dataset].base_folder)  # torchvision checks its files' checksums
            where = f"is damaged or incomplete in {folder}" if folder.exists() else f"is not in {args.data_dir}"
            hint = f" (the folder holding {folder.name})" if Path(args.data_dir).name == folder.name else ""
            raise RecipeError(
                f"{args.dataset} {where} and could not be downloaded ({err}); download it where there is network and "
                f"pass --data_dir{hint}, or use --dataset imagefolder",
                subject="--data_dir",
            ) from err
    train = _image_folder("--train_dir", args.train_dir)
    if len(train.classes) < 2:
        raise RecipeError(
            f"--train_dir {args.train_dir} has {len(train.classes)} class folder; a classifier needs two or more "
            "(one sub-folder of images per class)",
            subject="--train_dir",
        )
    evals = _image_folder("--val_dir", args.val_dir, train.classes)
    if evals.unknown:  # a label the model has no output for
        raise RecipeError(
            f"--val_dir {args.val_dir} has class folders that --train_dir {args.train_dir} lacks "
            f"({', '.join(map(repr, evals.unknown))}); give both the same class sub-folders, so that a label means "
            "the same class in each",
            subject="--val_dir",
        )
    if not evals.samples:
        raise RecipeError(
            f"--val_dir {args.val_dir}: its class folders hold no image; put validation images in them",
            subject="--val_dir",
        )
    if lacking := sorted(set(train.classes) - {train.classes[i] for i in set(evals.targets)}):
        logger.warning(f"--val_dir {args.val_dir} has no image of {len(lacking)} class(es) ({', '.join(lacking)})")
    return train, evals


def _image_folder(flag, folder, classes=None):
    """An ImageFolder of one sub-folder per class; with `classes` (the training set's), labelled by them."""
    check_path(flag, folder, folder=True)
    skipped, images_are = collections.Counter(), ", ".join(sorted(IMAGE_EXTENSIONS))
    try:
        images = ImageFolder(folder, classes, skipped)
    except OSError as err:  # torchvision's: no class folders, no images in them
        raise RecipeError(
            f"{flag} {folder}: {one_line(err)}{f' (skipped: {_tally(skipped)})' if skipped else ''}; --dataset "
            f"imagefolder needs a folder with one sub-folder of images ({images_are}) per class",
            subject=flag,
        ) from err
    if skipped:
        logger.warning(f"{flag} {folder}: skipped {_tally(skipped)}, not images ({images_are})")
    if loose := [p.name for p in Path(folder).iterdir() if not p.name.startswith(".") and not p.is_dir()]:
        logger.warning(
            f"{flag} {folder}: skipped {len(loose)} file(s) outside the class folders, of no class, such as {loose[0]}"
        )
    seen = {}  # each image one sample, of one class: no folder reached twice (a symbolic link to one above it)
    for where in sorted({os.path.dirname(path) for path, _ in images.samples}):
        if (real := os.path.realpath(where)) in seen:
            raise RecipeError(
                f"{flag} {folder}: {where} is {seen[real]} again, through a symbolic link, so its images would be "
                "trained more than once, under another class; remove the link",
                subject=flag,
            )
        seen[real] = where
    return images


def _tally(counts) -> str:
    return ", ".join(f"{n} {ext or 'file(s) without an extension'}" for ext, n in counts.most_common())


class ImageFolder(torchvision.datasets.ImageFolder):
    """torchvision's, reading images with load_image; hidden entries (.ipynb_checkpoints, .git, macOS's ._ files) are
    neither classes nor images, and other files are counted in `skipped` by extension. With `classes`, the training
    set's, a folder is labelled by them, whatever classes it lacks (matched in Unicode NFC: macOS writes names in
    NFD); `unknown` are its class folders not among them."""

    def __init__(self, root, classes=None, skipped=None):
        self.train_classes, self.unknown, skipped = classes, [], collections.Counter() if skipped is None else skipped

        def valid(path) -> bool:
            if any(part.startswith(".") for part in Path(path).relative_to(root).parts):
                return False
            if (ext := Path(path).suffix.lower()) not in IMAGE_EXTENSIONS:
                skipped[ext] += 1
            return ext in IMAGE_EXTENSIONS

        super().__init__(root, loader=load_image, is_valid_file=valid, allow_empty=classes is not None)

    def find_classes(self, directory):
        classes = [name for name in super().find_classes(directory)[0] if not name.startswith(".")]
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")  # torchvision's words
        if self.train_classes is None:
            return classes, {name: i for i, name in enumerate(classes)}
        nfc = functools.partial(unicodedata.normalize, "NFC")
        index = {nfc(name): i for i, name in enumerate(self.train_classes)}
        self.unknown = [name for name in classes if nfc(name) not in index]
        return self.train_classes, {name: index[nfc(name)] for name in classes if nfc(name) in index}


# The input path ----------------------------------------------------------------------------------

# Without --data_on_device or --no-data_on_device, images of 64 px or less are held on the device when, as uint8,
# they take at most this much and a tenth of the memory a process has there (each process holds its own copy).
DEVICE_DATA_BYTES = 2**30
DEVICE_FLAGS = {True: "--data_on_device", False: "--no-data_on_device"}


def _memory_per_process(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil  # accelerate's dependency

    return psutil.virtual_memory().total // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MB" if nbytes < 10 * 2**20 else f"{nbytes / 2**20:,.0f} MB"


def held_on_device(args, images, accelerator, resume_from=None) -> bool:
    """--data_on_device when it is not given: the checkpoint's choice on a resume (its augmentation is the one the
    resume replays; the other path given is refused), else the device path for a set of images of 64 px or less that
    fits, else the decoding DataLoader. Decided by the main process, said in one line whatever decided it."""
    saved = read_state(resume_from).get("args", {}).get("data_on_device") if resume_from is not None else None
    flag = DEVICE_FLAGS
    if saved is not None and args.data_on_device is not None and args.data_on_device != saved:
        asked = flag[args.data_on_device]
        raise RecipeError(
            f"checkpoint {resume_from} was trained with {flag[saved]}, whose crops and flips {asked} would draw "
            f"otherwise; resume without {asked} (or with {flag[saved]})",
            subject=asked,
        )
    train, evals, size = images[:3]
    choose = functools.partial(
        _input_path, args, len(train) + len(evals), size, accelerator.device, saved, resume_from
    )
    return decide_on_main(accelerator, choose)


def _input_path(args, count: int, size: int, device, saved: bool | None, resume_from) -> bool:
    """Whether `count` images of `size` px are held on `device` (see held_on_device), said in one line with why;
    `saved`: the choice of checkpoint `resume_from`, or None."""
    flag = DEVICE_FLAGS
    nbytes = count * size * size * 3
    these = f"the {count:,} images ({_megabytes(nbytes)} as uint8)"
    limit = min(DEVICE_DATA_BYTES, _memory_per_process(device) // 10)
    if saved is not None:
        on_device, why = saved, f"as checkpoint {Path(resume_from).name} was trained"
    elif args.data_on_device is not None:
        on_device, why = args.data_on_device, f"as {flag[args.data_on_device]} asks"
    elif size > 64:
        on_device, why = False, "images above 64 px are cropped by PIL (scale-and-crop)"
    elif args.dataloader_num_workers is not None:
        on_device = False
        why = f"as --dataloader_num_workers asks (--data_on_device would hold {these} on {device.type})"
    elif nbytes > limit:
        on_device = False
        why = (
            f"{these} take more than the {limit / 2**20:,.0f} MB a process may hold on {device.type} (the smaller "
            "of 1 GiB and a tenth of its memory); --data_on_device holds them there all the same"
        )
    else:
        on_device, why = True, None
    if on_device:
        held = (
            f"input: {these} are held on {device.type} and cropped and flipped there (--data_on_device): nothing is "
            "decoded after the start"
        )
        logger.info(f"{held}, {why}" if why else f"{held}; --no-data_on_device decodes them in the DataLoader instead")
        if args.dataloader_num_workers is not None:
            logger.warning(f"--dataloader_num_workers {args.dataloader_num_workers} does nothing: no image is decoded")
    else:
        workers = default_num_workers() if args.dataloader_num_workers is None else args.dataloader_num_workers
        decoded = (
            f"{workers} DataLoader worker(s) a process decode, crop and flip each image"
            if workers
            else "the training process decodes, crops and flips each image (no DataLoader worker)"
        )
        logger.info(f"input: {decoded}, {why}")
    return on_device


def as_uint8(dataset, size):
    """All images of a torchvision dataset as one (N, H, W, C) uint8 tensor, and the labels (read from its files,
    whatever transform the recipe gave it)."""
    if getattr(dataset, "data", None) is not None:  # CIFAR: already an NHWC uint8 array
        return torch.from_numpy(dataset.data), torch.tensor(dataset.targets)
    resized = transforms.Compose([transforms.Resize((size, size)), transforms.PILToTensor()])
    images = [resized(dataset.loader(path)) for path, _ in dataset.samples]
    return torch.stack(images).permute(0, 2, 3, 1).contiguous(), torch.tensor([label for _, label in dataset.samples])


def build_device_datasets(args, images, device):
    """--data_on_device: (train, eval, num_classes) of `images` (load_images) held on `device` as uint8. A batch is
    padded (--random_crop), cropped and flipped (--hflip) on the device in one gather, from numbers seeded per (seed,
    epoch, sample): the augmentation of cifar.py's build_datasets for images of 64 px or less, without decoding."""
    train, evals, size, mean, std, num_classes = images
    pad = size // 8 if args.random_crop else 0
    mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255
    steps = torch.arange(size, device=device)
    layout = torch.channels_last if device.type == "cuda" else torch.contiguous_format  # the recipe's model's

    def normalize(images):  # NHWC uint8 -> NCHW float (permuted, NHWC is channels_last already)
        return ((images.permute(0, 3, 1, 2).float() - mean) / std).contiguous(memory_format=layout)

    def crop_flip(batch, u):
        images, labels = batch
        padded = torch.nn.functional.pad(images, (0, 0, pad, pad, pad, pad))
        rows = (u[:, 0] * (2 * pad + 1)).long()[:, None] + steps
        cols = (u[:, 1] * (2 * pad + 1)).long()[:, None] + torch.where(u[:, 2:] < args.hflip, steps.flip(0), steps)
        cropped = padded[torch.arange(len(images), device=device)[:, None, None], rows[:, :, None], cols[:, None, :]]
        return normalize(cropped), labels

    train = DeviceTensorDataset(
        *(t.to(device) for t in as_uint8(train, size)), transform=crop_flip, draws=3, seed=args.seed
    )
    evals = DeviceTensorDataset(
        *(t.to(device) for t in as_uint8(evals, size)), transform=lambda batch, _: (normalize(batch[0]), batch[1])
    )
    return train, evals, num_classes


# Per-class metrics -------------------------------------------------------------------------------


def confusion_counts(labels, preds, num_classes: int) -> torch.Tensor:
    """(true class, predicted class) counts of a batch, on the CPU: summed over gather_for_metrics' batches, exact
    over the held-out set on any number of processes, as the accuracy is."""
    pairs = labels.long() * num_classes + preds.long()
    return torch.bincount(pairs, minlength=num_classes**2).view(num_classes, num_classes).cpu()


def per_class_metrics(confusion: torch.Tensor, classes) -> dict:
    """What results.json and the model card report per class, by the dataset's class names: each class's held-out
    samples and accuracy (None for a class without any), and the confusion matrix (rows: true, columns: predicted)."""
    samples, correct = confusion.sum(1).tolist(), confusion.diagonal().tolist()
    return {
        "class_names": list(classes),
        "eval_per_class_samples": dict(zip(classes, samples)),
        "eval_per_class_accuracy": {c: k / n if n else None for c, k, n in zip(classes, correct, samples)},
        "eval_confusion_matrix": confusion.tolist(),
    }


# Model arguments ----------------------------------------------------------------------------------


def add_model_args(parser) -> None:
    """--model and the options that build, load, freeze and normalize it, and their rules."""
    add = parser.add_argument_group("model").add_argument
    add("--model", help="resnet18_cifar (3x3 stem, no max-pool), a torchvision model, or timm/NAME (pip install timm)")
    add("--pretrained", action="store_true", help="start from --model's published weights, with a new head")
    add("--pretrained_path", help="start from weights on disk (.safetensors, or a state dict saved with torch.save)")
    add("--freeze_backbone", action="store_true", help="train the head only; BatchNorm keeps the loaded statistics")
    add("--head_lr_scale", type="positive_float", default=1.0, help="the head's rate: --learning_rate times this")
    add(
        "--norm_layer", choices=["batch", "sync_batch", "group"], default="batch",
        help="BatchNorm (statistics per process), synced across processes (GPUs only), or GroupNorm (per sample)",
    )  # fmt: skip
    parser.checks.append(_check_model_args)
    parser.requires(  # the device make_accelerator will give: a GPU unless there is none or ACCELERATE_USE_CPU is set
        "--norm_layer sync_batch",
        lambda a: torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU"),
        "--norm_layer sync_batch needs GPUs (torch's SyncBatchNorm); use group or batch on CPU",
    )  # fmt: skip


def _check_model_args(parser, args) -> None:
    """The model arguments' rules, and --model probed on the meta device (shapes only, no memory): without it a ViT
    fails at the first step, after the data is read, in a traceback, and a ResNet on 8 px trains on 1 pixel."""
    name, size, batch = args.model, args.image_size, args.per_device_train_batch_size
    tuned = args.pretrained or args.pretrained_path
    memory, nbytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), batch * 3 * size * size * 4
    for wrong, subject, problem, fix in (
        (args.pretrained and args.pretrained_path, "--pretrained", "pass --pretrained (published weights) or "
         "--pretrained_path (a file), not both", None),
        ((args.freeze_backbone or args.head_lr_scale != 1) and not tuned, "--freeze_backbone" if
         args.freeze_backbone else "--head_lr_scale", "--freeze_backbone and --head_lr_scale fine-tune loaded "
         "weights: add --pretrained or --pretrained_path", None),
        (args.freeze_backbone and args.head_lr_scale != 1, "--head_lr_scale", "--freeze_backbone trains the head "
         "alone, at --learning_rate: drop --head_lr_scale", None),
        (args.pretrained and args.norm_layer == "group", "--norm_layer", "--norm_layer group replaces the BatchNorm "
         "layers of the published weights", "fine-tune them with --norm_layer batch or sync_batch"),
        (name == "resnet18_cifar" and args.pretrained, "--model", "--model resnet18_cifar has no published weights "
         "(its stem is not resnet18's)", "pass --model resnet18 (or another torchvision or timm/ model) with "
         "--pretrained, or --pretrained_path"),
        (nbytes > memory, "--image_size", f"--image_size {size}: one batch of {batch} such images is "
         f"{nbytes / 1e9:,.0f} GB as float32 before the model sees it, more than this machine's {memory / 1e9:.0f} GB "
         "of memory", "pass the size the model should see (the images are resized to it), such as 224"),  # a typo
    ):  # fmt: skip
        if wrong:
            parser.error(problem, fix, subject=subject)
    if name.startswith("timm/"):
        try:
            timm_weights(name, args.pretrained)  # timm is installed, the name is a model's, its weights published
        except RecipeError as err:
            parser.error(err)
    elif name not in (models := ["resnet18_cifar", *torchvision.models.list_models(module=torchvision.models)]):
        close = difflib.get_close_matches(name, models, n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        parser.error(
            f"--model {name}: not a torchvision classification model{hint}",
            "pass resnet18_cifar or a name from torchvision.models.list_models(module=torchvision.models)",
            subject="--model",
        )
    try:
        with torch.device("meta"):
            model = new_model(name, 10).train()  # batch norm's one-value-per-channel check is a training one
    except Exception:  # a model whose construction needs real data cannot be probed this way
        return

    def check(layer, inputs):  # the meta model is thrown away: its hooks with it
        stride = layer.stride if isinstance(layer.stride, tuple) else (layer.stride,) * 2
        if any(s > 1 and n < s for n, s in zip(inputs[0].shape[-2:], stride)):
            raise ValueError(f"a {type(layer).__name__} strides over a single pixel")

    for layer in model.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.MaxPool2d, torch.nn.AvgPool2d)):
            layer.register_forward_pre_hook(check)

    def fails(size, batch=2):
        try:
            model(torch.empty(batch, 3, size, size, device="meta"))
        except Exception as err:  # that, or the model's own shape errors: a kernel larger than its input, ViT's size
            return one_line(err)

    sizes = (8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 299, 384, 512)
    problem = fails(size)
    if fits := problem and next((s for s in sizes if s > size and not fails(s)), None):  # None: cannot be probed
        cifar = args.dataset != "imagefolder"
        data, fix = (f"{args.dataset}'s ", " with --dataset imagefolder") if cifar else ("", "")
        parser.error(
            f"--model {name} cannot take {data}{size}x{size} images ({problem})",
            f"pass --image_size {fits}{fix}, or another --model",
            subject="--model",
        )
    if batch == 1 and not problem and fails(size, batch=1):
        parser.error(
            f"--model {name} on {size}x{size} images leaves batch norm one value per channel with "
            "--per_device_train_batch_size 1", "pass 2 or more", subject="--per_device_train_batch_size",
        )  # fmt: skip


# Models -------------------------------------------------------------------------------------------


def timm_weights(name, pretrained=False):
    """timm's config of --model timm/NAME[.TAG]'s published weights, or None; RecipeError for what timm lacks."""
    try:
        import timm
    except ImportError as err:
        raise RecipeError(
            f"--model {name} is a timm model, and timm is not installed: pip install -e '.[timm]'", subject="--model"
        ) from err
    if not timm.is_model(name[5:]):
        close = difflib.get_close_matches(name[5:], timm.list_models(), n=3)
        hint = f" (did you mean timm/{' or timm/'.join(close)}?)" if close else ""
        raise RecipeError(
            f"--model {name}: not a timm model{hint}",
            "pass timm/ and a name from timm.list_models()",
            subject="--model",
        )
    with contextlib.suppress(RuntimeError):  # an unknown tag
        cfg = timm.models.get_pretrained_cfg(name[5:])
        if cfg and (cfg.hf_hub_id or cfg.url):
            return cfg
    if "." in name or pretrained:
        raise RecipeError(
            f"--model {name}: timm has no pretrained weights of that name",
            f"pass timm/ and a name from timm.list_pretrained('{name[5:].split('.')[0]}*')",
            subject="--model",
        )
    return None


def build_model(args, num_classes: int, on_gpu: bool):
    """--model as the model arguments say; published weights are downloaded by one process per node. For a GPU
    (`on_gpu`), in channels_last (NHWC) memory, which lets cuDNN use tensor cores."""
    with prepare_data_first(PartialState(), args.ddp_timeout) if args.pretrained else contextlib.nullcontext():
        model = new_model(args.model, num_classes, pretrained=args.pretrained)
    group = args.norm_layer == "group"  # before --pretrained_path: a run with --norm_layer group saved GroupNorm's
    model = set_norm_layer(model, "group") if group else model
    if args.pretrained_path:
        load_weights(model, args.pretrained_path, args.model)
    if args.freeze_backbone:
        model = freeze_backbone(model)
    model = model if group else set_norm_layer(model, args.norm_layer)
    return model.to(memory_format=torch.channels_last) if on_gpu else model


AUX_HEADS = ("AuxLogits.", "aux1.", "aux2.")  # Inception's and GoogLeNet's, which the models here are built without


def new_model(name, num_classes, pretrained=False):
    """--model `name` with `num_classes` outputs: random, or (`pretrained`) its published weights and a new head."""
    if name.startswith("timm/"):
        cfg = timm_weights(name, pretrained)  # and import timm, or say how to install it
        import timm

        try:  # timm reads safetensors or torch.load(weights_only=True), and makes the new head itself
            return timm.create_model(name[5:], pretrained=pretrained, num_classes=num_classes)
        except Exception as err:  # not in the cache and offline, a damaged download
            if not pretrained:
                raise
            raise RecipeError(
                f"--pretrained: timm's weights for --model {name} could not be loaded ({one_line(err)}); where there "
                f"is network, fetch {cfg.hf_hub_id or cfg.url} into the Hugging Face cache (hf download; HF_HOME sets "
                "the folder), or pass --pretrained_path",
                subject="--pretrained",
            ) from err
    if name == "resnet18_cifar":  # 32x32 inputs: a 7x7/2 stem and max-pool would discard 3/4 of them
        model = torchvision.models.resnet18(num_classes=num_classes)
        model.conv1, model.maxpool = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False), torch.nn.Identity()
        return model
    # Inception, GoogLeNet: no auxiliary heads (AUX_HEADS: a plain cross-entropy cannot take them); inputs as their
    # weights want
    extra = {"aux_logits": False, "init_weights": True, "transform_input": pretrained}
    extra = extra if name in ("inception_v3", "googlenet") else {}
    model = torchvision.models.get_model(name, num_classes=num_classes, **extra)
    if not pretrained:
        return model
    weights = torchvision.models.get_model_weights(name).DEFAULT
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
    try:  # as torchvision's builders read them, but as weights only: no pickled code runs
        state = weights.get_state_dict(weights_only=True, check_hash=True)  # torch checks a download's hash alone
        if bad := _not_finite(state):  # a cached file damaged since
            raise RuntimeError(f"{len(bad)} tensor(s) hold NaN or inf, such as {bad[0]}")
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:  # offline, damaged, pickled code
        why = "not plain weights" if isinstance(err, pickle.UnpicklingError) else one_line(err)
        state = "cannot be loaded" if os.path.isfile(path) else "are not in the cache and could not be downloaded"
        raise RecipeError(
            f"--pretrained: torchvision's weights for --model {name} ({weights}) {state} ({why}); download "
            f"{weights.url} where there is network and put it at {path} (TORCH_HOME sets the folder), or pass "
            "--pretrained_path",
            subject="--pretrained",
        ) from err
    new = (*(f"{head}." for head in head_names(model)), *AUX_HEADS)  # a new head, no auxiliary ones
    missing = model.load_state_dict({k: v for k, v in state.items() if not k.startswith(new)}, strict=False)
    if unloaded := [k for k in missing.missing_keys if not k.startswith(new)] + missing.unexpected_keys:
        raise RuntimeError(f"torchvision's {weights} do not fit its {name}: {unloaded[:3]}")  # silently random else
    return model


def _not_finite(state: dict) -> list:
    return [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def head_names(model) -> list:
    """timm's get_classifier(), else the last Linear or Conv2d, in which every torchvision classifier ends."""
    if hasattr(model, "get_classifier"):
        heads = model.get_classifier() if isinstance(model.get_classifier(), tuple) else (model.get_classifier(),)
        return [name for name, m in model.named_modules() if any(m is head for head in heads)]
    return [[name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))][-1]]


def load_weights(model, path, name):
    """--pretrained_path into `model`: every tensor must fit but the head's, new if the file's has other classes."""
    check_path("--pretrained_path", path)
    try:
        state = load_file(path) if path.endswith(".safetensors") else torch.load(path, "cpu", weights_only=True)
        if nested := [key for key in ("state_dict", "model") if isinstance(state.get(key), dict)]:
            state = state[nested[0]]  # a training checkpoint's weights (the keys timm's load_checkpoint reads)
        state = {k.removeprefix("module."): v.detach() for k, v in state.items()}  # DDP's names; tensors only
        state = {k: v for k, v in state.items() if not k.startswith(AUX_HEADS)}  # torchvision's Inception files'
    except Exception as err:  # safetensors', zip's and pickle's errors, a dict of other things: not weights
        why = "not plain tensors" if isinstance(err, (AttributeError, pickle.UnpicklingError)) else one_line(err)
        raise RecipeError(
            f"--pretrained_path {path}: not a file of weights ({why}); pass a .safetensors file or a state dict saved "
            "with torch.save",
            subject="--pretrained_path",
        ) from err
    own = model.state_dict()
    head = {f"{n}.{k}" for n in head_names(model) for k in model.get_submodule(n).state_dict()}
    fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    counted = [k for k in {**own, **state} if k not in head and "num_batches_tracked" not in k]
    misfits = {
        "missing": [k for k in counted if k not in state],
        "not in the model": [k for k in counted if k not in own],
        "of another shape": [
            f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here"
            for k in counted
            if k in own and k in state and k not in fits
        ],
    }
    if any(misfits.values()):
        found = "; ".join(f"{len(keys)} tensor(s) {what}, such as {keys[0]}" for what, keys in misfits.items() if keys)
        fix = "pass weights of that architecture, or the --model they belong to"
        for what, norm in (("missing", "group"), ("not in the model", "batch")):  # BatchNorm's statistics alone
            if misfits[what] and all(k.endswith(("running_mean", "running_var")) for k in misfits[what]):
                fix = (
                    f"its norm layers are {'BatchNorm' if norm == 'batch' else 'GroupNorm'}: pass --norm_layer {norm}"
                )
        raise RecipeError(
            f"--pretrained_path {path}: does not fit --model {name} ({found}); {fix}", subject="--pretrained_path"
        )
    if bad := _not_finite(fits):
        raise RecipeError(
            f"--pretrained_path {path}: {len(bad)} tensor(s) hold NaN or inf, such as {bad[0]}; pass weights of a run "
            "that did not diverge",
            subject="--pretrained_path",
        )
    model.load_state_dict(fits, strict=False)
    new = sorted(head - fits.keys())
    logger.info(f"loaded {path}" + (f"; {', '.join(new)} new: the file's head has other classes" if new else ""))


def freeze_backbone(model):
    """Train only the head: the rest stops requiring gradients (before prepare, so DDP neither syncs nor waits for
    it), and BatchNorm is frozen, so the backbone computes what it was trained to whatever the batch."""
    total = count_parameters(model)
    model.requires_grad_(False)
    for head in head_names(model):
        model.get_submodule(head).requires_grad_(True)
    if hasattr(model, "get_classifier"):  # timm's own, which also knows its BatchNormAct2d
        import timm

        model = timm.layers.freeze_batch_norm_2d(model)
    for name, norm in _layers(model, torch.nn.BatchNorm2d):
        model.set_submodule(name, torchvision.ops.FrozenBatchNorm2d(norm.num_features, norm.eps))
        model.get_submodule(name).load_state_dict(norm.state_dict())
    trained = f"{count_parameters(model, True):,} of {total:,} parameters"
    logger.info(f"--freeze_backbone: training {', '.join(head_names(model))} only, {trained}")
    return model


def set_norm_layer(model, kind: str):
    """BatchNorm normalizes each process's micro-batch by its own statistics, so N processes x batch b do not train
    as 1 x Nb: sync_batch all-reduces them (GPUs only in torch); group (GroupNorm) needs no batch statistics."""
    if kind == "sync_batch":  # on GPUs: the parse refused it elsewhere (add_model_args)
        if hasattr(model, "get_classifier"):  # timm's converter keeps the activation of its BatchNormAct2d
            import timm

            return timm.layers.convert_sync_batchnorm(model)
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if kind == "group":
        for name, bn in _layers(model, torch.nn.modules.batchnorm._BatchNorm):
            norm = torch.nn.GroupNorm(max(g for g in range(1, 33) if bn.num_features % g == 0), bn.num_features)
            # timm's BatchNormAct2d also drops out and activates
            model.set_submodule(name, torch.nn.Sequential(norm, bn.drop, bn.act) if hasattr(bn, "act") else norm)
    return model


def _layers(model, kind) -> list:
    """(name, layer) of every `kind` layer, each name of a shared one, listed before any is replaced."""
    return [(name, layer) for name, layer in model.named_modules(remove_duplicate=False) if isinstance(layer, kind)]


def param_groups(model, args) -> list:
    """decay_groups, and with --head_lr_scale the head's apart, its `lr_scale` (timm's name) applied by the loop."""
    groups = decay_groups(model, args.weight_decay)
    if args.head_lr_scale == 1:
        return groups
    head = {id(p) for name in head_names(model) for p in model.get_submodule(name).parameters()}
    groups = [
        {**g, "params": [p for p in g["params"] if (id(p) in head) == is_head], "lr_scale": scale}
        for is_head, scale in ((False, 1.0), (True, args.head_lr_scale))
        for g in groups
    ]
    return [g for g in groups if g["params"]]
