"""Every refusal by one rule, in this process (nothing is launched): a bad input is a RecipeError, or parse_args'
exit 2, whose subject is an option of the recipe's parser, a path the case gave (or a word it gave, for an
unrecognized argument); it is said as one `error:` line that names it, exit code 2, and nothing in the case's folder
is written or deleted. The tables say which subject each bad input names; the wording of the lines users meet most is
pinned once, in golden_errors.json. Other tests read a refusal's fields (err.subject), not its text."""

import contextlib
import hashlib
import io
import json
import pickle
import re
import sys
from pathlib import Path

import pytest
from accelerate import PartialState
from conftest import REPO, error_lines
from test_inputs import BASE, FOLDER, RECIPES  # the recipes, the least argv each parser needs, an ImageFolder

import common
from common import loop, outputs, vision
from common.args import public_args
from common.checkpoint import HASH, STATE_FILE, resolve_checkpoint, write_json
from common.errors import DataError
from common.plan import plan_run
from common.runtime import RecipeError, exit_codes, os_error_refusal
from common.text import load_raw_datasets

FLAG = r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]"


def options_of(recipe: str) -> set:
    """The options recipes/<recipe>.py takes, as its --help lists them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        RECIPES[recipe].parse_args(["--help"])
    return set(re.findall(FLAG, out.getvalue()))


OPTIONS = {name: options_of(name) for name in RECIPES}


def contents(folder: Path) -> dict:
    """Every file under `folder` by its bytes' digest, every folder as such: a file written, removed or added, or a
    folder made or removed, changes it."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(folder.rglob("*"))
    }


# At parsing: (recipe, argv, the subject the refusal names); each shared option is refused alike by every recipe.
SHARED = [
    (["--learning_rate", "nan"], "--learning_rate"),
    (["--learning_rate", "inf"], "--learning_rate"),
    (["--learning_rate", "0"], "--learning_rate"),
    (["--learning_rate", "-0.1"], "--learning_rate"),
    (["--warmup_ratio", "1.5"], "--warmup_ratio"),
    (["--warmup_ratio", "-0.1"], "--warmup_ratio"),
    (["--warmup_ratio", "nan"], "--warmup_ratio"),
    (["--weight_decay", "-1"], "--weight_decay"),
    (["--max_grad_norm", "-1"], "--max_grad_norm"),
    (["--max_grad_norm", "nan"], "--max_grad_norm"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
    (["--per_device_train_batch_size", "2.5"], "--per_device_train_batch_size"),
    (["--per_device_eval_batch_size", "-1"], "--per_device_eval_batch_size"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
    (["--num_train_epochs", "0"], "--num_train_epochs"),
    (["--max_train_steps", "0"], "--max_train_steps"),
    (["--logging_steps", "0"], "--logging_steps"),
    (["--save_total_limit", "0"], "--save_total_limit"),
    (["--reference_batch_size", "0"], "--reference_batch_size"),
    (["--ddp_timeout", "0"], "--ddp_timeout"),
    (["--dataloader_num_workers", "-1"], "--dataloader_num_workers"),
    (["--warmup_steps", "-1"], "--warmup_steps"),
    (["--lr_scheduler_type", "constant", "--warmup_ratio", "0.1"], "--warmup_ratio"),
    (["--lr_scheduler_type", "inverse_sqrt", "--warmup_ratio", "0"], "--lr_scheduler_type"),
    (["--lr_scheduler_type", "inverse_sqrt", "--warmup_steps", "0"], "--lr_scheduler_type"),
    (["--hang_timeout", "-1"], "--hang_timeout"),
    (["--hang_timeout", "600"], "--hang_timeout"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--seed", "abc"], "--seed"),
    (["--checkpointing_steps", "0"], "--checkpointing_steps"),
    (["--checkpointing_steps", "often"], "--checkpointing_steps"),
    (["--lr_scheduler_type", "reduce_lr_on_plateau"], "--lr_scheduler_type"),
    (["--lr_scheduler_type", "cosine_with_min_lr"], "--lr_scheduler_type"),
    (["--lr_scheduler_type", "warmup_stable_decay"], "--lr_scheduler_type"),
    (["--lr_scaling", "cubic"], "--lr_scaling"),
    (["--report_to", "neptune"], "--report_to"),
    (["--output_dir", ""], "--output_dir"),
    (["--per_device_batch_size", "8"], "--per_device_batch_size"),  # unrecognized: the word given
]
RECIPE_ONLY = [
    ("cifar", ["--momentum", "1"], "--momentum"),
    ("cifar", ["--momentum", "-0.5"], "--momentum"),
    ("cifar", ["--label_smoothing", "1"], "--label_smoothing"),
    ("cifar", ["--label_smoothing", "nan"], "--label_smoothing"),
    ("cifar", ["--momentum", "0"], "--momentum"),  # with --nesterov, the default
    ("cifar", ["--dataset", "cifar1000"], "--dataset"),
    ("cifar", ["--dataset", "imagefolder", "--train_dir", "t"], "--dataset"),
    ("cifar", ["--train_dir", "t", "--val_dir", "v"], "--train_dir"),
    # options given that would do nothing with the others: refused, named, whatever their value
    ("cifar", ["--optimizer", "adamw", "--momentum", "0.5"], "--momentum"),
    ("cifar", ["--optimizer", "adamw", "--no-nesterov"], "--no-nesterov"),
    ("cifar", [*FOLDER, "--data_dir", "d"], "--data_dir"),
    ("cifar", ["--lr_scaling", "none", "--reference_batch_size=7"], "--reference_batch_size"),
    ("lm_finetune", ["--lora_alpha", "16", "--lora_dropout", "0.1"], "--lora_alpha"),
    ("zero", ["--data_format", "chat", "--text_column", "body"], "--text_column"),
    (
        "lm_finetune",
        ["--validation_file", "v.jsonl", "--validation_split_percentage", "50"],
        "--validation_split_percentage",
    ),  # fmt: skip
    ("cifar", ["--image_size", "64"], "--image_size"),
    ("cifar", [*FOLDER, "--image_size", "0"], "--image_size"),
    ("cifar", [*FOLDER, "--image_size", "100000"], "--image_size"),
    ("cifar", [*FOLDER, "--image_size", "128", "--data_on_device"], "--data_on_device"),
    ("cifar", ["--model", "resnt18"], "--model"),
    ("cifar", ["--model", "fasterrcnn_resnet50_fpn"], "--model"),
    ("cifar", ["--model", "vit_b_16"], "--model"),
    ("cifar", [*FOLDER, "--model", "vit_b_16", "--image_size", "64"], "--model"),
    ("cifar", [*FOLDER, "--model", "resnet18", "--image_size", "8"], "--model"),
    ("cifar", [*FOLDER, "--model", "resnet18_cifar", "--image_size", "4"], "--model"),
    ("cifar", [*FOLDER, "--model", "resnet18", "--per_device_train_batch_size", "1"], "--per_device_train_batch_size"),
    ("cifar", ["--hflip", "1.5"], "--hflip"),
    ("cifar", ["--hflip", "-0.5"], "--hflip"),
    ("cifar", ["--hflip", "nan"], "--hflip"),
    ("cifar", ["--hflip", "yes"], "--hflip"),
    ("cifar", ["--random_crop", "0"], "0"),  # a flag takes no value: the word is unrecognized
    ("cifar", ["--head_lr_scale", "0"], "--head_lr_scale"),
    ("cifar", ["--head_lr_scale", "inf"], "--head_lr_scale"),
    ("cifar", ["--pretrained_path", ""], "--pretrained_path"),
    ("cifar", ["--model", "resnet18", "--pretrained", "--pretrained_path", "w.safetensors"], "--pretrained"),
    ("cifar", ["--model", "resnet18", "--freeze_backbone"], "--freeze_backbone"),
    ("cifar", ["--model", "resnet18", "--head_lr_scale", "10"], "--head_lr_scale"),
    (
        "cifar",
        ["--model", "resnet18", "--pretrained", "--freeze_backbone", "--head_lr_scale", "10"],
        "--head_lr_scale",
    ),  # fmt: skip
    ("cifar", ["--model", "resnet18", "--pretrained", "--norm_layer", "group"], "--norm_layer"),
    ("cifar", ["--pretrained"], "--model"),  # resnet18_cifar, the default, has no published weights
    ("cifar", ["--model", "timm/resnt18"], "--model"),
    ("cifar", ["--model", "timm/resnet18.no_such_tag"], "--model"),
    ("cifar", ["--model", "timm/botnet50ts_256", "--pretrained", *FOLDER, "--image_size", "256"], "--model"),
    ("lm_finetune", ["--validation_split_percentage", "0"], "--validation_split_percentage"),
    ("lm_finetune", ["--validation_split_percentage", "100"], "--validation_split_percentage"),
    ("lm_finetune", ["--block_size", "1"], "--block_size"),
    ("lm_finetune", ["--lora_r", "-1"], "--lora_r"),
    ("lm_finetune", ["--lora_alpha", "0"], "--lora_alpha"),
    ("lm_finetune", ["--lora_dropout", "1"], "--lora_dropout"),
    ("lm_finetune", ["--preprocessing_num_workers", "0"], "--preprocessing_num_workers"),
    ("lm_finetune", ["--torch_dtype", "float8"], "--torch_dtype"),
    ("lm_finetune", ["--text_column", " "], "--text_column"),
    ("lm_finetune", ["--dataset_name", "wikitext"], "--dataset_name"),
    ("lm_finetune", ["--dataset_config_name", "raw"], "--dataset_config_name"),
    ("lm_finetune", ["--validation_file", "v.xlsx"], "--validation_file"),
    ("lm_finetune", ["--train_file", "data"], "--train_file"),
    ("lm_finetune", ["--train_file", "tain.jsonl"], "--train_file"),
    ("zero", ["--validation_file", "v.jsonl.gz"], "--validation_file"),
    ("zero", ["--save_fp32"], "--save_fp32"),
    ("lm_finetune", ["--tokenizer_name", ""], "--tokenizer_name"),
    ("lm_finetune", ["--config_name", "c"], "--model_name_or_path"),
    ("lm_finetune", ["--config_overrides", "hidden_size=64"], "--config_overrides"),
    ("lm_finetune", ["--lora_r", "8", "--resize_token_embeddings"], "--resize_token_embeddings"),
    ("lm_finetune", ["--resize_token_embeddings", "yes"], "yes"),
    ("zero", ["--tokenizer_name", ""], "--tokenizer_name"),
    ("zero", ["--model_name_or_path", "m"], "--model_name_or_path"),
    ("zero", ["--config_overrides", "hidden_size"], "--config_overrides"),
    ("zero", ["--config_overrides", "hidden_size=64,"], "--config_overrides"),
    ("zero", ["--block_size", "0"], "--block_size"),
]
CHAT = ["--data_format", "chat"]
PROMPT_FILES = [  # --sample_prompts <file> and more arguments: (file, its bytes or None for no file, argv)
    ("p.txt", None, []),
    ("p.csv", b"a,b\n", []),
    ("p.txt", b"\n \n", []),
    ("p.txt", b"one \xff two\n", []),
    ("p.jsonl", b'{"prompt": "one"}\n{prompt}\n', []),
    ("p.jsonl", b'{"text": "one two"}\n', []),
    ("p.txt", b"one\n", CHAT),
    ("p.jsonl", b'{"messages": "hi"}\n', CHAT),
    ("p.jsonl", b'{"messages": [{"role": "assistant", "content": "two"}]}\n', CHAT),
    ("p.txt", b"one\n", ["--max_new_tokens", "0"]),
]
PARSE = [
    *((recipe, argv, subject, {}) for argv, subject in SHARED for recipe in RECIPES),
    *((recipe, argv, subject, {}) for recipe, argv, subject in RECIPE_ONLY),
    *(
        (recipe, ["--sample_prompts", name, *argv], "--sample_prompts", {} if content is None else {name: content})
        for name, content, argv in PROMPT_FILES
        for recipe in ("lm_finetune", "zero")
    ),
]


def parse_id(recipe, argv, subject=None, files=None) -> str:
    return f"{recipe} {' '.join(argv)}" + (f" ({', '.join(f'{n}: {c!r}' for n, c in files.items())})" if files else "")


@pytest.fixture
def in_a_folder_with_data(tmp_path, monkeypatch) -> Path:
    """A folder of its own holding the data files BASE and the cases name (t.jsonl, v.jsonl, data/)."""
    (tmp_path / "data").mkdir()
    for name in ("t.jsonl", "v.jsonl"):
        (tmp_path / name).write_text('{"text": "one two"}\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


def parse_refusal(capsys, recipe, argv) -> tuple[RecipeError, str]:
    """The refusal a recipe's parse_args meets for `argv`, and the line it printed, after the rule's checks: exit 2,
    one `error:` line and nothing else, the refusal its SystemExit's cause."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        RECIPES[recipe].parse_args([*BASE[recipe], *argv])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr  # one line, no usage block
    assert isinstance(exit_.value.__cause__, RecipeError), stderr
    return exit_.value.__cause__, stderr.strip()


def assert_names(err: RecipeError, line: str, subject: str, allowed: set) -> None:
    assert err.subject == subject, line
    assert subject in allowed, f"{subject} is no option of the parser, nor a word or path the case gave"
    assert subject in line, line  # the line names what the user is to change
    if err.fix is not None:
        assert line.endswith(f"; {err.fix}") and err.problem in line, line


@pytest.mark.parametrize("recipe, argv, subject, files", PARSE, ids=[parse_id(*case) for case in PARSE])
def test_a_bad_argument_is_one_line_naming_its_option(capsys, in_a_folder_with_data, recipe, argv, subject, files):
    for name, content in files.items():
        Path(name).write_bytes(content)
    before = contents(in_a_folder_with_data)
    err, line = parse_refusal(capsys, recipe, argv)
    assert_names(err, line, subject, OPTIONS[recipe] | set(argv))
    assert contents(in_a_folder_with_data) == before


def test_an_option_whose_package_is_missing_is_refused_when_parsed(capsys, in_a_folder_with_data, monkeypatch):
    """--lora_r without peft (an optional dependency): one line naming the option and the pip command, at parsing.
    (sys.modules' None is how Python marks a module that cannot be imported.)"""
    monkeypatch.setitem(sys.modules, "peft", None)
    err, line = parse_refusal(capsys, "lm_finetune", ["--lora_r", "8"])
    assert_names(err, line, "--lora_r", OPTIONS["lm_finetune"])
    assert line == "error: --lora_r needs peft: pip install -e '.[lora]'"
    RECIPES["lm_finetune"].parse_args([*BASE["lm_finetune"]])  # without --lora_r, no peft is needed


def test_sync_batch_norm_where_the_processes_run_on_the_cpu_is_refused_when_parsed(capsys, monkeypatch):
    """--norm_layer sync_batch (torch's SyncBatchNorm is GPUs' only) where make_accelerator puts the processes on
    the CPU (ACCELERATE_USE_CPU=true, or no GPU): refused by the parse, before any model or data loads."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    err, line = parse_refusal(capsys, "cifar", ["--norm_layer", "sync_batch"])
    assert_names(err, line, "--norm_layer", OPTIONS["cifar"])
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert RECIPES["cifar"].parse_args(["--norm_layer", "group"]).norm_layer == "group"


# After parsing, in a small setup: (id, setup(folder) -> the refused call, the subject, "{folder}" standing for the
# case's folder). Each setup parses the shared options as a recipe does.


def parse(*argv):
    """The shared options as a recipe parses them, with cifar's defaults."""
    parser = common.training_parser("t", "t")
    shared = set(common.args.TRAINING_HYPERPARAMETERS)
    parser.set_defaults(**{k: v for k, v in RECIPES["cifar"].HYPERPARAMETERS.items() if k in shared})
    return parser.parse_args(list(argv))


SHARED_OPTIONS = set(common.training_parser("t", "t")._option_string_actions)


def checkpoint(folder: Path, step: int, **state) -> Path:
    """checkpoint-<step> in `folder` with a marker holding `state`, as a run's save writes it (with checksums)."""
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    write_json(path / STATE_FILE, {"step": step, HASH: {}, **state})
    return path


def resumable(folder: Path, args, step=7, **changed) -> Path:
    """A checkpoint plan_run resumes with `args` on 1400 samples and 2 processes, but for what `changed` says."""
    plan, _ = plan_run(args, [0] * 1400, 2)
    state = {
        "data_fingerprint": plan.data_fingerprint, "args": public_args(args), "num_samples": 1400, "world_size": 2,
        "per_device_train_batch_size": 128, "gradient_accumulation_steps": 1, "effective_batch_size": 256,
        "learning_rate": plan.learning_rate, "total_samples": 2560, "warmup_samples": 256, "epoch": 1,
        "samples_in_epoch": 512, "samples_seen": 1792,
    }  # fmt: skip
    return checkpoint(folder, step, **{**state, **changed})


def output_dir(folder, *argv, into="run"):
    """OutputDir of a run into folder/run (or `into`) with `argv`."""
    return lambda: outputs.OutputDir(PartialState(), parse("--output_dir", str(folder / into), *argv))


def run_folder(folder: Path, *files) -> Path:
    """folder/run as a run left it: a checkpoint, and `files` of its own."""
    run = folder / "run"
    checkpoint(run, 4)
    for name in files:
        (run / name).write_text("{}")
    return run


def damaged(folder):
    """folder/run/checkpoint-4, whose marker lists a file it lacks."""
    return checkpoint(folder / "run", 4, files={"model.safetensors": 100})


def resumed(args, folder, checkpoint_path):
    return lambda: plan_run(args, [0] * 1400, 2, checkpoint_path)


def planned(*argv, samples=1400):
    return lambda: plan_run(parse(*argv), [0] * samples, 1)


def image_folders(folder: Path, train=("a", "b"), val=("a", "b")):
    """vision.load_images of folder/train and folder/val, with one image file in each class folder of each."""
    for split, classes in (("train", train), ("val", val)):
        for name in classes:
            (folder / split / name).mkdir(parents=True)
            (folder / split / name / "1.png").write_bytes(b"not read until a batch is")
    args = RECIPES["cifar"].parse_args([*FOLDER[:2], "--train_dir", str(folder / "train"), "--val_dir",
                                        str(folder / "val"), "--output_dir", str(folder / "run")])  # fmt: skip
    return lambda: vision.load_images(args)


def text_file(folder: Path, *argv):
    """load_raw_datasets of folder/t.jsonl, as lm_finetune parses `argv` for it."""
    (folder / "t.jsonl").write_text('{"body": "one two"}\n')
    args = RECIPES["lm_finetune"].parse_args(["--model_name_or_path", "m", "--train_file", str(folder / "t.jsonl"),
                                              *argv])  # fmt: skip
    return lambda: load_raw_datasets(train_file=args.train_file, data_format=args.data_format,
                                     text_column=args.text_column)  # fmt: skip


def made_in(args):
    """A save into --output_dir, as a recipe's code holding its arguments makes its folder."""
    return lambda: Path(args.output_dir, "checkpoint-1").mkdir(parents=True)


SETUPS = {  # name: (setup(folder) -> the refused call, its subject)
    "an image folder of one class": (lambda f: image_folders(f, train=("a",), val=("a",)), "--train_dir"),
    "validation classes the training set lacks": (lambda f: image_folders(f, val=("a", "c")), "--val_dir"),
    "an unreadable image": (lambda f: ((f / "x.png").write_bytes(b"GIF8"), lambda: vision.load_image(f / "x.png"))[1],
                            "{folder}/x.png"),
    "a text column the data lacks": (lambda f: text_file(f), "--text_column"),
    "a folder where a file is": (lambda f: ((f / "file").write_text(""), made_in(parse("--output_dir", str(f / "file" /
                                 "run"))))[1], "--output_dir"),  # the system's refusal, named by the option
    "more accumulation than batches": (lambda f: planned("--gradient_accumulation_steps", "30"),
                                       "--gradient_accumulation_steps"),
    "a schedule transformers refuses": (lambda f: planned("--lr_scheduler_type", "polynomial", "--learning_rate",
                                                          "1e-9"), "--lr_scheduler_type"),
    "a stream shorter than one step": (  # a stream's size is known only when it ends: at the first step's read
        lambda f: lambda: loop._read_window(iter([["a batch"]]), 2, True, 16), "--per_device_train_batch_size"),
    "warmup as long as the run": (lambda f: planned("--max_train_steps", "50", "--warmup_steps", "50", samples=1000),
                                  "--warmup_steps"),
    "a checkpoint of another seed": (lambda f: resumed(parse("--seed", "1"), f, resumable(f, parse())), "--seed"),
    "a checkpoint of other data": (lambda f: resumed(parse(), f, resumable(f, parse(), data_fingerprint="x")),
                                   "{folder}/checkpoint-7"),
    "a checkpoint of an earlier version": (
        lambda f: resumed(parse(), f, checkpoint(f, 13, epoch=1, batches_in_epoch=4)), "{folder}/checkpoint-13"),
    "a checkpoint past the epochs asked": (
        lambda f: resumed(parse("--num_train_epochs", "1"), f, resumable(f, parse("--num_train_epochs", "1"))),
        "--num_train_epochs"),
    "a run's folder, no resume flag": (lambda f: (run_folder(f), output_dir(f))[1], "--output_dir"),
    "another folder's checkpoint into a run's folder": (
        lambda f: (run_folder(f), checkpoint(f / "other", 2),
                   output_dir(f, "--resume_from_checkpoint", str(f / "other" / "checkpoint-2")))[-1],
        "--output_dir"),
    "a folder of files no run wrote": (
        lambda f: ((f / "run").mkdir(), (f / "run" / "config.json").write_text("{}"), output_dir(f))[-1],
        "--output_dir"),
    "overwrite and latest": (
        lambda f: (run_folder(f), output_dir(f, "--overwrite_output_dir", "--resume_from_checkpoint", "latest"))[1],
        "--overwrite_output_dir"),
    "a checkpoint that is not there": (
        lambda f: output_dir(f, "--resume_from_checkpoint", str(f / "checkpoint-9")), "--resume_from_checkpoint"),
    "a checkpoint's file": (
        lambda f: (run_folder(f), output_dir(f, "--resume_from_checkpoint",
                                             str(f / "run" / "checkpoint-4" / STATE_FILE)))[1],
        "--resume_from_checkpoint"),
    "a run's folder as the checkpoint": (
        lambda f: (run_folder(f), output_dir(f, "--resume_from_checkpoint", str(f / "run")))[1],
        "--resume_from_checkpoint"),
    "a checkpoint as the run's folder": (
        lambda f: (run_folder(f), output_dir(f, into="run/checkpoint-4"))[1],
        "--output_dir"),
    "a damaged checkpoint": (
        lambda f: (lambda path: lambda: resolve_checkpoint(f / "run", str(path)))(damaged(f)),
        "--resume_from_checkpoint"),
    "every checkpoint damaged": (lambda f: (damaged(f), lambda: resolve_checkpoint(f / "run", "latest"))[1],
                                 "--resume_from_checkpoint"),
}  # fmt: skip


def setup_refusal(folder: Path, case: str, capsys) -> tuple[RecipeError, str]:
    """The refusal of SETUPS[case] in `folder`, as a recipe's entry point says it (exit_codes): exit 2, one line,
    nothing in `folder` written or deleted."""
    refused = SETUPS[case][0](folder)
    before = contents(folder)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        with exit_codes():
            try:
                refused()
            except Exception as err:  # a RecipeError, or an OS error about a path, translated as exit_codes does
                caught = err if isinstance(err, RecipeError) else os_error_refusal(err)
                raise
    stderr = capsys.readouterr().err
    outputs._RunLock.release_all()
    assert exit_.value.code == 2, stderr
    lines = error_lines(stderr)  # beside datasets' progress bars, if it read files
    assert len(lines) == 1 and stderr.rstrip().endswith(lines[0]), stderr
    assert contents(folder) == before
    return caught, lines[0]


@pytest.mark.parametrize("case", SETUPS)
def test_a_refusal_after_parsing_is_one_line_naming_its_option_or_path(tmp_path, capsys, case):
    PartialState()  # common's logger is Accelerate's, which needs the process state recipes always have
    err, line = setup_refusal(tmp_path, case, capsys)
    subject = SETUPS[case][1].replace("{folder}", str(tmp_path))
    paths = {str(p) for p in tmp_path.rglob("*")}
    assert_names(err, line, subject, SHARED_OPTIONS | OPTIONS["cifar"] | OPTIONS["lm_finetune"] | paths)


GOLDEN = REPO / "tests" / "golden_errors.json"


def test_the_lines_users_meet_most_keep_their_wording(tmp_path, capsys, monkeypatch):
    """golden_errors.json: each case (a PARSE case's recipe and argv, or a SETUPS name) and the line it prints,
    "{folder}" standing for the case's folder. At most 20: the rest of the wording is free to improve."""
    cases = json.loads(GOLDEN.read_text())
    assert 0 < len(cases) <= 20
    parse_cases = {parse_id(*case): case for case in PARSE}
    for number, (case, expected) in enumerate(cases.items()):
        folder = tmp_path / str(number)
        folder.mkdir()
        if case in SETUPS:
            line = setup_refusal(folder, case, capsys)[1]
        else:
            recipe, argv, _, files = parse_cases[case]
            monkeypatch.chdir(folder)
            (folder / "data").mkdir()
            for name, content in {"t.jsonl": b'{"text": "one two"}\n', "v.jsonl": b"{}\n", **files}.items():
                (folder / name).write_bytes(content)
            line = parse_refusal(capsys, recipe, argv)[1]
        assert line == expected.replace("{folder}", str(folder)), case


def test_a_refusal_crosses_processes_whole():
    """decide_on_main broadcasts a refusal pickled, and a DataLoader worker's comes back through its message: the
    fields and the line arrive as they left."""
    sent = RecipeError("--x 0: too small", "pass 1 or more", subject="--x", same_on_every_rank=False)
    got = pickle.loads(pickle.dumps(sent))
    assert (str(got), got.problem, got.fix, got.subject, got.same_on_every_rank) == (
        "--x 0: too small; pass 1 or more", "--x 0: too small", "pass 1 or more", "--x", False,
    )  # fmt: skip
    assert str(DataError(str(sent))) == str(sent)  # how torch re-raises a worker's: the class and its message
