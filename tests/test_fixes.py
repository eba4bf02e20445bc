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
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    NO_NETWORK,
    REPO,
    cpu_env,
    digits_args,
    error_lines,
    lm_args,
    read_only,
    results,
    run,
    snapshot,
    user_env,
)
from PIL import Image

TABLE = [
    row.split("|")[1].strip()
    for row in (REPO / "docs" / "errors.md").read_text().splitlines()
    if row.startswith("| ") and not row.startswith("| input |")
]
# Rows whose fix cannot be followed in a one-process CPU run here, and where each is tested instead.
NOT_FOLLOWED_HERE = {
    "missing data, a damaged local CIFAR copy": "CIFAR's download needs the network",
    "more processes than GPUs": "needs GPUs",
    "GPUs nvidia-smi lists but this torch cannot use": "needs GPUs",
    "a recipe started as N copies by `srun`": "needs srun: tests/test_slurm.py",
    "an HSDP or tensor-parallel mesh": "followed in tests/test_hsdp.py (4 processes)",
    "under `tp.yaml`": "followed in tests/test_tp.py (4 then 2 processes); the other refusals in-process there",
    "a process count `./launch.sh --config hsdp`": "followed in tests/test_hsdp.py (launch.sh --dry_run)",
}


@dataclass
class Context:
    """A case's folder and inputs: `paths` names what its arguments may hold as {name} (filled in by `before`)."""

    out: Path
    tmp: Path
    digits: dict
    lm: dict
    paths: dict = field(default_factory=dict)
    holder: subprocess.Popen = None  # another run, started by `before`
    two_steps: Path = None  # the module's 2-step lm_finetune run (two_step_run), which a case copies, never changes


@dataclass
class Case:
    row: str  # the start of the table row's input column
    recipe: str
    bad: list  # options of the base command: a value replaces the base's, None drops the option, a flag is added
    fix: str  # a regular expression for the fix in the error line; `follow` gets its match
    follow: Callable  # (match, argv, context) -> the argv the fix asks for, having done what else it asks
    before: Callable = None  # (context) -> None: the folder, data or checkpoint the mistake needs
    env: Callable = lambda ctx: {}  # (context) -> the variables the runs have beside the user's
    secret: str = None  # a value given that neither run may print or write anywhere
    prefix: Callable = lambda ctx: []  # (context) -> what the runs are started under (a mount namespace)


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


@pytest.fixture(scope="module")
def two_step_run(tiny_lm, tmp_path_factory):
    """One lm_finetune run of 2 steps, a checkpoint at each, that the cases needing a run's folder copy: the same
    files their own run would have written (a run's files name no folder a check reads), trained once."""
    folder = tmp_path_factory.mktemp("two_steps") / "run"
    lm_run(folder, tiny_lm, 2)
    return folder


def finished_run(ctx):
    shutil.copytree(ctx.two_steps, ctx.out)


def interrupted_run(ctx):
    """A run killed after its checkpoint of step 2, before its final save: its checkpoints and nothing else."""
    finished_run(ctx)
    for path in ctx.out.iterdir():
        if not path.name.startswith("checkpoint-"):
            path.unlink()


def another_folders_run(ctx):
    shutil.copytree(ctx.two_steps, ctx.tmp / "other")
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


def an_encoder(ctx):
    """A tiny BERT (built from a config, saved with the tiny LM's tokenizer) as {encoder}; {model}: the causal LM."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(ctx.lm["model"])
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertForMaskedLM(config).save_pretrained(ctx.tmp / "bert")
    tokenizer.save_pretrained(ctx.tmp / "bert")
    ctx.paths |= {"encoder": str(ctx.tmp / "bert"), "model": str(ctx.lm["model"])}


def another_run_writing(ctx):
    """A run of 2 steps into the folder, frozen (SIGSTOP) once its first checkpoint is saved: it holds the folder."""
    cmd = [BIN / "python", REPO / "recipes/lm_finetune.py",
           *lm_args(ctx.lm, ctx.out, "--max_train_steps", "2", "--checkpointing_steps", "1")]  # fmt: skip
    ctx.holder = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=user_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (ctx.out / "checkpoint-1" / "trainer_state.json").exists():  # written last: the checkpoint is whole
        assert ctx.holder.poll() is None and time.monotonic() < deadline, "the other run did not reach checkpoint-1"
        time.sleep(0.05)
    ctx.holder.send_signal(signal.SIGSTOP)


def waiting_for_it_to_end(m, argv, ctx):
    assert int(m[1]) == ctx.holder.pid, m[0]  # the line names the run that holds the folder
    ctx.holder.send_signal(signal.SIGCONT)
    assert ctx.holder.wait(timeout=300) == 0, "the other run failed"
    return argv


def with_help_read(m, argv, ctx):
    """Follows "--help lists every option": the help read, the option not among them, so dropped."""
    shown = run([BIN / "python", REPO / "recipes" / m[2], "--help"]).stdout
    assert re.search(r"^  --\w", shown, re.M) and not re.search(rf"^  {m[1]}\b", shown, re.M), shown
    return dropping(m[1])(argv)


TOKEN = "hf_" + "Xy7Kq2" * 6  # a token's form: masked wherever it appears, whatever the option


CASES = [
    Case(
        "unknown argument",
        "lm_finetune",
        ["--per_device_batch_size", "8"],
        r"did you mean (--\w+) or (--\w+)\?",  # the eval batch or the train batch: the second is this one
        lambda m, argv, ctx: setting(m[2], "8")(dropping("--per_device_batch_size")(argv)),
    ),
    Case(
        "a credential in a mistyped argument",
        "lm_finetune",
        ["--hub_token", TOKEN],  # an option of other trainers' scripts, not of these recipes
        r"unrecognized arguments: (--hub_token) \*\*\*; (lm_finetune\.py) --help lists every option$",
        with_help_read,
        secret=TOKEN,
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
        "an encoder (BERT and kin)",
        "lm_finetune",
        ["--model_name_or_path", "{encoder}"],
        r"--model_name_or_path \S+: BertLMHeadModel lets each position see .*; pass a decoder model \(GPT-2, Llama",
        lambda m, argv, ctx: setting("--model_name_or_path", ctx.paths["model"])(argv),  # the tiny Llama
        before=an_encoder,
    ),
    Case(
        "a file or folder the system refuses",  # here a read-only filesystem where the data would be prepared
        "lm_finetune",
        ["--prepared_data_dir", "{read_only}/prep"],
        r"\(kept beside (--prepared_data_dir) \S+ while it is written\): read-only file system; .*use a path on a "
        "writable one",
        lambda m, argv, ctx: setting(m[1], str(ctx.tmp / "writable" / "prep"))(argv),
        before=lambda ctx: (ctx.tmp / "ro").mkdir() or ctx.paths.update(read_only=ctx.tmp / "ro"),
        prefix=lambda ctx: read_only(ctx.tmp / "ro"),
    ),
    Case(
        "an unwritable `--output_dir`",
        "lm_finetune",
        [],
        r"cannot write to (--output_dir) \S+ \(.*\); pass a folder this job can write to",
        lambda m, argv, ctx: setting(m[1], str(ctx.tmp / "another"))(argv),
        before=lambda ctx: ctx.out.mkdir(),
        prefix=lambda ctx: read_only(ctx.out),  # as root, which runs the suite, a chmod would not stop a write
    ),
    Case(
        "an `--output_dir` another run is writing",
        "lm_finetune",
        ["--overwrite_output_dir"],  # to start over there
        r"is in use by another run \(pid (\d+) .*\); wait for it to end, or pass another --output_dir$",
        waiting_for_it_to_end,
        before=another_run_writing,
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
    """A config file of the user's, {config}: one CPU process, with `values` (beside those another case of the same
    command put there)."""

    def before(ctx):
        path = ctx.tmp / "my_config.yaml"
        lines = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 1}
        if path.exists():
            lines |= dict(line.split(": ", 1) for line in path.read_text().splitlines())
        lines |= {"use_cpu": "true", **values}
        path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
        ctx.paths["config"] = str(path)

    return before


def config_set(key, value):
    """Follows a fix that corrects a config file's `key`: the file rewritten with `value`."""

    def follow(m, argv, ctx):
        path = Path(ctx.paths["config"])
        path.write_text(re.sub(rf"(?m)^{key}: .*$", f"{key}: {value}", path.read_text()))
        return argv

    return follow


def deepspeed_hidden(ctx):
    """DeepSpeed not importable in any process of the runs: a sitecustomize.py on their PYTHONPATH blocks it (what a
    machine without it installed is to Python), in {hide}."""
    (ctx.tmp / "hide").mkdir()
    (ctx.tmp / "hide" / "sitecustomize.py").write_text(
        "import sys\n\nsys.modules['deepspeed'] = None  # not installed\n"
    )


def hiding(ctx):
    return {"PYTHONPATH": os.pathsep.join([str(ctx.tmp / "hide"), *filter(None, [os.environ.get("PYTHONPATH")])])}


def installed(m, argv, ctx):
    """Follows `pip install ...[deepspeed]` by removing the block: the installed DeepSpeed becomes importable."""
    assert m[1] == "pip install -e '.[deepspeed]'", m[1]
    (ctx.tmp / "hide" / "sitecustomize.py").unlink()
    return argv


# launch.sh's own refusals (its options, the config), followed the same way: through launch.sh, one CPU process.
LAUNCH_CASES = [
    Case(
        "a DeepSpeed config where DeepSpeed is not installed",
        "lm_finetune",
        ["--config", "zero2"],
        r"zero2\.yaml runs DeepSpeed, which is not installed here: (pip install -e '\.\[deepspeed\]'), or pass",
        installed,
        before=deepspeed_hidden,
        env=hiding,
    ),
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
        r"^launch\.sh: error: \S+my_config\.yaml: accelerate launch refuses it: Unknown (mixed_precision) mode: "
        r"fp32\. Choose between \['(\w+)'.*; correct the config",
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


DOCTOR_ROW = "a bad option of `./launch.sh doctor`"  # followed by the doctor's test here
FULL_DISK_ROW = "a full disk"  # followed by the test of a full disk here
# Rows followed by the tests of launches of several processes, at the end of this file.
LAUNCHES_ROWS = [
    "a DeepSpeed file whose batch",
    "a ZeRO-3 config that cannot save",
    "a checkpoint of another distributed strategy",
    "an accelerate config that starts fewer processes",
    "`accelerate launch --num_processes 2` that starts one process",
    "processes that did not form one group",
]


def test_every_row_of_the_table_is_followed_here_or_says_where():
    def key_of(row):
        keys = [c.row for c in CASES + LAUNCH_CASES] + [DOCTOR_ROW, FULL_DISK_ROW, *LAUNCHES_ROWS, *NOT_FOLLOWED_HERE]
        return [key for key in keys if row.startswith(key)]

    assert [row for row in TABLE if len(key_of(row)) != 1] == [], "a row no case follows, or more than one"
    assert all(any(row.startswith(key) for row in TABLE) for key in NOT_FOLLOWED_HERE), "a key names no row"


def command(case, ctx):
    """The base command (the data, the output folder, one step) with the case's options."""
    if case.recipe == "cifar":
        argv = digits_args(ctx.digits, ctx.out, "--max_train_steps", "1", "--per_device_train_batch_size", "16")
        argv += ["--hflip", "0"]
    else:
        argv = lm_args(ctx.lm, ctx.out, "--max_train_steps", "1")
    return apply([str(a) for a in argv], [a if a is None else a.format_map(ctx.paths) for a in case.bad])


def apply(argv, bad):
    """`argv` with a case's options: a value replaces the one given, None drops the option, a flag is added."""
    i = 0
    while i < len(bad):
        option, value = bad[i], bad[i + 1] if i + 1 < len(bad) else "--"
        if value is not None and value.startswith("--"):  # a flag
            argv, i = [*argv, option], i + 1
        else:
            argv, i = dropping(option)(argv) if value is None else setting(option, value)(argv), i + 2
    return argv


# Cases whose mistakes do not meet (each its own option), made in one command: one run, which trains once every fix
# is followed, serves them all; each refused in turn in one line, its fix followed literally. The others alone.
CHAINED = [
    [
        "unknown argument",
        "a number out of range or not a number",
        "training that would be empty",
        "`--checkpointing_steps 0`",
        "a schedule the recipe cannot drive",
        "an attention implementation that is unknown or not installed",
        "a LoRA rank above the rank of a layer it adapts",
    ],
    ["a batch larger than the dataset", "LoRA target modules the model does not have"],
    ["more accumulation steps than batches", "an option that would do nothing with the others given"],
    ["arguments that contradict each other", "images too small for the model"],
]
COMMANDS = CHAINED + [[c.row] for c in CASES if not any(c.row in rows for rows in CHAINED)]


def test_every_case_is_in_one_command():
    rows = [row for rows in COMMANDS for row in rows]
    assert sorted(rows) == sorted(c.row for c in CASES)


@pytest.mark.slow
@pytest.mark.parametrize("rows", COMMANDS, ids=lambda rows: " + ".join(row[: 50 // len(rows)] for row in rows))
def test_the_fix_the_error_line_names_followed_literally_lets_the_run_start(
    rows, digits, tiny_lm, tmp_path, two_step_run
):
    """The command with its cases' mistakes: refused in one line naming one case's fix, nothing it was given changed;
    that fix followed, the next refusal is another case's, until the run trains its steps; each case met once."""
    ctx = Context(out=tmp_path / "out", tmp=tmp_path, digits=digits, lm=tiny_lm, two_steps=two_step_run)
    cases = [c for row in rows for c in CASES if c.row == row]
    runs = []
    try:
        for case in cases:
            if case.before:
                case.before(ctx)
        argv = command(cases[0], ctx)
        for case in cases[1:]:
            argv = apply(argv, [a if a is None else a.format_map(ctx.paths) for a in case.bad])
        env = user_env(**{k: v for case in cases for k, v in case.env(ctx).items()})
        recipe = [*cases[0].prefix(ctx), BIN / "python", REPO / "recipes" / f"{cases[0].recipe}.py"]
        left, said = list(cases), []
        while left:
            held = snapshot(tmp_path)
            refused = run(recipe + argv, env=env, check=False)
            runs.append(refused)
            assert refused.returncode == 2, refused.stderr[-3000:]
            (line,) = error_lines(refused.stderr)
            assert snapshot(tmp_path) == held, "the refused run changed what it was given"
            met = [(c, m) for c in left if (m := re.search(c.fix, line))]
            assert len(met) == 1, f"the line says none of the fixes {[c.fix for c in left]}, or several: {line}"
            ((case, match),) = met
            left.remove(case)
            said.append(line)
            argv = case.follow(match, argv, ctx)
        proc = run(recipe + argv, env=env, check=False)
        runs.append(proc)
        assert proc.returncode == 0, f"{said}\nfollowed: {argv}\n{proc.stderr[-3000:]}"
        assert results(given(argv, "--output_dir"))["steps"] == int(given(argv, "--max_train_steps"))
    finally:
        if ctx.holder and ctx.holder.poll() is None:
            os.killpg(ctx.holder.pid, signal.SIGKILL)
            ctx.holder.wait()
    for secret in [case.secret for case in cases if case.secret]:  # in no run's output, nor in any file of the folder
        assert all(secret not in p.stdout + p.stderr for p in runs)
        assert not [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


# launch.sh's cases made in one command where they do not meet (each its own option, or its own key of the config),
# so that one run, which trains once every fix is followed, serves them all: each refused in turn, in one line.
LAUNCH_COMMANDS = [
    ["a DeepSpeed config where DeepSpeed is not installed", "a bad `launch.sh` option"],
    ["a malformed accelerate config", "a config's value that accelerate launch"],
    ["unknown config"],
]


def test_every_launch_case_is_in_one_command():
    rows = [row for rows in LAUNCH_COMMANDS for row in rows]
    assert sorted(rows) == sorted(c.row for c in LAUNCH_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("rows", LAUNCH_COMMANDS, ids=lambda rows: " + ".join(row[:24] for row in rows))
def test_launch_sh_s_fixes_followed_literally_let_the_run_start(rows, tiny_lm, tmp_path):
    """The command with every case's mistake: refused in one line naming one case's fix, which followed, the next
    refusal is another case's, until the run starts; each case met once."""
    ctx = Context(out=tmp_path / "out", tmp=tmp_path, digits=None, lm=tiny_lm)
    cases = [c for row in rows for c in LAUNCH_CASES if c.row == row]
    argv, env = [str(a) for a in ["--num_processes", "1", *lm_args(ctx.lm, ctx.out, "--max_train_steps", "1")]], {}
    for case in cases:
        if case.before:
            case.before(ctx)
        argv = apply(argv, [a if a is None else a.format_map(ctx.paths) for a in case.bad])
        env |= case.env(ctx)
    launch, env, left, said = [REPO / "launch.sh", cases[0].recipe], user_env(**env), list(cases), []
    while left:
        proc = run(launch + argv, env=env, check=False)
        assert proc.returncode == 2 and not ctx.out.exists(), proc.stderr[-3000:]
        (line,) = [line for line in proc.stderr.splitlines() if "error:" in line]
        met = [(c, m) for c in left if (m := re.search(c.fix, line))]
        assert len(met) == 1, f"the line says none of the fixes {[c.fix for c in left]}, or several: {line}"
        (case, match) = met[0]
        left.remove(case)
        said.append(line)
        argv = case.follow(match, argv, ctx)
    proc = run(launch + argv, env=env, check=False)
    assert proc.returncode == 0, f"{said}\nfollowed: {argv}\n{proc.stderr[-3000:]}"
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


@pytest.mark.slow
def test_a_full_disks_fix_followed_lets_the_run_train(tiny_lm, tmp_path, two_step_run):
    """A filesystem (a tmpfs mounted here: root runs the suite) that holds the run's first checkpoint and not its
    second: the run stops at that save with one line and keeps the first intact, and its fix, followed, trains."""
    from common.checkpoint import checkpoint_damage, complete_checkpoints

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    # the size of one checkpoint of this model, with the arguments below (but the length, a digit of its record)
    size = sum(p.stat().st_size for p in (two_step_run / "checkpoint-1").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(1.6 * size)}", "tmpfs", disk],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out, recipe = disk / "run", [BIN / "python", REPO / "recipes/lm_finetune.py"]
        argv = [str(a) for a in lm_args(tiny_lm, out, "--max_train_steps", "3", "--checkpointing_steps", "1")]
        proc = run(recipe + argv, check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = error_lines(proc.stderr)
        match = re.search(
            rf"no space left on the filesystem of {out} to save the checkpoint {out}/checkpoint-2: it needs about .*; "
            r"free space there or pass another (--output_dir) \(the checkpoints already saved are intact\)$",
            line,
        )
        assert match, line
        assert complete_checkpoints(out) == [out / "checkpoint-1"] and checkpoint_damage(out / "checkpoint-1") is None
        assert not list(out.glob("*checkpoint-2*")), "a half-written checkpoint is left"
        fixed = setting(match[1], str(tmp_path / "another"))(argv)
        proc = run(recipe + fixed, check=False)
        assert proc.returncode == 0, f"{line}\nfollowed: {fixed}\n{proc.stderr[-3000:]}"
        assert results(tmp_path / "another")["steps"] == 3
    finally:
        subprocess.run(["umount", "-l", disk], check=True)


# ---------------------------------------------------------------- launches of several processes
# The rows whose mistake is in how the processes are started: made the way users launch (./launch.sh, accelerate
# launch), in 2 CPU processes. A fix followed may meet the next row's refusal: one command is followed through both,
# so that a launch that trains serves several rows.


def refused(cmd, env, fix, folder):
    """`cmd` refused in one `error:` line that says `fix` (a regular expression), `folder` as it was: the match."""
    held = snapshot(folder)
    proc = run(cmd, env=env, check=False)
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert snapshot(folder) == held, "the refused run changed what it was given"
    match = re.search(fix, lines[0])
    assert match, f"the line does not say the fix {fix!r}: {lines[0]}"
    return match


def set_in_yaml(path, key, value, under=None):
    """Follows a fix that sets a config file's `key`: where it is, else added (to the block `under`, or at the top)."""
    text = Path(path).read_text()
    if re.search(rf"(?m)^ *{key}: .*$", text):
        text = re.sub(rf"(?m)^( *){key}: .*$", rf"\g<1>{key}: {value}", text)
    elif under:
        text = re.sub(rf"(?m)^{under}:\n", f"{under}:\n  {key}: {value}\n", text)
    else:
        text += f"{key}: {value}\n"
    Path(path).write_text(text)


@pytest.mark.slow
def test_a_deepspeed_launchs_fixes_followed_train_and_its_checkpoint_under_ddp_is_refused_then_started_anew(
    tiny_lm, tmp_path
):
    """A ZeRO-3 config of the user's that clips at another norm than the recipe's flag and lacks the 16-bit gather:
    each refused, each fix followed, the launch trains in 2 DeepSpeed processes and writes a checkpoint. That
    checkpoint resumed by 2 DDP processes through a config as `accelerate config` writes it for CPUs: refused for
    the config, then for the checkpoint's strategy; followed, the run starts anew and trains."""
    env, zero, ddp = cpu_env(), tmp_path / "zero", tmp_path / "ddp"
    config = tmp_path / "my_zero3.yaml"  # zero3.yaml with its own clipping and without the gather
    config.write_text(
        (REPO / "accelerate_configs/zero3.yaml")
        .read_text()
        .replace("zero3_save_16bit_model: true", "gradient_clipping: 0.01")
    )
    launch = [REPO / "launch.sh", "lm_finetune", "--config", str(config)]
    argv = [str(a) for a in lm_args(tiny_lm, zero, "--max_train_steps", "1", "--checkpointing_steps", "1")]
    m = refused([*launch, *argv], env, r"or pass (--max_grad_norm) (\S+)$", tmp_path)
    argv = setting(m[1], m[2])(argv)
    m = refused(
        [*launch, *argv],
        env,
        r"only with (zero3_save_16bit_model): (true) in the accelerate config's (deepspeed_config) .*; set it\b",
        tmp_path,
    )
    set_in_yaml(config, m[1], m[2], under=m[3])
    run([*launch, *argv], env=env)
    res = results(zero)
    assert (res["steps"], res["world_size"], res["distributed_type"]) == (1, 2, "DEEPSPEED")
    assert res["args"]["max_grad_norm"] == 0.01

    config = tmp_path / "my_cpu.yaml"  # accelerate config's answers for 2 CPU processes
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\nnum_processes: 2\n"
        "mixed_precision: 'no'\nuse_cpu: true\n"
    )
    launch = [REPO / "launch.sh", "lm_finetune", "--config", str(config)]
    argv = [
        str(a)
        for a in lm_args(tiny_lm, ddp, "--max_train_steps", "2", "--resume_from_checkpoint", zero / "checkpoint-1")
    ]
    m = refused(
        [*launch, *argv],
        env,
        r"launch\.sh asked accelerate launch for 2 processes and it started 1; for CPU processes use "
        r"(distributed_type): (MULTI_GPU) with (use_cpu): (true) in the config",
        tmp_path,
    )
    set_in_yaml(config, m[1], m[2])
    set_in_yaml(config, m[3], m[4])
    m = refused(
        [*launch, *argv], env, r"this run is DDP, .*, or drop (--resume_from_checkpoint) to start a new run$", tmp_path
    )
    run([*launch, *dropping(m[1])(argv)], env=env)
    res = results(ddp)
    assert (res["steps"], res["world_size"]) == (2, 2) and "resume_from_checkpoint" not in res["args"], res


@pytest.mark.slow
def test_accelerate_launchs_refusals_of_processes_that_would_not_train_as_one_are_followed_to_one_run(
    tiny_lm, tmp_path
):
    """`accelerate launch --num_processes 2` starts one process on a host without GPUs; with --multi_gpu it starts
    two that form no group. Each fix, followed, gives the same command, which trains in 2 processes."""
    env, out = cpu_env(), tmp_path / "run"
    args = [REPO / "recipes/lm_finetune.py", *lm_args(tiny_lm, out, "--max_train_steps", "1")]
    accelerate = [ACCELERATE_LAUNCH, "--main_process_port", env["MASTER_PORT"], "--num_processes", "2"]
    m = refused([*accelerate, *args], env, r"pass (--multi_gpu) with (ACCELERATE_USE_CPU)=(true) exported", tmp_path)
    one = [*accelerate, m[1], *args], {**env, m[2]: m[3]}
    multi_gpu = [*accelerate, "--multi_gpu", *args]
    m = refused(
        multi_gpu,
        env,
        r"formed no group .*, or (export) (ACCELERATE_USE_CPU)=(true) before accelerate launch",
        tmp_path,
    )
    no_group = multi_gpu, {**env, m[2]: m[3]}
    assert [str(a) for a in one[0]] == [str(a) for a in no_group[0]] and one[1] == no_group[1]
    run(*one)
    assert results(out)["world_size"] == 2
