"""Every fix the table of errors (docs/errors.md) shows, followed literally, lets the run start.

Each case makes a row's mistake, reads the fix out of the error line the recipe printed (not out of the table: what
a user follows is the line in front of them), applies it to the same command, and runs that: it must train its step
and exit 0. A row of the table that no case here follows is listed in NOT_FOLLOWED_HERE with the reason, and a
row that is in neither fails the test, so a new row of the table comes with its case.

One-process runs of a recipe are forked from a process with the libraries imported (tests/warm.py): a case costs
its two runs' own work, about a second for a refusal and a few for a step of the tiny models.
"""

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from conftest import BIN, NO_NETWORK, REPO, digits_args, error_lines, lm_args, results, run, snapshot, user_env
from PIL import Image

TABLE = [
    row.split("|")[1].strip()
    for row in (REPO / "docs" / "errors.md").read_text().splitlines()
    if row.startswith("| ") and not row.startswith("| input |")
]
# Rows whose fix cannot be followed in a one-process CPU run here, and where each is tested instead.
NOT_FOLLOWED_HERE = {
    "a DeepSpeed config where DeepSpeed is not installed": "needs an environment without DeepSpeed",
    "missing data, a damaged local CIFAR copy": "CIFAR's download needs the network",
    "a file or folder the system refuses": "permissions do not bind root, which runs the suite; tests/test_rules.py",
    "a checkpoint of another distributed strategy": "needs DeepSpeed in two processes: tests/test_zero.py",
    "an `--output_dir` another run is writing": "the fix is to wait for a second run: tests/test_rules.py",
    "a full disk": "needs a small filesystem: tests/test_fault.py",
    "an unwritable `--output_dir`": "permissions do not bind root, which runs the suite; tests/test_rules.py",
    "more processes than GPUs": "needs GPUs",
    "processes that did not form one group": "needs a broken launch: tests/test_launch_sh.py",
    "GPUs nvidia-smi lists but this torch cannot use": "needs GPUs",
    "a recipe started as N copies by `srun`": "needs srun: tests/test_slurm.py",
    "an accelerate config that starts fewer processes": "two processes: tests/test_launch_sh.py",
    "a DeepSpeed file whose batch": "DeepSpeed in processes: tests/test_zero.py",
    "a ZeRO-3 config that cannot save": "DeepSpeed in processes: tests/test_zero.py",
    "`accelerate launch --num_processes 2` that starts one process": "two processes: tests/test_launch_sh.py",
    "an HSDP or tensor-parallel mesh": "4 processes: tests/test_hsdp.py follows it",
    "a process count `./launch.sh --config hsdp`": "tests/test_hsdp.py follows it (launch.sh --dry_run)",
    "an encoder (BERT and kin)": "the fix is another model, the user's to choose",
    "a credential in a mistyped argument": "as an unknown argument, which a case follows; the value is masked",
}


@dataclass
class Context:
    """A case's folder and inputs: `paths` names what its arguments may hold as {name} (filled in by `before`)."""

    out: Path
    tmp: Path
    digits: dict
    lm: dict
    paths: dict = field(default_factory=dict)


@dataclass
class Case:
    row: str  # the start of the table row's input column
    recipe: str
    bad: list  # options of the base command: a value replaces the base's, None drops the option, a flag is added
    fix: str  # a regular expression for the fix in the error line; `follow` gets its match
    follow: Callable  # (match, argv, context) -> the argv the fix asks for, having done what else it asks
    before: Callable = None  # (context) -> None: the folder, data or checkpoint the mistake needs
    env: Callable = lambda ctx: {}  # (context) -> the variables the runs have beside the user's


def setting(option, value):
    """The command with `option` set to `value`: replaced where it is given, else added."""

    def follow(argv):
        if option in argv:
            i = argv.index(option)
            return [*argv[: i + 1], value, *argv[i + 2 :]]
        return [*argv, option, value]

    return follow


def dropping(*options):
    """The command without `options` and their values."""

    def follow(argv):
        out, skip = [], False
        for a in argv:
            if skip and not a.startswith("--"):
                continue
            skip = a in options
            if not skip:
                out.append(a)
        return out

    return follow


def given(argv, option):
    """The value of `option`'s last occurrence in `argv` (argparse keeps the last)."""
    return argv[len(argv) - argv[::-1].index(option)]


def lm_run(folder, lm, steps):
    """An lm_finetune run of `steps` steps in `folder` that saved a checkpoint at each."""
    run([BIN / "python", REPO / "recipes/lm_finetune.py"]
        + lm_args(lm, folder, "--max_train_steps", str(steps), "--checkpointing_steps", "1"))  # fmt: skip


def finished_run(ctx):
    lm_run(ctx.out, ctx.lm, 2)


def interrupted_run(ctx):
    """A run killed after its checkpoint of step 2, before its final save: its checkpoints and nothing else."""
    lm_run(ctx.out, ctx.lm, 2)
    for path in ctx.out.iterdir():
        if not path.name.startswith("checkpoint-"):
            path.unlink()


def another_folders_run(ctx):
    lm_run(ctx.tmp / "other", ctx.lm, 2)
    ctx.paths["other"] = str(ctx.tmp / "other")


def damaged_checkpoint(ctx):
    another_folders_run(ctx)
    optimizer = ctx.tmp / "other" / "checkpoint-2" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # a copy cut short


def foreign_files(ctx):
    shutil.copytree(ctx.lm["model"], ctx.out)  # the pretrained model's own folder


def larger_tokenizer(ctx):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ctx.lm["model"])
    tokenizer.add_tokens([f"new{i}" for i in range(8)])
    tokenizer.save_pretrained(ctx.tmp / "tokenizer")
    ctx.paths["tokenizer"] = str(ctx.tmp / "tokenizer")


def pretrained_file(ctx):
    """Weights of torchvision's ResNet-18 as a file of the user's (written when the fix names it)."""
    ctx.paths["weights"] = str(ctx.tmp / "weights.safetensors")


def with_rows(name, source, insert):
    """A copy of the tiny LM's `source` data file with `insert` as its 6th row, as {name}."""

    def before(ctx):
        rows = Path(ctx.lm[source]).read_text().splitlines()
        rows.insert(5, json.dumps(insert))
        (ctx.tmp / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
        ctx.paths[name] = str(ctx.tmp / f"{name}.jsonl")

    return before


def without_rows(path, bad):
    """The data file at `path` without the rows `bad` (a function of a row) says are wrong."""
    rows = Path(path).read_text().splitlines()
    Path(path).write_text("\n".join(row for row in rows if not bad(json.loads(row))) + "\n")


def images(change):
    """A copy of the digits as {train} and {val}, after `change(train, val)`."""

    def before(ctx):
        shutil.copytree(ctx.digits["train"].parent, ctx.tmp / "digits", symlinks=True)
        train, val = ctx.tmp / "digits" / "train", ctx.tmp / "digits" / "val"
        change(train, val)
        ctx.paths |= {"train": str(train), "val": str(val)}

    return before


def garbage_image(train, val):
    (next((train / "3").iterdir())).write_bytes(b"not an image")


def a_link_up(train, val):
    (train / "7" / "up").symlink_to(train)


def a_class_only_val_has(train, val):
    (val / "10").mkdir()
    shutil.copy2(next((val / "1").iterdir()), val / "10" / "x.png")


def too_large(train, val):
    """An image whose PNG header claims 20,000 x 20,000 pixels (PIL refuses it before decoding)."""
    import struct
    import zlib

    path = next((train / "3").iterdir())
    Image.new("L", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    data[16:24] = struct.pack(">II", 20_000, 20_000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))


def shrunk(path):
    """The image at `path` shrunk, as the fix says: a small one in its place."""
    Image.new("L", (28, 28)).save(path, format="PNG")


def offline(ctx):
    """No network, and torchvision's cache in the case's folder."""
    return {"TORCH_HOME": str(ctx.tmp / "torch"), **NO_NETWORK}


def imagenet_weights(path):
    """torchvision's ResNet-18 of ImageNet's classes, at the path the fix names (seeded: the download stands in)."""
    import torch
    import torchvision

    torch.manual_seed(0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(torchvision.models.resnet18().state_dict(), path)


def broken_model_config(ctx):
    shutil.copytree(ctx.lm["model"], ctx.tmp / "broken-model")
    (ctx.tmp / "broken-model" / "config.json").write_text("{not json")
    ctx.paths |= {"broken_model": str(ctx.tmp / "broken-model"), "model": str(ctx.lm["model"])}


CASES = [
    Case(
        "unknown argument",
        "lm_finetune",
        ["--per_device_batch_size", "8"],
        r"did you mean (--\w+) or (--\w+)\?",  # the eval batch or the train batch: the second is this one
        lambda m, argv, ctx: setting(m[2], "8")(dropping("--per_device_batch_size")(argv)),
    ),
    Case(
        "a batch larger than the dataset",
        "lm_finetune",
        ["--per_device_train_batch_size", "4096"],
        r"holds (\d+) samples: .*; lower --per_device_train_batch_size, or use more data",
        lambda m, argv, ctx: setting("--per_device_train_batch_size", m[1])(argv),  # to what the set holds
    ),
    Case(
        "more accumulation steps than batches",
        "lm_finetune",
        ["--gradient_accumulation_steps", "500"],
        r"lower --gradient_accumulation_steps to (\d+) or less",
        lambda m, argv, ctx: setting("--gradient_accumulation_steps", m[1])(argv),
    ),
    Case(
        "a checkpoint of another recipe",
        "zero",
        ["--resume_from_checkpoint", "{other}/checkpoint-2", "--max_train_steps", "3"],
        r"resume it with that recipe, or drop (--resume_from_checkpoint) to start a new run$",
        lambda m, argv, ctx: dropping(m[1])(argv),
        before=another_folders_run,
    ),
    Case(
        "a checkpoint of another model",
        "lm_finetune",
        ["--resume_from_checkpoint", "{other}/checkpoint-2", "--max_train_steps", "3", "--lora_r", "4"],
        r"differs from it in (--lora_r) (\d+) -> \d+; resume with the model arguments that wrote it",
        lambda m, argv, ctx: setting(m[1], m[2])(argv),
        before=another_folders_run,
    ),
    Case(
        "an `--output_dir` holding what no run wrote",
        "lm_finetune",
        [],
        r"or pass another (--output_dir)$",
        lambda m, argv, ctx: setting(m[1], str(ctx.tmp / "another"))(argv),
        before=foreign_files,
    ),
    Case(
        "a damaged checkpoint",
        "lm_finetune",
        ["--resume_from_checkpoint", "{other}/checkpoint-2", "--max_train_steps", "3"],
        r"pass an older checkpoint \((\S+)\)$",
        lambda m, argv, ctx: setting("--resume_from_checkpoint", m[1])(argv),
        before=damaged_checkpoint,
    ),
    Case(
        "a checkpoint past the length asked",
        "lm_finetune",
        ["--resume_from_checkpoint", "{other}/checkpoint-2", "--max_train_steps", "1"],
        r"pass (--max_train_steps) (\d+) or more",
        lambda m, argv, ctx: setting(m[1], m[2])(argv),
        before=another_folders_run,
    ),
    Case(
        "a checkpoint resumed with another `--seed`",
        "lm_finetune",
        ["--resume_from_checkpoint", "{other}/checkpoint-2", "--seed", "7", "--max_train_steps", "3"],
        r"resume with (--seed) (\d+)$",
        lambda m, argv, ctx: setting(m[1], m[2])(argv),
        before=another_folders_run,
    ),
    Case(
        "another folder's checkpoint, into an `--output_dir` holding a run",
        "lm_finetune",
        ["--max_train_steps", "3", "--resume_from_checkpoint", "{other}/checkpoint-2"],
        r"pass (--overwrite_output_dir) to start over there from it",
        lambda m, argv, ctx: [*argv, m[1]],
        before=lambda ctx: (finished_run(ctx), another_folders_run(ctx)),
    ),
    Case(
        "`--overwrite_output_dir` with `--resume_from_checkpoint latest`",
        "lm_finetune",
        ["--overwrite_output_dir", "--resume_from_checkpoint", "latest", "--max_train_steps", "3"],
        r"pass one of them",
        lambda m, argv, ctx: dropping("--overwrite_output_dir")(argv),
        before=interrupted_run,
    ),
    Case(
        "an `--output_dir` holding a run that did not finish",
        "lm_finetune",
        ["--max_train_steps", "3"],
        r"pass (--resume_from_checkpoint) (latest) to continue it",
        lambda m, argv, ctx: setting(m[1], m[2])(argv),
        before=interrupted_run,
    ),
    Case(
        "an `--output_dir` holding a finished run, no resume flag",
        "lm_finetune",
        ["--max_train_steps", "3"],  # one more step than it trained
        r"which finished; pass (--resume_from_checkpoint) (\S+) with a larger --max_train_steps",
        lambda m, argv, ctx: setting(m[1], m[2])(argv),
        before=finished_run,
    ),
    Case(
        "a tokenizer larger than the model's vocabulary",
        "lm_finetune",
        ["--tokenizer_name", "{tokenizer}"],
        r"pass (--resize_token_embeddings) to grow the embeddings",
        lambda m, argv, ctx: [*argv, m[1]],
        before=larger_tokenizer,
    ),
    Case(
        "a loss or weights that become NaN or inf",
        "lm_finetune",
        ["--learning_rate", "1e12", "--max_train_steps", "6"],
        r"lower (--learning_rate)",
        lambda m, argv, ctx: setting(m[1], "3e-3")(argv),  # lm_args's rate
    ),
    Case(
        "a number out of range or not a number",
        "lm_finetune",
        ["--learning_rate", "nan"],
        r"pass a number greater than (\d+)",
        lambda m, argv, ctx: setting("--learning_rate", str(int(m[1]) + 1e-3))(argv),
    ),
    Case(
        "training that would be empty",
        "lm_finetune",
        ["--num_train_epochs", "0"],
        r"pass a whole number at least (\d+)",
        lambda m, argv, ctx: setting("--num_train_epochs", m[1])(argv),
    ),
    Case(
        "`--checkpointing_steps 0`",
        "lm_finetune",
        ["--checkpointing_steps", "0"],
        r"to save no checkpoints, omit the option",
        lambda m, argv, ctx: dropping("--checkpointing_steps")(argv),
    ),
    Case(
        "a schedule the recipe cannot drive",
        "lm_finetune",
        ["--lr_scheduler_type", "reduce_lr_on_plateau"],
        r"\(choose from '(\w+)'",
        lambda m, argv, ctx: setting("--lr_scheduler_type", m[1])(argv),
    ),
    Case(
        "arguments that contradict each other",
        "cifar",
        ["--momentum", "0", "--nesterov"],
        r"pass (--no-nesterov) for plain SGD",
        lambda m, argv, ctx: [*argv, m[1]],
    ),
    Case(
        "fine-tuning options without weights to fine-tune",
        "cifar",
        ["--model", "resnet18", "--freeze_backbone"],
        r"add --pretrained or (--pretrained_path)",
        lambda m, argv, ctx: setting(m[1], user_weights(ctx))(argv),
        before=pretrained_file,
    ),
    Case(
        "images too small for the model",
        "cifar",
        ["--model", "resnet18", "--image_size", "8"],
        r"pass (--image_size) (\d+)",
        lambda m, argv, ctx: setting(m[1], m[2])(argv),
    ),
    Case(
        "an `--image_size` so large",
        "cifar",
        ["--image_size", "100000"],
        r"pass the size the model should see \(the images are resized to it\), such as \d+$",
        lambda m, argv, ctx: setting("--image_size", "32")(argv),  # the size these images are
    ),
    Case(
        "an unreadable image in an ImageFolder",
        "cifar",
        ["--train_dir", "{train}", "--val_dir", "{val}"],
        r"error: (\S+): unreadable image .*; remove or replace the file",
        lambda m, argv, ctx: (os.remove(m[1]), argv)[1],
        before=images(garbage_image),
    ),
    Case(
        "an ImageFolder that reaches a folder twice",
        "cifar",
        ["--train_dir", "{train}", "--val_dir", "{val}"],
        r"(\S+)/\d+ is \S+ again, through a symbolic link, .*; remove the link",
        lambda m, argv, ctx: (os.remove(m[1]), argv)[1],
        before=images(a_link_up),
    ),
    Case(
        "a class folder in `--val_dir` that `--train_dir` lacks",
        "cifar",
        ["--train_dir", "{train}", "--val_dir", "{val}"],
        r"--val_dir (\S+) has class folders that --train_dir \S+ lacks \('(\w+)'\); give both the same class",
        lambda m, argv, ctx: (shutil.rmtree(Path(m[1]) / m[2]), argv)[1],
        before=images(a_class_only_val_has),
    ),
    Case(
        "an empty dataset",
        "cifar",
        ["--train_dir", "{class_folder}"],  # one class's folder, not the folder of the classes
        r"--train_dir (\S+): Couldn't find any class folder in \S+; --dataset imagefolder needs a folder with one "
        r"sub-folder of images \(.*\) per class$",
        lambda m, argv, ctx: setting("--train_dir", str(Path(m[1]).parent))(argv),  # the folder that holds them
        before=lambda ctx: ctx.paths.update(class_folder=str(ctx.digits["train"] / "3")),
    ),
    Case(
        "an image too large to decode",
        "cifar",
        ["--train_dir", "{train}", "--val_dir", "{val}"],
        r"error: (\S+): too large to decode .*; shrink it first",
        lambda m, argv, ctx: (shrunk(m[1]), argv)[1],
        before=images(too_large),
    ),
    Case(
        "pretrained weights that are not cached",
        "cifar",
        ["--model", "resnet18", "--pretrained"],
        r"where there is network and put it at (\S+) \(TORCH_HOME sets the folder\)",
        lambda m, argv, ctx: (imagenet_weights(m[1]), argv)[1],
        env=offline,
    ),
    Case(
        "a LoRA rank above the rank of a layer it adapts",
        "lm_finetune",
        ["--lora_r", "64"],
        r"pass (--lora_r) (\d+) or less",
        lambda m, argv, ctx: setting(m[1], m[2])(argv),
    ),
    Case(
        "an option that would do nothing with the others given",
        "lm_finetune",
        ["--lora_alpha", "16"],
        r"(--lora_alpha) would do nothing without --lora_r .*: drop it",
        lambda m, argv, ctx: dropping(m[1])(argv),
    ),
    Case(
        "LoRA target modules the model does not have",
        "lm_finetune",
        ["--lora_r", "4", "--lora_target_modules", "qproj"],
        r"or pass (all-linear)$",
        lambda m, argv, ctx: setting("--lora_target_modules", m[1])(argv),
    ),
    Case(
        "an attention implementation that is unknown or not installed",
        "lm_finetune",
        ["--attn_implementation", "flash_attention_2"],
        r"or leave the option out",
        lambda m, argv, ctx: dropping("--attn_implementation")(argv),
    ),
    Case(
        "config overrides the model rejects",
        "lm_finetune",
        ["--model_name_or_path", None, "--config_name", "{model}", "--config_overrides", "num_hiden_layers=1"],
        r"did you mean (\w+)\?",
        lambda m, argv, ctx: setting("--config_overrides", f"{m[1]}=1")(argv),
        before=lambda ctx: ctx.paths.update(model=str(ctx.lm["model"])),
    ),
    Case(
        "a damaged model folder",
        "lm_finetune",
        ["--model_name_or_path", "{broken_model}"],
        r"; pass the folder that save_pretrained wrote$",
        lambda m, argv, ctx: setting("--model_name_or_path", ctx.paths["model"])(argv),  # the model's own
        before=broken_model_config,
    ),
    Case(
        "a data file that is a folder",
        "lm_finetune",
        ["--train_file", "{data}", "--validation_file", None],
        r"or the folder as (--dataset_name) (\S+)$",
        lambda m, argv, ctx: setting(m[1], m[2])(dropping("--train_file")(argv)),
        before=lambda ctx: ctx.paths.update(data=str(Path(ctx.lm["train"]).parent)),
    ),
    Case(
        "a `--train_file` or `--validation_file` that is not there",
        "lm_finetune",
        ["--train_file", "{typo}"],
        r"(--train_file) (\S+): no such file or directory; check the path",
        lambda m, argv, ctx: setting(m[1], m[2].replace("trian", "train"))(argv),
        before=lambda ctx: ctx.paths.update(typo=str(ctx.lm["train"]).replace("train", "trian")),
    ),
    Case(
        "a `--dataset_name` folder that does not exist",
        "lm_finetune",
        ["--train_file", None, "--validation_file", None, "--dataset_name", "{typo}"],
        r"(--dataset_name) (\S+): no such file or directory; check the path",
        lambda m, argv, ctx: setting(m[1], str(Path(ctx.lm["train"]).parent))(argv),  # the folder meant
        before=lambda ctx: ctx.paths.update(typo=str(Path(ctx.lm["train"]).parent) + "-typo"),
    ),
    Case(
        "rows without text",
        "lm_finetune",
        ["--train_file", "{rows}"],
        r"--train_file (\S+): a row's text is None .*; remove or fill such rows",
        lambda m, argv, ctx: (without_rows(m[1], lambda row: row["text"] is None), argv)[1],
        before=with_rows("rows", "train", {"text": None}),
    ),
    Case(
        "malformed chat rows",
        "lm_finetune",
        ["--train_file", "{chats}", "--validation_file", None, "--data_format", "chat"],
        r"--train_file (\S+): message \d+ has no role: \{'content': '(.*)'\}; fix or remove that row",
        lambda m, argv, ctx: (without_rows(m[1], lambda row: {"content": m[2]} in row["messages"]), argv)[1],
        before=with_rows("chats", "chat", {"messages": [{"content": "no role"}]}),
    ),
]


def a_config(**values):
    """A config file of the user's, {config}: one CPU process, with `values`."""

    def before(ctx):
        lines = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 1}
        lines |= {"use_cpu": "true", **values}
        (ctx.tmp / "my_config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
        ctx.paths["config"] = str(ctx.tmp / "my_config.yaml")

    return before


def config_set(key, value):
    """Follows a fix that corrects a config file's `key`: the file rewritten with `value`."""

    def follow(m, argv, ctx):
        path = Path(ctx.paths["config"])
        path.write_text(re.sub(rf"(?m)^{key}: .*$", f"{key}: {value}", path.read_text()))
        return argv

    return follow


# launch.sh's own refusals (its options, the config), followed the same way: through launch.sh, one CPU process.
LAUNCH_CASES = [
    Case(
        "unknown config",
        "lm_finetune",
        ["--config", "x"],
        r"unknown config 'x' \(available: .*\b(cpu)\b.*, or the path of a YAML file\)",
        lambda m, argv, ctx: setting("--config", m[1])(argv),  # the one of the list that runs on this machine
    ),
    Case(
        "a bad `launch.sh` option",
        "lm_finetune",
        ["--num_processes", "0"],
        r"(--num_processes) must be a positive integer",
        lambda m, argv, ctx: setting(m[1], "1")(argv),
    ),
    Case(
        "a malformed accelerate config",
        "lm_finetune",
        ["--config", "{config}", "--num_processes", None],
        r": (num_processes) must be a whole number from (\d+), got 'two'",
        lambda m, argv, ctx: config_set(m[1], m[2])(m, argv, ctx),
        before=a_config(num_processes="two"),
    ),
    Case(
        "a config's value that accelerate launch",
        "lm_finetune",
        ["--config", "{config}", "--num_processes", None],
        r"Unknown (mixed_precision) mode: fp32. Choose between \['(\w+)'.*; correct the config",
        lambda m, argv, ctx: config_set(m[1], m[2])(m, argv, ctx),
        before=a_config(mixed_precision="fp32"),
    ),
]


def user_weights(ctx):
    """The file the fix names, written now: torchvision's ResNet-18 for these 10 classes."""
    import torchvision
    from safetensors.torch import save_file

    save_file(torchvision.models.resnet18(num_classes=10).state_dict(), ctx.paths["weights"])
    return ctx.paths["weights"]


DOCTOR_ROW = "a bad option of `./launch.sh doctor`"  # followed by the last test here


def test_every_row_of_the_table_is_followed_here_or_says_where():
    def key_of(row):
        keys = [c.row for c in CASES + LAUNCH_CASES] + [DOCTOR_ROW, *NOT_FOLLOWED_HERE]
        return [key for key in keys if row.startswith(key)]

    assert [row for row in TABLE if len(key_of(row)) != 1] == [], "a row no case follows, or more than one"
    assert all(any(row.startswith(key) for row in TABLE) for key in NOT_FOLLOWED_HERE), "a key names no row"


def command(case, ctx, launcher=()):
    """The base command (the data, the output folder, one step) with the case's options."""
    if launcher:
        argv = ["--num_processes", "1", *lm_args(ctx.lm, ctx.out, "--max_train_steps", "1")]
    elif case.recipe == "cifar":
        argv = digits_args(ctx.digits, ctx.out, "--max_train_steps", "1", "--per_device_train_batch_size", "16")
        argv += ["--hflip", "0"]
    else:
        argv = lm_args(ctx.lm, ctx.out, "--max_train_steps", "1")
    argv, bad = [str(a) for a in argv], [a if a is None else a.format_map(ctx.paths) for a in case.bad]
    i = 0
    while i < len(bad):
        option, value = bad[i], bad[i + 1] if i + 1 < len(bad) else "--"
        if value is not None and value.startswith("--"):  # a flag
            argv, i = [*argv, option], i + 1
        else:
            argv, i = dropping(option)(argv) if value is None else setting(option, value)(argv), i + 2
    return argv


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.row[:50])
def test_the_fix_the_error_line_names_followed_literally_lets_the_run_start(case, digits, tiny_lm, tmp_path):
    ctx = Context(out=tmp_path / "out", tmp=tmp_path, digits=digits, lm=tiny_lm)
    if case.before:
        case.before(ctx)
    argv, held, env = command(case, ctx), snapshot(tmp_path), user_env(**case.env(ctx))
    recipe = [BIN / "python", REPO / "recipes" / f"{case.recipe}.py"]
    proc = run(recipe + argv, env=env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert snapshot(tmp_path) == held, "the refused run changed what it was given"
    match = re.search(case.fix, line)
    assert match, f"the line does not say the fix {case.fix!r}: {line}"
    fixed = case.follow(match, argv, ctx)
    proc = run(recipe + fixed, env=env, check=False)
    assert proc.returncode == 0, f"{line}\nfollowed: {fixed}\n{proc.stderr[-3000:]}"
    assert results(given(fixed, "--output_dir"))["steps"] == int(given(fixed, "--max_train_steps"))


@pytest.mark.slow
@pytest.mark.parametrize("case", LAUNCH_CASES, ids=lambda c: c.row[:50])
def test_launch_sh_s_fixes_followed_literally_let_the_run_start(case, tiny_lm, tmp_path):
    ctx = Context(out=tmp_path / "out", tmp=tmp_path, digits=None, lm=tiny_lm)
    if case.before:
        case.before(ctx)
    argv, launch = command(case, ctx, launcher=True), [REPO / "launch.sh", case.recipe]
    proc = run(launch + argv, check=False)
    assert proc.returncode == 2 and not ctx.out.exists(), proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if "error:" in line]
    match = re.search(case.fix, line)
    assert match, f"the line does not say the fix {case.fix!r}: {line}"
    fixed = case.follow(match, argv, ctx)
    proc = run(launch + fixed, check=False)
    assert proc.returncode == 0, f"{line}\nfollowed: {fixed}\n{proc.stderr[-3000:]}"
    assert results(ctx.out)["steps"] == 1


@pytest.mark.slow
def test_the_doctors_fix_followed_literally_lets_it_run():
    """The doctor takes its options through the recipes' parser: a bad one is one line whose fix, followed, runs it."""
    doctor = [REPO / "launch.sh", "doctor", "--num_processes", "2"]
    proc = run([*doctor, "--timeout", "nan"], check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    (line,) = error_lines(proc.stderr)
    match = re.search(
        r"argument (--timeout): nan is not a finite number; pass a number greater than (\d+) and at most", line
    )
    assert match, line
    proc = run([*doctor, match[1], str(int(match[2]) + 60)])  # a minute more than the least it takes
    assert "sums correct on all 2 processes" in proc.stdout, proc.stdout
