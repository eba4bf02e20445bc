"""Image classification: ResNet-18 on CIFAR-10/100 or any ImageFolder, from one CPU to many GPUs.

    accelerate launch --config_file accelerate_configs/1gpu.yaml recipes/cifar.py      # one GPU
    accelerate launch --config_file accelerate_configs/4gpu.yaml recipes/cifar.py      # 4 GPUs, DDP
    ./launch.sh cifar                  # config chosen from the GPUs present; N CPU processes without
    ./launch.sh cifar --dataset imagefolder --train_dir data/train --val_dir data/val --model resnet50 --image_size 224

The learning rate is given for --reference_batch_size samples and scaled to the effective batch
(per-device batch x processes x accumulation) by --lr_scaling, so one command line trains the
same model on any number of devices. Run with --help for every option.

The README's quick start (the digits, 2 CPU processes, 5 epochs) reaches an eval accuracy of 0.96-0.98;
CIFAR-10 on GPUs is not measured in this repository yet (benchmarks/).
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from accelerate.utils import parse_flag_from_env, set_seed
from torchvision import transforms as T

import common
from common import vision
from common.vision import (
    add_image_args,
    add_model_args,
    build_device_datasets,
    build_model,
    held_on_device,
    load_images,
    param_groups,
)

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


def parse_args(argv=None):
    p = common.training_parser("cifar", __doc__)
    add_image_args(p)  # --dataset, --data_dir, --train_dir, --val_dir, --image_size, --data_on_device
    add_model_args(p)  # --model, --pretrained[_path], --freeze_backbone, --head_lr_scale, --norm_layer
    p.add_argument("--optimizer", choices=["sgd", "adamw"])
    p.add_argument("--momentum", type="fraction_below_one")
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction)
    p.add_argument("--label_smoothing", type="fraction_below_one")
    p.add_argument(
        "--hflip", type="probability", help="probability of a horizontal flip in training (0: digits, text)"
    )
    p.add_argument(
        "--random_crop", action=argparse.BooleanOptionalAction, help="pad-and-crop (scale-and-crop above 64 px)"
    )
    p.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile (inductor)")
    p.set_defaults(**HYPERPARAMETERS)
    p.does_nothing_unless(["--momentum", "--nesterov", "--no-nesterov"], lambda a: a.optimizer == "sgd",
                          "with --optimizer adamw (they are SGD's)", ", or pass --optimizer sgd")  # fmt: skip
    p.requires("--nesterov", lambda a: a.optimizer != "sgd" or a.momentum > 0, "--nesterov needs --momentum above 0",
               "pass --no-nesterov for plain SGD", subject="--momentum")  # fmt: skip
    ddp = lambda a: not any(map(parse_flag_from_env, ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"]))  # noqa: E731
    p.requires(None, ddp, "this recipe trains under DDP (accelerate_configs/cpu.yaml, 1gpu..8gpu.yaml): FSDP shards "
               "a model by its transformer layers, which an image model does not have, and DeepSpeed ZeRO keeps "
               "BatchNorm's statistics apart on each process and casts the model alone to bf16")  # fmt: skip
    return p.parse_args(argv)  # and the model arguments' checks, a probe of --model among them


def eval_transform(size, mean, std):
    """What evaluation does to an image (scripts/predict.py too): resized, center-cropped above 64 px, normalized."""
    resize = [T.Resize((size, size))] if size <= 64 else [T.Resize(round(size / 0.875)), T.CenterCrop(size)]
    return T.Compose([*resize, T.ToTensor(), T.Normalize(mean, std)])


def build_datasets(args, images):
    """(train, eval, num_classes) of `images` (load_images); augmentation is seeded per sample so resumes replay it
    exactly."""
    train, evals, size, mean, std, num_classes = images
    evals.transform = eval_transform(size, mean, std)
    eval_tf, tail = evals.transform.transforms[:-2], evals.transform.transforms[-2:]  # the resize; tensor, normalize
    if size <= 64:  # CIFAR-style: pad-and-crop keeps the whole object in a small image
        train_tf = [*eval_tf, T.RandomCrop(size, padding=size // 8)] if args.random_crop else eval_tf
    else:  # ImageNet-style
        train_tf = [T.RandomResizedCrop(size)] if args.random_crop else eval_tf
    flip = [T.RandomHorizontalFlip(args.hflip)] if args.hflip else []
    train = common.SeededTransform(train, T.Compose([*train_tf, *flip, *tail]), args.seed)
    return train, evals, num_classes


def get_dataloaders(args, accelerator, resume_from=None):
    images = load_images(args)
    args.data_on_device = held_on_device(args, images, accelerator, resume_from)  # when not given: if the set fits
    if args.data_on_device:  # held as uint8 on the device, padded, cropped and flipped there (build_datasets' own)
        train, evals, num_classes = build_device_datasets(args, images, accelerator.device)
    else:
        train, evals, num_classes = build_datasets(args, images)
    train_dl = common.make_dataloader(
        train, args.per_device_train_batch_size, train=True, seed=args.seed, num_workers=args.dataloader_num_workers
    )
    eval_dl = common.make_dataloader(
        evals, args.per_device_eval_batch_size, train=False, num_workers=args.dataloader_num_workers
    )
    return train_dl, eval_dl, images[0].classes  # the dataset's class names, in label order


def build_optimizer(args, model, lr, fused=True):
    """fused: one kernel updates every parameter, instead of several launches per tensor (CUDA and CPU). The
    rate logged is the backbone's (the head's group has lr_scale --head_lr_scale)."""
    groups = param_groups(model, args)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused)
    return torch.optim.SGD(groups, lr=lr, momentum=args.momentum, nesterov=args.nesterov, fused=fused)


def evaluate(model, eval_dl, accelerator, classes, stop=None):
    """Loss and accuracy over the whole eval set, and per class, each sample counted exactly once; None if `stop` (a
    common.StopOnSignal) reports a signal, which every process sees at the same batch."""
    model.eval()
    loss_sum, correct, count, confusion = 0.0, 0, 0, 0
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
            confusion = confusion + vision.confusion_counts(labels, preds, len(classes))
    model.train()
    metrics = {"eval_loss": loss_sum / count, "eval_accuracy": correct / count, "eval_samples": count}
    return {**metrics, **vision.per_class_metrics(confusion, classes)}


def main(argv=None):
    args = parse_args(argv)
    accelerator = common.make_accelerator(args)  # refuses a launch that would not train as one job
    set_seed(args.seed)  # every process builds the same initial model
    out = common.OutputDir(accelerator, args)  # claimed for this run; out.resume_from: a checkpoint or None

    train_dl, eval_dl, classes = get_dataloaders(args, accelerator, out.resume_from)
    plan, position = common.plan_run(args, train_dl.dataset, accelerator.num_processes, out.resume_from)

    on_gpu = accelerator.device.type == "cuda"  # then the model and the images channels_last (NHWC): tensor cores
    model = build_model(args, len(classes), on_gpu)  # --pretrained(_path), --freeze_backbone, --norm_layer
    if args.torch_compile:  # in place, so state-dict names, checkpoints and the saved weights stay unchanged
        model.compile()
    optimizer = build_optimizer(args, model, plan.learning_rate)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    if out.resume_from:
        out.load_checkpoint(model, optimizer)
    loop = common.TrainingLoop(
        accelerator, args, plan, position, out, model, partial(evaluate, model, eval_dl, accelerator, classes)
    )

    for step in loop.steps(train_dl, optimizer):  # the rate, the position, the log, stops, checkpoints, evaluations
        for images, labels in step.micro_batches():  # gradients reduced after the last one only
            if on_gpu:
                images = images.contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(model(images), labels, label_smoothing=args.label_smoothing)
            step.backward(loss, items=labels.shape[0])
        if args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        model.zero_grad()  # not optimizer.zero_grad: Accelerate's reads its signature at every step (45 us)
    metrics = loop.finish()  # the final evaluation; the loss and weights checked finite

    out.save_model(model)
    out.write_results(plan, **loop.summary(), **metrics, num_classes=len(classes))
    accelerator.end_training()


if __name__ == "__main__":
    with common.exit_codes():  # a mistake of the user's: one error line, exit 2; a stop on a signal: exit 75
        main()
