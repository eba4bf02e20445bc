"""Every fix the table of errors (docs/errors.md) shows, followed literally, lets the run start.

Each case makes a row's mistake, reads the fix out of the error line the recipe printed (not out of the table: what
a user follows is the line in front of them), applies it to the same command, and runs that: it must train its step
and exit 0. A row of the table that no case here follows is listed in NOT_FOLLOWED_HERE with the reason, and a
row that is in neither fails the test, so a new row of the table comes with its case.

One-process runs of a recipe are forked from a process with the libraries imported (tests/warm.py): a case costs
its two runs' own work, about a second for a refusal and a few for a step of the tiny models.
"""

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from conftest import BIN, REPO, digits_args, error_lines, lm_args, results, run, snapshot

TABLE = [
    row.split("|")[1].strip()
    for row in (REPO / "docs" / "errors.md").read_text().splitlines()
    if row.startswith("| ") and not row.startswith("| input |")
]
# Rows whose fix cannot be followed in a one-process CPU run here, and where each is followed instead.
NOT_FOLLOWED_HERE = {
    "unknown config": "launch.sh's own options: tests/test_launch_sh.py",
    "a config's value that accelerate launch": "a config file's value: tests/test_launch_sh.py",
    "a bad `launch.sh` option": "launch.sh's own options: tests/test_launch_sh.py",
    "a bad option of `./launch.sh doctor`": "the doctor's and the selftest's options: tests/test_doctor.py",
    "a DeepSpeed config where DeepSpeed is not installed": "needs an environment without DeepSpeed",
    "a malformed accelerate config": "a config file's value: tests/test_launch_sh.py",
    "missing data, a damaged local CIFAR copy": "CIFAR's download needs the network",
    "a file or folder the system refuses": "permissions do not bind root, which runs the suite; tests/test_rules.py",
    "an unreadable image in an ImageFolder": "the fix removes a file of the user's data: tests/test_inputs.py",
    "a checkpoint of another recipe": "tests/test_rules.py (another --output_dir)",
    "a checkpoint of another model": "tests/test_rules.py (another --output_dir)",
    "a checkpoint of another distributed strategy": "needs DeepSpeed in two processes: tests/test_zero.py",
    "an `--output_dir` another run is writing": "needs a second run alive: tests/test_rules.py",
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
    "a loss or weights that become NaN": "the fix names four remedies, which one mends a run depends on its data",
    "pretrained weights that are not cached": "the fix downloads where there is network",
    "an `--image_size` so large": "the line names the machine's memory; any smaller size is its fix",
    "a damaged model folder": "the fix restores files of the user's model",
    "an encoder (BERT and kin)": "the fix is another model",
    "an image too large to decode": "the fix shrinks a file of the user's data",
    "an ImageFolder that reaches a folder twice": "the fix removes a link in the user's data",
    "a class folder in `--val_dir`": "the fix changes the user's folders",
    "rows without text": "the fix edits the user's data",
    "malformed chat rows": "the fix edits the user's data",
    "a damaged checkpoint": "the fix is another checkpoint: tests/test_checkpoints.py",
    "a `--dataset_name` folder": "the fix is the user's data",
    "an empty dataset": "the fix is the user's images",
    "a credential in a mistyped argument": "as an unknown argument, which a case follows",
}


@dataclass
class Case:
    row: str  # the start of the table row's input column
    recipe: str
    bad: list  # the recipe's arguments beside the base ones (the data, the output folder, one step)
    fix: str  # a regular expression for the fix in the error line; its groups are what `follow` uses
    follow: Callable  # (match, argv) -> the argv the fix asks for
    before: Callable = None  # (output_dir, digits, lm) -> None: what the folder holds before the bad run


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


def adding(*args):
    return lambda argv: [*argv, *args]


def earlier_run(steps, *extra):
    """An --output_dir holding an lm_finetune run of `steps` steps that saved a checkpoint at each."""

    def before(output_dir, digits, lm):
        run(
            [BIN / "python", REPO / "recipes/lm_finetune.py"]
            + lm_args(lm, output_dir, "--max_train_steps", str(steps), "--checkpointing_steps", "1", *extra)
        )

    return before


def interrupted_run(steps):
    """An --output_dir holding a run cut short after its checkpoint of step `steps` (killed before its final save)."""

    def before(output_dir, digits, lm):
        earlier_run(steps)(output_dir, digits, lm)
        for path in output_dir.iterdir():
            if not path.name.startswith("checkpoint-"):
                path.unlink()

    return before


def foreign_files(output_dir, digits, lm):
    output_dir.mkdir(parents=True)
    shutil.copytree(lm["model"], output_dir, dirs_exist_ok=True)  # the pretrained model's own folder


CASES = [
    Case(
        "unknown argument",
        "lm_finetune",
        ["--per_device_batch_size", "8"],
        r"did you mean (--\w+) or (--\w+)\?",  # the eval batch or the train batch: the second is this one
        lambda m, argv: setting(m[2], "8")(dropping("--per_device_batch_size")(argv)),
    ),
    Case(
        "a batch larger than the dataset",
        "lm_finetune",
        ["--per_device_train_batch_size", "4096"],
        r"holds (\d+) samples: .*; lower --per_device_train_batch_size, or use more data",
        lambda m, argv: setting("--per_device_train_batch_size", m[1])(argv),  # lowered to what the set holds
    ),
    Case(
        "more accumulation steps than batches",
        "lm_finetune",
        ["--gradient_accumulation_steps", "500"],
        r"lower --gradient_accumulation_steps to (\d+) or less",
        lambda m, argv: setting("--gradient_accumulation_steps", m[1])(argv),
    ),
    Case(
        "an `--output_dir` holding what no run wrote",
        "lm_finetune",
        [],
        r"or pass another (--output_dir)",
        lambda m, argv: setting(m[1], argv[argv.index("--output_dir") + 1] + "-another")(argv),
        before=foreign_files,
    ),
    Case(
        "a checkpoint past the length asked",
        "lm_finetune",
        ["--resume_from_checkpoint", "OTHER/checkpoint-2", "--max_train_steps", "1"],
        r"pass (--max_train_steps) (\d+) or more",
        lambda m, argv: setting(m[1], m[2])(argv),
    ),
    Case(
        "a checkpoint resumed with another `--seed`",
        "lm_finetune",
        ["--resume_from_checkpoint", "OTHER/checkpoint-2", "--seed", "7", "--max_train_steps", "3"],
        r"resume with (--seed) (\d+)$",
        lambda m, argv: setting(m[1], m[2])(argv),
    ),
    Case(
        "`--overwrite_output_dir` with `--resume_from_checkpoint latest`",
        "lm_finetune",
        ["--overwrite_output_dir", "--resume_from_checkpoint", "latest", "--max_train_steps", "3"],
        r"pass one of them",
        lambda m, argv: dropping("--overwrite_output_dir")(argv),
        before=interrupted_run(2),
    ),
    Case(
        "an `--output_dir` holding a run that did not finish",
        "lm_finetune",
        ["--max_train_steps", "3"],
        r"pass (--resume_from_checkpoint) (latest) to continue it",
        lambda m, argv: setting(m[1], m[2])(argv),
        before=interrupted_run(2),
    ),
    Case(
        "an `--output_dir` holding a finished run, no resume flag",
        "lm_finetune",
        ["--max_train_steps", "3"],  # one more step than it trained
        r"which finished; pass (--resume_from_checkpoint) (\S+) with a larger --max_train_steps",
        lambda m, argv: setting(m[1], m[2])(argv),
        before=earlier_run(2),
    ),
    Case(
        "another folder's checkpoint, into an `--output_dir` holding a run",
        "lm_finetune",
        ["--max_train_steps", "3", "--resume_from_checkpoint", "OTHER/checkpoint-2"],
        r"pass (--overwrite_output_dir) to start over there from it",
        lambda m, argv: adding(m[1])(argv),
        before=earlier_run(2),
    ),
    Case(
        "a number out of range or not a number",
        "lm_finetune",
        ["--learning_rate", "nan"],
        r"pass a number greater than (\d+)",
        lambda m, argv: setting("--learning_rate", str(int(m[1]) + 1e-3))(argv),
    ),
    Case(
        "training that would be empty",
        "lm_finetune",
        ["--num_train_epochs", "0"],
        r"pass a whole number at least (\d+)",
        lambda m, argv: setting("--num_train_epochs", m[1])(argv),
    ),
    Case(
        "`--checkpointing_steps 0`",
        "lm_finetune",
        ["--checkpointing_steps", "0"],
        r"to save no checkpoints, omit the option",
        lambda m, argv: dropping("--checkpointing_steps")(argv),
    ),
    Case(
        "a schedule the recipe cannot drive",
        "lm_finetune",
        ["--lr_scheduler_type", "reduce_lr_on_plateau"],
        r"\(choose from '(\w+)'",
        lambda m, argv: setting("--lr_scheduler_type", m[1])(argv),
    ),
    Case(
        "arguments that contradict each other",
        "cifar",
        ["--momentum", "0", "--nesterov"],
        r"pass (--no-nesterov) for plain SGD",
        lambda m, argv: adding(m[1])(argv),
    ),
    Case(
        "fine-tuning options without weights to fine-tune",
        "cifar",
        ["--model", "resnet18", "--freeze_backbone"],
        r"add --pretrained or (--pretrained_path)",
        lambda m, argv: setting(m[1], "PRETRAINED")(argv),
    ),
    Case(
        "images too small for the model",
        "cifar",
        ["--model", "resnet18", "--image_size", "8"],
        r"pass (--image_size) (\d+)",
        lambda m, argv: setting(m[1], m[2])(argv),
    ),
    Case(
        "a LoRA rank above the rank of a layer it adapts",
        "lm_finetune",
        ["--lora_r", "64"],
        r"pass (--lora_r) (\d+) or less",
        lambda m, argv: setting(m[1], m[2])(argv),
    ),
    Case(
        "an option that would do nothing with the others given",
        "lm_finetune",
        ["--lora_alpha", "16"],
        r"(--lora_alpha) would do nothing without --lora_r .*: drop it",
        lambda m, argv: dropping(m[1])(argv),
    ),
    Case(
        "LoRA target modules the model does not have",
        "lm_finetune",
        ["--lora_r", "4", "--lora_target_modules", "qproj"],
        r"or pass (all-linear)$",
        lambda m, argv: setting("--lora_target_modules", m[1])(argv),
    ),
    Case(
        "an attention implementation that is unknown or not installed",
        "lm_finetune",
        ["--attn_implementation", "flash_attention_2"],
        r"or leave the option out",
        lambda m, argv: dropping("--attn_implementation")(argv),
    ),
    Case(
        "a tokenizer larger than the model's vocabulary",
        "lm_finetune",
        ["--tokenizer_name", "LARGER_TOKENIZER"],
        r"pass (--resize_token_embeddings) to grow the embeddings",
        lambda m, argv: adding(m[1])(argv),
    ),
    Case(
        "config overrides the model rejects",
        "lm_finetune",
        ["--model_name_or_path", None, "--config_name", "MODEL", "--config_overrides", "num_hiden_layers=1"],
        r"did you mean (\w+)\?",
        lambda m, argv: setting("--config_overrides", f"{m[1]}=1")(argv),
    ),
    Case(
        "a data file that is a folder",
        "lm_finetune",
        ["--train_file", "DATA_FOLDER", "--validation_file", None],
        r"or the folder as (--dataset_name) (\S+)$",
        lambda m, argv: setting(m[1], m[2])(dropping("--train_file")(argv)),
    ),
    Case(
        "a `--train_file` or `--validation_file` that is not there",
        "lm_finetune",
        ["--train_file", "TYPO"],
        r"(--train_file) (\S+): no such file or directory; check the path",
        lambda m, argv: setting(m[1], m[2].replace("trian", "train"))(argv),
    ),
]


def rows_of(cases):
    return {next(row for row in TABLE if row.startswith(case.row)) for case in cases}


def test_every_row_of_the_table_is_followed_here_or_says_where():
    covered = rows_of(CASES) | {row for row in TABLE if any(row.startswith(key) for key in NOT_FOLLOWED_HERE)}
    assert [row for row in TABLE if row not in covered] == []
    assert all(any(row.startswith(key) for row in TABLE) for key in NOT_FOLLOWED_HERE), "a key names no row"


@pytest.fixture(scope="module")
def larger_tokenizer(tiny_lm, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("larger_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    tokenizer.add_tokens([f"new{i}" for i in range(8)])
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.row[:50])
def test_the_fix_the_error_line_names_followed_literally_lets_the_run_start(
    case, digits, tiny_lm, larger_tokenizer, tmp_path
):
    out = tmp_path / "out"
    names = {
        "OTHER": str(tmp_path / "other"),
        "PRETRAINED": str(tmp_path / "pretrained.safetensors"),
        "LARGER_TOKENIZER": str(larger_tokenizer),
        "MODEL": str(tiny_lm["model"]),
        "DATA_FOLDER": str(Path(tiny_lm["train"]).parent),
        "TYPO": str(tiny_lm["train"]).replace("train", "trian"),
    }
    bad = [names.get(a, a) if isinstance(a, str) else a for a in case.bad]
    if "OTHER/checkpoint-2" in case.bad:
        earlier_run(2)(tmp_path / "other", digits, tiny_lm)
        bad[bad.index("OTHER/checkpoint-2")] = str(tmp_path / "other" / "checkpoint-2")
    if case.recipe == "cifar":
        base = digits_args(
            digits, out, "--max_train_steps", "1", "--per_device_train_batch_size", "16", "--hflip", "0"
        )
    else:
        base = lm_args(tiny_lm, out, "--max_train_steps", "1")
    argv = apply_bad([str(a) for a in base], bad)
    if case.before:
        case.before(out, digits, tiny_lm)
    held = snapshot(out) if out.exists() else None
    recipe = [BIN / "python", REPO / "recipes" / f"{case.recipe}.py"]
    proc = run(recipe + argv, check=False)
    (line,) = error_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (snapshot(out) if out.exists() else None) == held, "the refused run changed its --output_dir"
    match = re.search(case.fix, line)
    assert match, f"the line does not say the fix {case.fix!r}: {line}"
    fixed = [names.get(a, a) for a in case.follow(match, argv)]
    if names["PRETRAINED"] in fixed:  # weights of the model asked for, as a file of the user's
        import torchvision
        from safetensors.torch import save_file

        save_file(torchvision.models.resnet18(num_classes=10).state_dict(), names["PRETRAINED"])
    proc = run(recipe + fixed, check=False)
    assert proc.returncode == 0, f"{line}\nfollowed: {fixed}\n{proc.stderr[-3000:]}"
    assert results(given(fixed, "--output_dir"))["steps"] == int(given(fixed, "--max_train_steps"))


def apply_bad(argv, bad):
    """The base command with the case's options: a value replaces the base's, None drops the option."""
    i = 0
    while i < len(bad):
        option = bad[i]
        value = bad[i + 1] if i + 1 < len(bad) and (bad[i + 1] is None or not str(bad[i + 1]).startswith("--")) else ""
        if value == "":
            argv = [*argv, option]
            i += 1
            continue
        argv = dropping(option)(argv) if value is None else setting(option, value)(argv)
        i += 2
    return argv


def given(argv, option):
    """The value of `option`'s last occurrence in `argv` (argparse keeps the last)."""
    return argv[len(argv) - argv[::-1].index(option)]
