"""Every input checked: each argument when it is parsed, each data and model file when it loads.

Parse-time checks are called in this process (a recipe's own parse_args); the loaders are called
here too, on real broken files. A few cases are launched as users launch them, to show the whole
path: one `error:` line, exit code 2, no output folder.
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, NO_NETWORK, REPO, error_lines, lm_args, load_recipe, results, run
from PIL import Image

from common import vision
from common.runtime import RecipeError
from common.text import chat_example, data_sources, lm_dataloaders, load_raw_datasets, tokenize_and_pack

RECIPES = {name: load_recipe(name) for name in ("cifar", "lm_finetune", "zero")}
BASE = {  # the least each recipe's parser needs; of paths, parsing reads only that the data files are there
    "cifar": [],
    "lm_finetune": ["--model_name_or_path", "m", "--train_file", "t.jsonl"],
    "zero": ["--config_name", "m", "--train_file", "t.jsonl"],
}
FOLDER = ["--dataset", "imagefolder", "--train_dir", "t", "--val_dir", "v"]
HF_TOKEN = "hf_" + "Zq7" * 10


@pytest.fixture(autouse=True)
def in_a_folder_with_data(tmp_path_factory, monkeypatch):
    """Each test runs in a folder of its own holding the data files BASE and the cases name (t.jsonl, v.jsonl)."""
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "data").mkdir()
    for name in ("t.jsonl", "v.jsonl"):
        (cwd / name).write_text('{"text": "one two"}\n')
    monkeypatch.chdir(cwd)


def parse_error(capsys, recipe, argv) -> str:
    """The one line a recipe's parse_args prints for `argv` before exiting with code 2."""
    with pytest.raises(SystemExit) as exit_:
        RECIPES[recipe].parse_args([*BASE[recipe], *argv])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and stderr.strip() == lines[0], stderr  # one line, no usage block
    return lines[0]


def refused_subject(recipe, argv) -> str:
    """The subject of the refusal a recipe's parse_args exits 2 on for the whole of `argv` (BASE not added)."""
    with pytest.raises(SystemExit) as exit_:
        RECIPES[recipe].parse_args(argv)
    assert exit_.value.code == 2
    return exit_.value.__cause__.subject


# Each argument's refusal (its option named, one line, exit 2, nothing written): tests/test_refusals.py's tables.


def test_lm_finetune_from_a_config_takes_what_a_new_model_can():
    config = ["--config_name", "m", "--train_file", "t.jsonl"]
    for argv in (["--lora_r", "8"], ["--torch_dtype", "auto"]):
        assert refused_subject("lm_finetune", [*config, *argv]) == argv[0]
    assert refused_subject("lm_finetune", ["--train_file", "t.jsonl"]) == "--model_name_or_path"
    args = RECIPES["lm_finetune"].parse_args(
        [
            *config,
            "--config_overrides",
            "num_hidden_layers=1",
            "--tokenizer_name",
            "t",
            "--resize_token_embeddings",
            "--torch_dtype",
            "bfloat16",
        ]
    )
    assert args.config_name == "m" and args.model_name_or_path is None and args.resize_token_embeddings


FLAG = r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]"


def test_sample_prompts_parse_and_a_conversation_loses_its_last_reply():
    """Blank lines are no prompts; a chat row may be a training row: the reply it ends with is the model's to write."""
    from common.samples import read_prompts

    Path("p.txt").write_text("count from one\n\ncount from five\n")
    assert RECIPES["lm_finetune"].parse_args([*BASE["lm_finetune"], "--sample_prompts", "p.txt"]).max_new_tokens == 20
    assert read_prompts("p.txt", "text") == ["count from one", "count from five"]
    ask = {"role": "user", "content": "count from one"}
    Path("c.jsonl").write_text(jsonl([CHAT, {"messages": [ask]}]))
    assert read_prompts("c.jsonl", "chat") == [CHAT["messages"][:1], [ask]]


def test_every_option_an_error_or_a_docstring_names_exists(capsys):
    """Advice that names a flag the recipe does not take is an unrecognized argument when followed.
    common/text.py serves both LM recipes: its flags must exist in both (it names --attn_implementation
    only when the recipe passed one, which zero.py does not); common/vision.py's, in the image recipe."""
    options = {}
    for name, module in RECIPES.items():
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        options[name] = set(re.findall(FLAG, capsys.readouterr().out))
    assert {"--pretrained_path", "--no-random_crop"} <= options["cifar"] and "--resize_token_embeddings" in options[
        "zero"
    ]
    for path, recipes in (
        ("recipes/cifar.py", ["cifar"]),
        ("recipes/lm_finetune.py", ["lm_finetune"]),
        ("recipes/zero.py", ["zero"]),
        ("common/text.py", ["lm_finetune", "zero"]),
        ("common/samples.py", ["lm_finetune", "zero"]),
        ("common/vision.py", ["cifar"]),
    ):
        named = set(re.findall(FLAG, (REPO / path).read_text())) - {"--config_file"}  # accelerate launch's
        for recipe in recipes:
            missing = named - options[recipe] - ({"--attn_implementation"} if path == "common/text.py" else set())
            assert not missing, f"{path} names {sorted(missing)}, which recipes/{recipe}.py does not take"


def test_lm_recipes_need_data_and_zero_overrides_need_a_config():
    assert refused_subject("lm_finetune", ["--model_name_or_path", "m"]) == "--train_file"
    assert refused_subject("zero", ["--config_name", "", "--model_name_or_path", "m"]) == "--config_name"
    argv = ["--model_name_or_path", "m", "--train_file", "t.jsonl", "--config_overrides", "a=1"]
    assert refused_subject("zero", argv) == "--config_overrides"


def test_a_schedule_a_deepspeed_config_overrides_is_refused(monkeypatch, tmp_path):
    """A DeepSpeed config's scheduler sets every step's rate: --lr_scheduler_type would do nothing."""
    argv = ["--lr_scheduler_type", "linear"]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config))
    assert RECIPES["zero"].parse_args([*BASE["zero"], *argv]).lr_scheduler_type == "linear"
    config.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {}}}))
    assert refused_subject("zero", [*BASE["zero"], *argv]) == "--lr_scheduler_type"
    assert RECIPES["zero"].parse_args(BASE["zero"]).lr_scheduler_type == "cosine"  # the default asks for nothing


def test_the_values_accepted_without_asking_transformers_are_ones_the_installed_transformers_has():
    """Every --lr_scheduler_type choice is a transformers schedule that runs from a warmup and a length
    alone, as common.plan drives it (in samples); and the attention implementations common.text expects to load."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from common.args import SCHEDULES
    from common.plan import plan_training

    for name in SCHEDULES:
        args = argparse.Namespace(
            per_device_train_batch_size=10, gradient_accumulation_steps=1, learning_rate=0.1, reference_batch_size=10,
            lr_scaling="none", num_train_epochs=1, max_train_steps=None, warmup_steps=10, lr_scheduler_type=name,
        )  # fmt: skip
        plan = plan_training(args, 1000, 1)
        rates = [plan.lr_at(seen) for seen in range(0, plan.total_samples, 10)]
        assert rates[0] < rates[10] == pytest.approx(0.1) or name == "constant", name  # warmed up to the rate
        assert all(0 <= rate <= 0.1 + 1e-12 for rate in rates), name
    assert "sdpa" in ALL_ATTENTION_FUNCTIONS  # common.text never blames eager or sdpa for a failed load


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_mistyped_flag_is_answered_before_transformers_models_and_schedules_load(recipe):
    """Importing them takes seconds (more with peft installed): a typo on the command line need not wait."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['{recipe}.py', '--no_such_flag']\n"
        "try:\n"
        f"    runpy.run_path('recipes/{recipe}.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    heavy = ('transformers.optimization', 'transformers.modeling_utils')\n"
        "    print(e.code, [m for m in heavy if m in sys.modules])\n"
    )
    proc = run([BIN / "python", "-c", code])
    assert proc.stdout.split() == ["2", "[]"], proc.stdout + proc.stderr[-2000:]
    assert "unrecognized arguments: --no_such_flag" in proc.stderr


@pytest.mark.slow  # the cold half starts recipes in fresh interpreters
@pytest.mark.floor  # the floor's fast tier forks from the warm process too
def test_a_recipe_run_forked_from_the_warm_process_ends_as_a_fresh_interpreter_does(tiny_lm, tmp_path):
    """conftest.run forks `python <recipe>` from a process that imported the libraries (tests/warm.py): a refusal
    and a finished run end with the same exit code, lines and files as in a new interpreter; an environment with
    another cache folder starts afresh."""
    from conftest import _WARM, user_env

    recipe = REPO / "recipes" / "lm_finetune.py"
    ends = {}
    for how in ("warm", "cold"):
        refused = [BIN / "python", recipe, *lm_args(tiny_lm, tmp_path / how / "no", "--block_size", "4096")]
        trained = [BIN / "python", recipe, *lm_args(tiny_lm, tmp_path / how / "run", "--max_train_steps", "1")]
        env = user_env(**({"RECIPES_TESTS_COLD": "1"} if how == "cold" else {}))
        assert _WARM.takes([str(c) for c in refused], env) == (how == "warm")
        no, ran = run(refused, env=env, check=False), run(trained, env=env)
        assert not (tmp_path / how / "no").exists()
        ends[how] = (no.returncode, error_lines(no.stderr), ran.returncode, results(tmp_path / how / "run")["steps"])
    assert ends["warm"] == ends["cold"] and ends["warm"][0] == 2 and len(ends["warm"][1]) == 1, ends
    assert not _WARM.takes([str(BIN / "python"), str(recipe)], user_env(HF_DATASETS_CACHE=str(tmp_path)))


def test_a_tracker_that_is_not_installed_is_refused():
    from accelerate.tracking import get_available_trackers

    missing = next(
        t
        for t in ("wandb", "mlflow", "aim", "clearml", "dvclive", "swanlab", "trackio", "comet_ml")
        if t not in {x.value for x in get_available_trackers()}
    )
    with pytest.raises(SystemExit) as exit_:
        RECIPES["cifar"].parse_args(["--report_to", missing])
    assert exit_.value.code == 2


def test_a_tilde_in_any_path_option_is_home(monkeypatch):
    """A shell expands ~ only at a word's start: --output_dir=~/out reaches the recipe as it is. Every option's
    value is expanded once, after parsing (a model folder as well as the data and the output)."""
    monkeypatch.setenv("HOME", os.getcwd())  # which holds t.jsonl
    args = RECIPES["cifar"].parse_args(["--output_dir=~/out", "--resume_from_checkpoint=~/out/checkpoint-2"])
    assert args.output_dir == os.path.expanduser("~/out") and not args.output_dir.startswith("~")
    assert args.resume_from_checkpoint == os.path.expanduser("~/out/checkpoint-2")
    words = ["--model_name_or_path=~/model", "--tokenizer_name=~/tok", "--train_file=~/t.jsonl"]
    lm = RECIPES["lm_finetune"].parse_args(words)
    assert [lm.model_name_or_path, lm.tokenizer_name, lm.train_file] == [
        os.path.expanduser(f"~/{name}") for name in ("model", "tok", "t.jsonl")
    ]


def test_valid_arguments_still_parse():
    cifar = RECIPES["cifar"].parse_args(
        [
            "--checkpointing_steps",
            "epoch",
            "--lr_scheduler_type",
            "constant_with_warmup",
            "--report_to",
            "tensorboard",
            "--seed",
            str(2**32 - 1),
            "--warmup_ratio",
            "1",
        ]
    )
    assert cifar.checkpointing_steps == "epoch" and cifar.seed == 2**32 - 1
    assert RECIPES["cifar"].parse_args(["--checkpointing_steps", "500"]).checkpointing_steps == 500
    assert RECIPES["cifar"].parse_args([*FOLDER, "--model", "resnet50", "--image_size", "64"]).model == "resnet50"
    lm = RECIPES["lm_finetune"].parse_args(
        [*BASE["lm_finetune"], "--validation_split_percentage", "0.5", "--attn_implementation", "flash_attention_2"]
    )
    assert lm.validation_split_percentage == 0.5
    zero = RECIPES["zero"].parse_args([*BASE["zero"], "--config_overrides", "hidden_size=64,num_hidden_layers=1"])
    assert zero.config_overrides == "hidden_size=64,num_hidden_layers=1"


@pytest.mark.parametrize(
    "argv, secret",
    [
        (["--hub_token", HF_TOKEN], HF_TOKEN),
        (["--hub_token", "plain-secret-value"], "plain-secret-value"),
        (["--api_key=k3y-v4lue"], "k3y-v4lue"),
        (["--password", "pw"], "pw"),  # short: masked as a whole argument, not wherever "pw" occurs
        (["--learning_rate", HF_TOKEN], HF_TOKEN),  # a token pasted into the wrong flag
        (["--unknown", "https://user:pa55word@example.com/x"], "pa55word"),
    ],
)
def test_parse_errors_never_print_a_credential(capsys, argv, secret):
    line = parse_error(capsys, "cifar", argv)
    assert secret not in line and "***" in line, line


def test_only_the_first_process_prints_a_parse_error(capsys, monkeypatch):
    """Every process of a launch parses the same command line: one of them says what is wrong."""
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_:
        RECIPES["cifar"].parse_args(["--num_train_epochs", "0"])
    assert exit_.value.code == 2 and capsys.readouterr().err == ""


# --- data files ---------------------------------------------------------------------------------


def write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def jsonl(rows):
    return "".join(json.dumps(row) + "\n" for row in rows)


COUNTS = [{"text": "one two three four five six"} for _ in range(20)]
CHAT = {"messages": [{"role": "user", "content": "count from one"}, {"role": "assistant", "content": "two three"}]}

TEXT_FILES = [  # (file name, content, the error line's text)
    ("empty.jsonl", "", "holds no rows"),
    ("blank.jsonl", "\n\n  \n", "holds no rows"),
    ("empty.txt", "", "holds no rows"),
    ("empty.csv", "", "holds no rows"),
    ("spaces.txt", " \n" * 50_000, "holds no text"),  # past any size a pre-check would read
    ("bad.jsonl", jsonl(COUNTS) + '{"text": "one two"\n', "cannot be read as json (ArrowInvalid: JSON parse error"),
    ("null.jsonl", jsonl([*COUNTS, {"text": None}]), "text is None (NoneType), not text; remove or fill such rows"),
    ("number.jsonl", jsonl([{"text": i} for i in range(20)]), "(int), not text"),
    ("mixed.jsonl", jsonl([*COUNTS, {"text": 5}]), "a row's text is 5 (int), not text"),
    ("latin1.txt", "one two caf\xe9 three\n".encode("latin-1") * 20, "not UTF-8 text (byte 0xe9"),
    ("latin1.jsonl", '{"text": "caf\xe9 one two"}\n'.encode("latin-1") * 20, "not UTF-8 text (byte 0xe9"),
    ("latin1.csv", "text\ncaf\xe9 one\n".encode("latin-1"), "not UTF-8 text (byte 0xe9"),
    (
        "one.json",
        '{"text": "one two three"}',
        "1 row(s) are too few to hold out 5% for validation; add rows, or pass --validation_file",
    ),  # fmt: skip  (no percentage holds one row out)
    ("header.csv", "text\n", "holds no rows"),
    ("nocolumn.csv", "body\n" + "one two three\n" * 20, "not in the data (columns: body); pass --text_column body"),
    (
        "ids.jsonl",
        jsonl([{"id": i, "label": 0, "body": "one two"} for i in range(20)]),
        "label, body); pass --text_column body",
    ),
    ("chat.jsonl", jsonl([CHAT] * 20), "(columns: messages); it looks like chat data: pass --data_format chat"),
    ("fake.parquet", "not parquet at all", "cannot be read as parquet (ArrowInvalid: Parquet magic bytes not found"),
    (
        "few.txt",
        "one\n" * 20,
        "holds fewer than 32 tokens; add data (a larger --validation_split_percentage) or lower --block_size",
    ),
    (  # before holding out a validation split of its one row
        "nested.json",
        json.dumps({"version": 1, "data": COUNTS}),
        "no text column (columns: version, data): its one row holds a list under data; write one JSON object per line",
    ),  # fmt: skip
]


def test_too_little_held_out_text_advises_a_larger_share_only_where_one_holds_more():
    """Two rows, one held out: no --validation_split_percentage holds more (a larger one leaves nothing to train on,
    refused), so the fix is more data or a smaller --block_size; with rows to spare, a larger share is one."""
    from common.text import _check_split

    source = "the part of --train_file two.txt held out for validation"
    for rows, said in ((1, "add data or lower --block_size"),
                       (40, "add data (a larger --validation_split_percentage) or lower --block_size")):  # fmt: skip
        with pytest.raises(RecipeError) as err:
            _check_split(source, 1, 0, 0, 32, train_rows=rows)
        assert str(err.value) == f"{source} holds fewer than 32 tokens; {said}"


def test_a_byte_order_mark_is_not_text(tmp_path, tokenizer):
    """Notepad's UTF-8 with a BOM: the first word is 'one', not '\\ufeffone' (an unknown token)."""
    path = write(tmp_path / "bom.txt", "\ufeffone two three\r\n" * 40)
    raw = load_raw_datasets(train_file=path, validation_file=path)
    assert raw["train"][0]["text"] == "one two three"


def test_train_and_validation_data_of_two_formats_is_said_as_such(tmp_path, tokenizer):
    """Following a fix for one split (--data_format chat) must not break the other: the line names both."""
    text, chat = write(tmp_path / "t.jsonl", jsonl(COUNTS)), write(tmp_path / "c.jsonl", jsonl([CHAT] * 20))
    text_error = load_error(tokenizer, "text", train_file=text, validation_file=chat)
    assert text_error.startswith(
        f"--validation_file {chat} has no text column (columns: messages), which "
        f"--train_file {text} has: pass data of one format for both"
    ), text_error
    chat_error = load_error(tokenizer, "chat", train_file=text, validation_file=chat)
    assert chat_error.startswith(f"--train_file {text} has no messages column (columns: text), which "
                                 f"--validation_file {chat} has"), chat_error  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_lm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_lm["model"])


def load_error(tokenizer, data_format="text", **files) -> str:
    with pytest.raises(RecipeError) as err:
        raw = load_raw_datasets(**files, data_format=data_format)  # as lm_dataloaders calls it
        tokenize_and_pack(
            raw,
            tokenizer,
            data_format=data_format,
            text_column="text",
            block_size=32,
            sources=data_sources(files.get("dataset_name"), files.get("train_file"), files.get("validation_file")),
        )
    return str(err.value)


@pytest.mark.parametrize("name, content, message", TEXT_FILES, ids=[n for n, _, _ in TEXT_FILES])
def test_a_broken_data_file_is_one_error_naming_it(tmp_path, tokenizer, name, content, message):
    path = write(tmp_path / name, content)
    error = load_error(tokenizer, train_file=path)
    assert str(path) in error and message in error, error


def test_data_files_that_are_not_files(tmp_path, tokenizer):
    (tmp_path / "folder.jsonl").mkdir()
    assert "folder.jsonl: is a directory; pass a file in it" in load_error(
        tokenizer, train_file=tmp_path / "folder.jsonl"
    )
    no_folder = "--dataset_name ./no/such: no such file or directory; check the path"
    assert no_folder in load_error(tokenizer, dataset_name="./no/such")
    (tmp_path / "nodata").mkdir()
    error = load_error(tokenizer, dataset_name=str(tmp_path / "nodata"))
    assert f"--dataset_name {tmp_path / 'nodata'}: EmptyDatasetError" in error and "or --train_file" in error
    (tmp_path / "mixed").mkdir()  # a folder is read as one table: text and chat files do not make one
    write(tmp_path / "mixed" / "text.jsonl", jsonl(COUNTS))
    write(tmp_path / "mixed" / "chat.jsonl", jsonl([CHAT] * 20))
    error = load_error(tokenizer, dataset_name=str(tmp_path / "mixed"))
    assert (
        f"--dataset_name {tmp_path / 'mixed'}: " in error
        and (
            "because column names don't match; its data files must share one format and the same columns: move the "
            "others out of it"
        )
        in error
    ), error
    # Each file is read in its own format: a json training file and a csv validation file load together.
    train = write(tmp_path / "train.jsonl", jsonl(COUNTS))
    valid = write(tmp_path / "valid.csv", "text\n" + "one two three four five six\n" * 20)
    data = tokenize_and_pack(load_raw_datasets(train_file=train, validation_file=valid), tokenizer, data_format="text",
                             text_column="text", block_size=32)  # fmt: skip
    assert len(data["train"]) > 0 and len(data["validation"]) > 0


def test_a_tokenizer_that_ends_each_text_with_eos_gets_no_second_one(tmp_path, tiny_lm):
    """A document ends with one EOS, whether the tokenizer appends it (Mistral's add_eos_token, a post-processor)
    or the packing does."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    train = write(tmp_path / "train.jsonl", jsonl(COUNTS))
    for appends in (False, True):
        tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
        if appends:
            eos = [(tokenizer.eos_token, tokenizer.eos_token_id)]
            tokenizer._tokenizer.post_processor = TemplateProcessing(single="$A <eos>", special_tokens=eos)
            assert tokenizer("one two")["input_ids"][-1] == tokenizer.eos_token_id
        raw = load_raw_datasets(train_file=train, validation_file=train)
        data = tokenize_and_pack(raw, tokenizer, data_format="text", text_column="text", block_size=7)
        ids = [i for block in data["train"]["input_ids"] for i in block]
        document = tokenizer("one two three four five six", add_special_tokens=False)["input_ids"]
        assert ids[:14] == (document + [tokenizer.eos_token_id]) * 2, appends


CONVERSATIONS = [  # (messages, the error's text)
    ("hello", "`messages` is 'hello', not a list of"),
    ([], "`messages` is [], not a list of"),
    ({"role": "user", "content": "x"}, "not a list of"),
    (["hello", "there"], "message 1 is 'hello', not an object"),
    ([{"content": "count from one"}, {"role": "assistant", "content": "two"}], "message 1 has no role"),
    ([{"role": "user", "content": "count from one"}], "no assistant message, so nothing to train on"),
    (
        [{"role": "user", "content": 5}, {"role": "assistant", "content": "two"}],
        "message 1's content is 5 (int), not a string",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": "one"}]}, {"role": "assistant", "content": "two"}],
        "(list), not a string: join its text parts into one string",
    ),
    ([{"role": "user"}, {"role": "assistant", "content": "two"}], "message 1 has no content"),
]


@pytest.mark.parametrize("messages, message", CONVERSATIONS, ids=[m for _, m in CONVERSATIONS])
def test_a_malformed_conversation_is_refused(tokenizer, messages, message):
    with pytest.raises(RecipeError, match=None) as err:
        chat_example(tokenizer, messages)
    assert message in str(err.value)


@pytest.mark.parametrize("messages, message", CONVERSATIONS[:6:5], ids=["not a list", "no assistant"])
def test_a_malformed_chat_file_names_the_file(tmp_path, tokenizer, messages, message):
    path = write(tmp_path / "chat.jsonl", jsonl([CHAT] * 20 + [{"messages": messages}]))
    error = load_error(tokenizer, data_format="chat", train_file=path, validation_file=path)
    assert error.startswith(f"--train_file {path}: ") and message in error and "fix or remove that row" in error


def test_chat_data_needs_a_tokenizer_with_a_chat_template_that_accepts_it(tmp_path, tokenizer):
    path = write(tmp_path / "chat.jsonl", jsonl([CHAT] * 20))
    plain = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    raw = load_raw_datasets(train_file=path, validation_file=path)
    with pytest.raises(RecipeError) as refused:
        tokenize_and_pack(raw, plain, data_format="chat", text_column="text", block_size=8)
    assert refused.value.subject == "--data_format"
    strict = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(RecipeError, match="the chat template rejects the conversation .Conversation roles must"):
        chat_example(strict, CHAT["messages"])
    text = load_raw_datasets(train_file=write(tmp_path / "t.jsonl", jsonl(COUNTS)), validation_split_percentage=50)
    with pytest.raises(RecipeError) as refused:
        tokenize_and_pack(text, tokenizer, data_format="chat", text_column="text", block_size=8)
    assert "--data_format chat needs a column named messages" in refused.value.problem  # no option names the data


# --- model files --------------------------------------------------------------------------------


@pytest.fixture
def broken_model(tiny_lm, tmp_path):
    """broken_model(how) -> a copy of the tiny model's folder, damaged `how`."""

    def make(how):
        folder = tmp_path / how
        shutil.copytree(tiny_lm["model"], folder)
        weights = folder / "model.safetensors"
        if how == "truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif how == "garbage":
            weights.write_bytes(np.random.default_rng(0).bytes(4096))
        elif how == "no_config":
            (folder / "config.json").unlink()
        elif how == "bad_config":
            (folder / "config.json").write_text("{not json")
        elif how == "invalid_config":  # JSON, with a field of the wrong type: the tokenizer reads it too
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "x"}))
        elif how == "resized_config":  # edited after the weights were saved
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
        elif how == "encoder":  # BERT, which AutoModelForCausalLM loads with attention both ways
            from transformers import BertConfig, BertForMaskedLM

            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            config = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64)  # fmt: skip
            BertForMaskedLM(config).save_pretrained(folder)  # beside the tiny model's tokenizer
        elif how == "no_weights":
            weights.unlink()
        elif how == "bad_tokenizer":
            (folder / "tokenizer.json").write_text("{not json")
        elif how in ("lora_adapter", "lora_run"):  # an adapter, its base named (and lm_finetune --lora_r's merged/)
            for file in folder.iterdir():
                file.unlink()
            (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
            if how == "lora_run":
                shutil.copytree(tiny_lm["model"], folder / "merged")
        return folder

    return make


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "its safetensors weights are damaged (Error while deserializing header"),
        ("garbage", "its safetensors weights are damaged"),
        ("no_config", "no config.json in the folder; pass the folder that save_pretrained wrote"),
        ("bad_config", "config.json' is not a valid JSON file; pass the folder that save_pretrained wrote"),
        (
            "invalid_config",
            "its config.json is not valid (StrictDataclassFieldValidationError: Validation error for "
            "field 'hidden_size': TypeError: Field 'hidden_size' expected int",
        ),
        ("resized_config", "its weights do not fit its config.json (the tensors marked MISMATCH above)"),
        ("encoder", "BertLMHeadModel lets each position see the ones after it (an encoder such as BERT"),
        ("no_weights", "OSError: Error no file named model.safetensors"),
        ("bad_tokenizer", "its tokenizer cannot be loaded (JSONDecodeError"),
        (
            "lora_adapter",
            "a LoRA adapter (adapter_config.json), not a model; pass its base model, "
            "--model_name_or_path org/base, or the folder of the adapter merged into it",
        ),  # fmt: skip
        ("lora_run", "--model_name_or_path org/base, or the adapter merged into it, --model_name_or_path /"),
    ],
)
@pytest.mark.parametrize("recipe", ["lm_finetune", "zero"])
def test_a_damaged_model_folder_is_one_error_naming_it(broken_model, tmp_path, recipe, how, message):
    folder = broken_model(how)
    module = RECIPES[recipe]
    args = module.parse_args(["--model_name_or_path", str(folder), "--train_file", "t.jsonl"])
    with pytest.raises(RecipeError) as err:
        module.load_model_and_tokenizer(args) if recipe == "lm_finetune" else module.build_model(args)
    assert str(err.value).startswith(f"--model_name_or_path {folder}: ") and message in str(err.value), str(err.value)
    assert str(err.value).endswith(f"{folder / 'merged'}") == (how == "lora_run")


@pytest.mark.parametrize(
    "name, said", [("flash", 'attn_implementation="flash"` is not supported'), ("flash_attention_2", "")]
)
def test_an_attention_implementation_that_is_unknown_or_not_installed(tiny_lm, name, said):
    """transformers refuses it when the model loads, seconds after the command: one line naming the option."""
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    lm = RECIPES["lm_finetune"]
    args = lm.parse_args(
        ["--model_name_or_path", str(tiny_lm["model"]), "--train_file", "t.jsonl", "--attn_implementation", name]
    )
    with pytest.raises(RecipeError) as err:
        lm.load_model_and_tokenizer(args)
    assert str(err.value).startswith(f"--attn_implementation {name} cannot be used here (") and said in str(err.value)
    assert str(err.value).endswith(
        "; install what it needs, or leave the option out (transformers picks sdpa where the model has it, else eager)"
    )


def test_a_model_without_sdpa_loads_with_the_attention_it_has_unless_sdpa_is_asked_for(tiny_lm, tmp_path):
    """Mamba (as Bloom, GPT-Neo, MPT) has no sdpa: without --attn_implementation transformers picks what the model
    has, in both LM recipes (zero.py has no such option); asked for sdpa, one line names the option."""
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    folder = tmp_path / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1)).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    base = ["--model_name_or_path", str(folder), "--train_file", "t.jsonl"]
    model, _ = RECIPES["lm_finetune"].load_model_and_tokenizer(RECIPES["lm_finetune"].parse_args(base))
    assert model.config._attn_implementation == "eager"
    RECIPES["zero"].build_model(RECIPES["zero"].parse_args(base))
    with pytest.raises(RecipeError) as refused:
        RECIPES["lm_finetune"].load_model_and_tokenizer(
            RECIPES["lm_finetune"].parse_args([*base, "--attn_implementation", "sdpa"])
        )
    assert refused.value.subject == "--attn_implementation"


def test_a_block_size_above_the_tokenizers_limit_but_within_the_models_positions_is_said_not_refused(
    tiny_lm, tmp_path, caplog
):
    """As run_clm: the model's max_position_embeddings is the limit; a tokenizer saved with a smaller model_max_length
    gets a warning naming it."""
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"], model_max_length=16)
    lm = RECIPES["lm_finetune"]
    base = ["--model_name_or_path", str(tiny_lm["model"]), "--train_file", str(tiny_lm["train"])]
    args = lm.parse_args([*base, "--validation_file", str(tiny_lm["validation"]), "--block_size", "32"])
    with caplog.at_level("WARNING"):
        block_size = lm_dataloaders(
            args, Accelerator(cpu=True), tokenizer, AutoConfig.from_pretrained(tiny_lm["model"])
        )[2]
    assert block_size == 32 and "--block_size 32 is above the tokenizer's model_max_length (16)" in caplog.text


def test_lora_targets_separated_by_commas_or_spaces_are_the_same():
    lm = RECIPES["lm_finetune"]
    for targets in (["q_proj,v_proj"], ["q_proj", "v_proj"], ["q_proj,", "v_proj"]):
        args = lm.parse_args([*BASE["lm_finetune"], "--lora_r", "8", "--lora_target_modules", *targets])
        assert args.lora_target_modules == ["q_proj", "v_proj"]


def test_lora_targets_that_the_model_lacks(tiny_lm):
    lm = RECIPES["lm_finetune"]
    for targets, found in ((["qproj", "vproj"], "no module of that name"), (["model"], "not a layer LoRA can wrap")):
        args = lm.parse_args(
            [
                "--model_name_or_path",
                str(tiny_lm["model"]),
                "--train_file",
                "t.jsonl",
                "--lora_r",
                "4",
                "--lora_target_modules",
                *targets,
            ]
        )
        model, _ = lm.load_model_and_tokenizer(args)
        with pytest.raises(RecipeError) as err:
            lm.build_model(args, model)
        assert f"--lora_target_modules {' '.join(targets)}: {found}" in str(err.value)
        layers = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"  # the output head is all-linear's too
        assert f"name its linear layers ({layers}) or pass all-linear" in str(err.value)


def test_lora_targets_a_gpt2_lacks_are_named_with_its_conv1d_layers(tiny_lm, tmp_path):
    """GPT-2's linear layers are transformers' Conv1D, which LoRA wraps as well."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    lm = RECIPES["lm_finetune"]
    base = ["--model_name_or_path", str(tmp_path / "gpt2"), "--train_file", "t.jsonl", "--lora_r", "4"]
    args = lm.parse_args([*base, "--lora_target_modules", "q_proj"])
    with pytest.raises(RecipeError, match=r"name its linear layers \(c_attn, c_fc, c_proj\) or pass all-linear"):
        lm.build_model(args, lm.load_model_and_tokenizer(args)[0])


@pytest.fixture
def accelerate_state():
    """What a recipe has made by the time it loads a model (its logger needs it), whatever ran before."""
    from accelerate import PartialState

    PartialState()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("num_hiden_layers=3", "config has no num_hiden_layers (did you mean num_hidden_layers?)"),
        ("hidden_size=abc", "invalid literal for int()"),
        ("num_attention_heads=3", "does not run (The hidden size (64) is not a multiple of the number of attention"),
        ("hidden_size=-1", "does not run (The hidden size (-1) is not a multiple"),
        # transformers' own check, which save_pretrained runs: a run used to train, then fail to save
        ("hidden_size=30", "(The hidden size (30) is not a multiple of the number of attention heads (4))"),
        ("vocab_size=-3", "does not run (RuntimeError: Trying to create tensor with negative dimension"),
        ("hidden_act=swishy", "does not run (KeyError: 'swishy')"),
        ("architectures=x", "(TypeError: You can only update int, float, bool or string values in the config"),
        # passed by config.validate and from_config, met at the first step (a forward on the meta device finds them)
        ("num_key_value_heads=3", "does not run (RuntimeError: "),  # torch's words differ by version
        ("hidden_size=0", "does not run (ValueError: it holds no weights)"),  # trained nothing at ln(vocab) before
    ],
)
def test_config_overrides_the_model_rejects(tiny_lm, accelerate_state, overrides, message):
    zero = RECIPES["zero"]
    args = zero.parse_args(
        ["--config_name", str(tiny_lm["model"]), "--config_overrides", overrides, "--train_file", "t.jsonl"]
    )
    with pytest.raises(RecipeError) as err:
        zero.build_model(args)
    assert str(err.value).startswith(f"--config_overrides {overrides}: ") and message in str(err.value), str(err.value)


def test_valid_overrides_of_a_model_the_meta_device_cannot_run_build_it(tiny_lm, accelerate_state, tmp_path):
    """A Mixtral's experts run a kernel that wants bf16 on the meta device: the probe proves nothing there (the
    config without the overrides fails it too), and overrides that are right build the model."""
    from transformers import AutoConfig, AutoTokenizer, MixtralConfig

    folder = tmp_path / "moe"
    vocab = AutoConfig.from_pretrained(tiny_lm["model"]).vocab_size
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    MixtralConfig(vocab_size=vocab, num_local_experts=2, num_experts_per_tok=1, **sizes).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_lm["model"]).save_pretrained(folder)
    zero = RECIPES["zero"]
    args = ["--config_name", str(folder), "--config_overrides", "num_hidden_layers=1", "--train_file", "t.jsonl"]
    model, _ = zero.build_model(zero.parse_args(args))
    assert type(model).__name__ == "MixtralForCausalLM" and model.config.num_hidden_layers == 1


def test_config_overrides_that_work_build_the_model(tiny_lm, accelerate_state):
    zero = RECIPES["zero"]
    args = zero.parse_args(
        [
            "--config_name",
            str(tiny_lm["model"]),
            "--config_overrides",
            "hidden_size=32,num_hidden_layers=1",
            "--train_file",
            "t.jsonl",
        ]
    )
    model, _ = zero.build_model(args)
    assert model.config.hidden_size == 32 and len(model.model.layers) == 1


# --- images -------------------------------------------------------------------------------------


def test_16_bit_images_are_scaled_not_clipped(digits, tmp_path):
    """PIL's convert("RGB") clips 16-bit greyscale at 255: the digits would become 2 grey levels."""
    originals = sorted(digits["train"].rglob("*.png"))[:20]
    for original in originals:
        pixels = np.asarray(Image.open(original).convert("L"))
        deep = tmp_path / original.name
        Image.fromarray(pixels.astype(np.uint16) * 257).save(deep)  # the 16-bit copy a scanner would write
        assert Image.open(deep).mode == "I;16"
        assert len(np.unique(np.asarray(Image.open(deep).convert("RGB")))) <= 2 < len(np.unique(pixels))
        np.testing.assert_array_equal(np.asarray(vision.load_image(deep)), np.asarray(vision.load_image(original)))


def png_claiming(tmp_path, width, height):
    """A tiny PNG whose header claims width x height pixels: PIL checks the size before decoding."""
    Image.new("L", (1, 1)).save(tmp_path / "one.png")
    data = bytearray((tmp_path / "one.png").read_bytes())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return write(tmp_path / f"{width}x{height}.png", bytes(data))


@pytest.mark.parametrize("side", [10_000, 20_000])  # above PIL's warning, and above its refusal
def test_an_image_too_large_to_decode(tmp_path, side):
    path = png_claiming(tmp_path, side, side)
    with pytest.raises(RecipeError) as err:
        vision.load_image(path)
    assert str(err.value).startswith(f"{path}: too large to decode (Image size ({side * side} pixels) exceeds limit")
    assert "shrink it first" in str(err.value)


def test_32_bit_images_are_refused(tmp_path):
    path = tmp_path / "deep.tif"
    Image.fromarray(np.arange(64, dtype=np.int32).reshape(8, 8) * 1000).save(path)
    with pytest.raises(RecipeError) as refused:
        vision.load_image(path)
    assert refused.value.subject == str(path) and "(PIL mode I)" in refused.value.problem


def image_folder(root, classes, images=2):
    root.mkdir(parents=True, exist_ok=True)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(images):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / name / f"{i}.png")
    return root


@pytest.mark.parametrize(
    "train, val, message",
    [
        (["a", "b"], ["a", "b", "c"], "has class folders that --train_dir {train} lacks ('c'); give both the same"),
        (["a"], ["a"], "has 1 class folder; a classifier needs two or more"),
        (["a", "b"], [], "--val_dir {val}: Couldn't find any class folder in {val}"),
    ],
)
def test_image_folders_whose_classes_do_not_fit(tmp_path, train, val, message):
    cifar = RECIPES["cifar"]
    args = cifar.parse_args(
        [
            "--dataset",
            "imagefolder",
            "--train_dir",
            str(image_folder(tmp_path / "train", train)),
            "--val_dir",
            str(image_folder(tmp_path / "val", val)),
        ]
    )
    with pytest.raises(RecipeError) as err:
        vision.load_images(args)
    assert message.format(train=tmp_path / "train", val=tmp_path / "val") in str(err.value), str(err.value)


def test_a_validation_folder_is_labelled_by_the_training_classes(tmp_path, caplog):
    """A small validation set may lack classes, or hold one's folder empty; its labels are the training set's
    indices, its folder names matched in Unicode NFC (a copy from macOS writes NFD). Files that are not images are
    skipped, and said so; a GIF is an image."""
    from accelerate import PartialState

    PartialState()
    train = image_folder(tmp_path / "train", ["a", "b", "caf\u00e9", "d"])
    val = image_folder(tmp_path / "val", ["cafe\u0301", "d"])  # NFD; no a or b
    (val / "b").mkdir()
    (val / "d" / "1.png").rename(val / "d" / "1.GIF")
    (val / "d" / "notes.txt").write_text("not an image")
    argv = ["--dataset", "imagefolder", "--train_dir", str(train), "--val_dir", str(val)]
    train_set, val_set, *_, num_classes = vision.load_images(RECIPES["cifar"].parse_args(argv))
    assert num_classes == 4 and train_set.classes == ["a", "b", "caf\u00e9", "d"]
    assert sorted((Path(p).relative_to(val).as_posix(), c) for p, c in val_set.samples) == [
        ("cafe\u0301/0.png", 2), ("cafe\u0301/1.png", 2), ("d/0.png", 3), ("d/1.GIF", 3),
    ]  # fmt: skip
    assert f"--val_dir {val}: skipped 1 .txt, not images (" in caplog.text
    assert f"--val_dir {val} has no image of 2 class(es) (a, b)" in caplog.text
    assert "outside the class folders" not in caplog.text
    shutil.copy(train / "a" / "0.png", train / "stray.png")  # ImageFolder reads class folders alone
    vision.load_images(RECIPES["cifar"].parse_args(argv))
    assert f"--train_dir {train}: skipped 1 file(s) outside the class folders, of no class, such as stray.png" in (
        caplog.text
    )
    for name in ("0.png", "1.GIF"):  # a class whose files are none of them images
        (val / "d" / name).unlink()
    (val / "cafe\u0301" / "0.png").rename(val / "cafe\u0301" / "0.heic-not")
    (val / "cafe\u0301" / "1.png").unlink()
    with pytest.raises(RecipeError) as refused:
        vision.load_images(RECIPES["cifar"].parse_args(argv))
    assert refused.value.subject == "--val_dir"
    (train / "a" / "0.png").rename(train / "a" / "0.svg")
    (train / "a" / "1.png").unlink()
    with pytest.raises(RecipeError) as err:
        vision.load_images(RECIPES["cifar"].parse_args(argv))
    assert f"--train_dir {train}: Found no valid file for the classes a (skipped: 1 .svg); --dataset" in str(err.value)


def test_a_damaged_local_cifar_copy_is_said_as_damaged(tmp_path, monkeypatch):
    """torchvision checks the files' checksums and else downloads: offline, a damaged copy is not a missing one, and
    --data_dir at the batches folder itself names the folder holding it."""
    from accelerate import PartialState

    PartialState()
    for key, value in NO_NETWORK.items():
        monkeypatch.setenv(key, value)
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    (batches / "data_batch_1").write_bytes(b"not a batch")
    for data_dir, said in ((tmp_path, f"cifar10 is damaged or incomplete in {batches} and could not be downloaded"),
                           (batches, "pass --data_dir (the folder holding cifar-10-batches-py), or")):  # fmt: skip
        with pytest.raises(RecipeError) as err:
            vision.load_images(RECIPES["cifar"].parse_args(["--data_dir", str(data_dir)]))
        assert said in str(err.value)
    assert [p.name for p in batches.iterdir()] == ["data_batch_1"] and list(tmp_path.iterdir()) == [batches]


def test_hidden_entries_of_an_image_folder_are_no_data(tmp_path):
    """Jupyter's .ipynb_checkpoints (with an image in it), .git, macOS's ._ files: neither classes nor images."""
    root = image_folder(tmp_path / "train", ["a", "b", ".ipynb_checkpoints", ".git"])
    (root / "a" / "._0.png").write_bytes(b"\0\5\x16\7 AppleDouble")
    (root / "b" / ".hidden").mkdir()
    shutil.copy(root / "b" / "0.png", root / "b" / ".hidden" / "0.png")
    folder = vision.ImageFolder(root)
    assert folder.classes == ["a", "b"] and len(folder) == 2 * len(list((root / "a").glob("[0-9].png")))


def test_an_image_folder_reached_twice_through_a_link_is_refused(tmp_path):
    """A link to a folder above it (a loop torchvision follows 40 times) or a second class linked to a first: its
    images would be trained several times, under other classes."""
    cifar = RECIPES["cifar"]
    for name, target in (("loop", ".."), ("c", "a")):
        root = tmp_path / name
        train, val = image_folder(root / "train", ["a", "b"]), image_folder(root / "val", ["a", "b"])
        (train / ("b" if name == "loop" else "") / ("up" if name == "loop" else "c")).symlink_to(target)
        argv = ["--dataset", "imagefolder", "--train_dir", str(train), "--val_dir", str(val)]
        with pytest.raises(RecipeError) as err:
            vision.load_images(cifar.parse_args(argv))
        twice = f"{train}/b/up/a is {train}/a again" if name == "loop" else f"{train}/c is {train}/a again"
        assert f"--train_dir {train}: {twice}, through a symbolic link" in str(err.value), str(err.value)


# --- the whole path, as users launch it ---------------------------------------------------------


@pytest.mark.slow
def test_launched_data_and_model_mistakes_give_one_line_exit_2_and_no_output(tiny_lm, tmp_path):
    """A malformed JSON line through launch.sh (2 processes: still one line, and the process that
    waits for the first one's data does not crash), a truncated safetensors and an out-of-range
    argument through python."""
    bad = write(tmp_path / "bad.jsonl", tiny_lm["train"].read_text() + '{"text": "one two"\n')
    model = tmp_path / "model"
    shutil.copytree(tiny_lm["model"], model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    recipe = REPO / "recipes" / "lm_finetune.py"
    cases = [
        (
            [REPO / "launch.sh", "lm_finetune", *lm_args(tiny_lm, tmp_path / "a", "--train_file", bad)],
            f"--train_file {bad}: cannot be read as json (ArrowInvalid: JSON parse error",
        ),
        (
            [BIN / "python", recipe, *lm_args(tiny_lm, tmp_path / "b", "--model_name_or_path", model)],
            f"--model_name_or_path {model}: its safetensors weights are damaged",
        ),
        (
            [BIN / "python", recipe, *lm_args(tiny_lm, tmp_path / "c", "--num_train_epochs", "0")],
            "--num_train_epochs: 0 is out of range",
        ),
    ]
    for (cmd, message), out in zip(cases, "abc"):
        proc = run(cmd, check=False, timeout=300)
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
        assert proc.returncode == 2 or cmd[0] != BIN / "python", proc.returncode
        assert proc.returncode != 0, proc.returncode
        # no process of the recipe printed a traceback (the launcher's own report of the exit is launch.sh's)
        frames = [f'File "{REPO}/recipes', f'File "{REPO}/common']
        assert not any(frame in proc.stderr for frame in frames), proc.stderr[-3000:]
        assert not (tmp_path / out).exists()


# --- weights ------------------------------------------------------------------------------------


def test_a_timm_model_without_timm_installed_is_one_line_naming_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # what `import timm` meets where it is not installed
    line = parse_error(capsys, "cifar", ["--model", "timm/resnet18"])
    assert line == "error: --model timm/resnet18 is a timm model, and timm is not installed: pip install -e '.[timm]'"
    with pytest.raises(RecipeError, match=r"timm is not installed: pip install -e '\.\[timm\]'"):
        vision.new_model("timm/resnet18", 10)


class _Code:  # a pickle that runs code when loaded
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory):
    import torch
    import torchvision
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("weights")
    resnet50 = torchvision.models.resnet50().state_dict()
    save_file({k: v.contiguous() for k, v in resnet50.items()}, root / "resnet50.safetensors")
    resnet18 = torchvision.models.resnet18(num_classes=10).state_dict()
    torch.save({f"module.{k}": v for k, v in resnet18.items()}, root / "ddp.pt")  # as a DDP-wrapped model names them
    save_file(
        {k: v.contiguous() for k, v in resnet18.items() if not k.startswith("fc.")}, root / "no_head.safetensors"
    )
    write(root / "garbage.pt", np.random.default_rng(0).bytes(4096))
    write(root / "garbage.safetensors", np.random.default_rng(0).bytes(4096))
    torch.save({"conv1.weight": _Code()}, root / "code.pt")
    torch.save([torch.zeros(3)], root / "list.pt")
    torch.save({"model": resnet18, "epoch": 3}, root / "nested.pt")  # a training checkpoint of the user's
    torch.save({**resnet18, "layer3.0.conv1.weight": resnet18["layer3.0.conv1.weight"] / 0}, root / "nan.pt")
    group = vision.set_norm_layer(torchvision.models.resnet18(num_classes=10), "group").state_dict()
    save_file({k: v.contiguous() for k, v in group.items()}, root / "group.safetensors")  # --norm_layer group's
    (root / "folder.pt").mkdir()
    return root


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "resnet50.safetensors",
            "does not fit --model resnet18 (165 tensor(s) not in the model, such as layer1.0.bn3.bias; "
            "23 tensor(s) of another shape, such as layer1.0.conv1.weight (64, 64, 1, 1) in the file, "
            "(64, 64, 3, 3) here); "
            "pass weights of that architecture",
        ),
        (
            "garbage.pt",
            "not a file of weights (not plain tensors); pass a .safetensors file or a state dict saved with",
        ),
        ("garbage.safetensors", "not a file of weights (Error while deserializing header"),
        ("code.pt", "not a file of weights (not plain tensors)"),
        ("list.pt", "not a file of weights (not plain tensors)"),
        ("folder.pt", "is a directory; pass a file in it"),
        ("nan.pt", "1 tensor(s) hold NaN or inf, such as layer3.0.conv1.weight; pass weights of a run that did not"),
        ("missing.pt", "no such file"),
    ],
)
def test_pretrained_path_that_is_not_weights_of_the_model_is_one_line(weight_files, capsys, name, message):
    from accelerate import PartialState

    PartialState()
    cifar = RECIPES["cifar"]
    args = cifar.parse_args(["--model", "resnet18", "--pretrained_path", str(weight_files / name)])
    with pytest.raises(RecipeError) as err:
        vision.build_model(args, 10, on_gpu=False)
    assert str(err.value).startswith(f"--pretrained_path {weight_files / name}: ") and message in str(err.value)
    assert "code ran" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, norm, message",
    [
        ("group.safetensors", "batch", "40 tensor(s) missing, such as bn1.running_mean); its norm layers are "
         "GroupNorm: pass --norm_layer group"),
        ("ddp.pt", "group", "such as bn1.running_mean); its norm layers are BatchNorm: pass --norm_layer batch"),
    ],
)  # fmt: skip
def test_pretrained_path_of_other_norm_layers_names_the_norm_layer(weight_files, name, norm, message):
    from accelerate import PartialState

    PartialState()
    args = RECIPES["cifar"].parse_args(
        ["--model", "resnet18", "--norm_layer", norm, "--pretrained_path", str(weight_files / name)]
    )
    with pytest.raises(RecipeError, match=re.escape(message)):
        vision.build_model(args, 10, on_gpu=False)


@pytest.mark.parametrize(
    "name, norm",
    [("ddp.pt", "batch"), ("no_head.safetensors", "batch"), ("group.safetensors", "group"), ("nested.pt", "batch")],
)
def test_pretrained_path_takes_a_ddp_state_dict_or_one_without_a_head(weight_files, name, norm):
    import torch
    from accelerate import PartialState
    from safetensors.torch import load_file

    PartialState()
    cifar = RECIPES["cifar"]
    args = cifar.parse_args(
        ["--model", "resnet18", "--norm_layer", norm, "--pretrained_path", str(weight_files / name)]
    )
    model = vision.build_model(args, 10, on_gpu=False)  # a run with --norm_layer group fine-tuned with it
    saved = load_file(weight_files / name) if name.endswith(".safetensors") else torch.load(weight_files / name)
    saved = {k.removeprefix("module."): v for k, v in saved.get("model", saved).items()}
    loaded = model.state_dict()
    assert set(saved) <= set(loaded) and all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_pretrained_path_takes_torchvisions_googlenet_file_with_its_auxiliary_heads(tmp_path):
    """torchvision's GoogLeNet and Inception files hold auxiliary heads, which the models here are built without (as
    --pretrained drops them): the rest loads."""
    import torch
    import torchvision
    from accelerate import PartialState

    PartialState()
    published = torchvision.models.googlenet(aux_logits=True, init_weights=True).state_dict()  # its file's layout
    torch.save(published, tmp_path / "googlenet.pth")
    args = RECIPES["cifar"].parse_args(["--model", "googlenet", "--pretrained_path", str(tmp_path / "googlenet.pth")])
    loaded = vision.build_model(args, 10, on_gpu=False).state_dict()
    assert any(k.startswith("aux1.") for k in published) and not any(k.startswith("aux") for k in loaded)
    assert all(torch.equal(loaded[k], v) for k, v in published.items() if k in loaded and not k.startswith("fc."))


def test_the_zero_recipe_without_deepspeed_installed_trains_without_its_memory_estimate(monkeypatch, caplog):
    """zero.py also trains under DDP and FSDP: DeepSpeed missing is an info line and no estimate, not
    ModuleNotFoundError from the estimate."""
    import logging

    import torch
    from accelerate import Accelerator

    zero = load_recipe("zero")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert zero.memory_estimates(Accelerator(cpu=True), model)["parameters"] == 20  # installed here
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")] + ["deepspeed"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed: importing it raises ImportError
    with caplog.at_level(logging.INFO, logger="recipes"):
        assert zero.memory_estimates(Accelerator(cpu=True), model) == {}
    assert "no memory estimate: DeepSpeed is not installed (pip install -e '.[deepspeed]' adds it)" in caplog.text


ENTRY_POINTS = [  # every script a user runs besides the recipes (whose parse the tests above call)
    "scripts/doctor.py", "scripts/selftest.py", "scripts/make_digits.py", "scripts/make_tiny_lm.py",
    *(f"benchmarks/{p.name}" for p in sorted((REPO / "benchmarks").glob("*.py")) if p.name != "benchlib.py"),
]  # fmt: skip


def test_every_entry_point_parses_with_the_recipes_parser_and_checks_every_number(capsys, monkeypatch):
    """The doctor, the selftest, the benchmarks and the data scripts take their options through common.args's
    parser, as the recipes do: a number given as nan (or 0, or -1 where a count must be positive) is one line naming
    the option and exit 2 before anything starts (the doctor's nan failed inside the all-reduce, blamed on the
    network). No script builds a parser of its own, and a bare int or float (which lets nan through) is refused by
    the parser itself, so a new script cannot skip the checks."""
    from common.args import TYPES, ArgumentParser

    for path in [*REPO.glob("recipes/*.py"), *REPO.glob("scripts/*.py"), *REPO.glob("benchmarks/*.py")]:
        assert "argparse.ArgumentParser(" not in path.read_text(), f"{path.name} builds a parser of its own"
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    checked = []
    for entry in ENTRY_POINTS:
        spec = importlib.util.spec_from_file_location(f"entry_{Path(entry).stem}", REPO / entry)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parser = module.build_parser()
        assert isinstance(parser, ArgumentParser), entry
        needed = [word for a in parser._actions if a.required for word in (*a.option_strings[:1], "x")]
        parser.parse_args(needed)  # what it requires, and its defaults, parse
        numbers = [a for a in parser._actions if a.option_strings and a.type in TYPES]  # registered by name
        for action in numbers:
            for bad in ("nan", "-1"):
                with pytest.raises(SystemExit) as exit_:
                    parser.parse_args([*needed, action.option_strings[0], bad])
                lines = error_lines(capsys.readouterr().err)
                assert exit_.value.code == 2 and len(lines) == 1, (entry, action.option_strings, lines)
                assert re.match(rf"error: argument {action.option_strings[0]}: '?{bad}'? is ", lines[0]), lines
            checked.append(f"{Path(entry).stem} {action.option_strings[0]}")
    assert {"doctor --timeout", "doctor --iters", "selftest --num_processes", "prepare --sizes_mb"} <= set(checked)
    bare = ArgumentParser()
    bare.add_argument("--steps", type=int)
    with pytest.raises(TypeError, match="--steps: a bare int or float takes nan, inf and any sign"):
        bare.parse_args([])


def test_run_all_refuses_an_option_a_benchmark_would_refuse_before_running_any(tmp_path, monkeypatch, capsys):
    """run_all passes options on to each benchmark: one that a benchmark does not take (or a bad value) is its one
    line before any of them runs (it was said by the first benchmark to meet it, with a usage block and a second
    line), and nothing is written."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("run_all", REPO / "benchmarks" / "run_all.py")
    spec.loader.exec_module(run_all := importlib.util.module_from_spec(spec))
    for extra, said in ((["--bogus", "1"], "unrecognized arguments: --bogus 1"),
                        (["--repeats", "0"], "argument --repeats: 0 is out of range")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            run_all.main(["--out", str(tmp_path / "out"), "--only", "overhead", "lm", *extra])
        lines = error_lines(capsys.readouterr().err)
        assert exit_.value.code == 2 and len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "out").exists()
