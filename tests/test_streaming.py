"""--streaming: the LM recipes train on blocks made as they read the data (datasets streaming), never prepared on disk.
N processes of b train what one of N x b trains, a stop saves a checkpoint, and a resume on another number of
processes continues at the first block not trained, on the uninterrupted run's weights."""

import gzip
import json
import shutil
from collections import Counter

import pytest
from accelerate import PartialState
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    REPO,
    error_lines,
    interrupt,
    lm_args,
    load_recipe,
    preempted_at,
    results,
    run,
    samples,
    update_distance,
    user_env,
)

from common.data import StreamOfBlocks, fingerprint
from common.runtime import RecipeError
from common.text import load_raw_datasets, load_tokenizer, streamed_data, tokenize_and_pack

RECIPE = REPO / "recipes" / "lm_finetune.py"
STREAM = ["--streaming", "--max_train_steps", "10", "--gradient_accumulation_steps", "2", "--logging_steps", "1"]


def parse(lm, *extra, data=None):
    PartialState()  # which the recipes' logger needs
    return load_recipe("lm_finetune").parse_args([str(a) for a in lm_args(lm, "unused", *extra, data=data)])


def blocks(stream: StreamOfBlocks, epoch=0, start=0) -> list:
    """The stream's blocks of `epoch` from its sample `start` on, as the loader reads them."""
    stream.set_epoch(epoch)
    stream.resume_at(epoch, start)
    return [list(map(int, block["input_ids"])) for block in stream]


RUN = [*STREAM, "--checkpointing_steps", "1", "--max_eval_samples", "5"]


@pytest.fixture(scope="module")
def one_process(tiny_lm, tmp_path_factory):
    """One process x 24 x 2 accumulation, 10 steps, uninterrupted: the run the others must reproduce."""
    one = tmp_path_factory.mktemp("stream") / "one"
    run([BIN / "python", RECIPE, *lm_args(tiny_lm, one, *RUN, "--per_device_train_batch_size", "24")])
    return one


@pytest.mark.slow
def test_a_stream_trains_in_two_processes_what_one_trains_and_a_stop_resumes_on_three_to_the_same_weights(
    one_process, tiny_lm, tmp_path
):
    """Through launch.sh 2 processes x 12 x 2 stopped by SIGTERM in the stream's second pass, resumed with `latest`
    on 3 processes x 8 x 2: the loss of one process x 24 x 2 at every step (the 2-process steps before the stop as
    well as the 3-process ones after it) and its weights; the held-out set of --max_eval_samples 5 counted once on
    every layout."""
    args, one, resumed = RUN, one_process, tmp_path / "resumed"

    def launch(processes, batch, *extra):
        cmd = [REPO / "launch.sh", "lm_finetune", "--num_processes", str(processes)]
        return cmd + lm_args(tiny_lm, resumed, *args, "--per_device_train_batch_size", str(batch), *extra)

    proc, _ = interrupt(launch(2, 12), user_env(), resumed, after_step=4)
    stop = preempted_at(proc.stderr)
    assert stop is not None and 5 <= stop < 10, proc.stderr[-3000:]
    # the stream's 196 blocks are 4 steps of 48: its end is known when a step finds too few (after step 8, in step 9)
    epoch = 1 if stop <= 8 else 2
    state = json.loads((resumed / f"checkpoint-{stop}" / "trainer_state.json").read_text())
    assert (state["epoch"], state["samples_in_epoch"]) == (epoch, (stop - 4 * epoch) * 48)
    proc = run(launch(3, 8, "--resume_from_checkpoint", "latest"))
    assert "2 x 12 x 2 -> 3 x 8 x 2, effective batch 48 -> 48" in proc.stderr
    assert f"continuing epoch {epoch} at sample {(stop - 4 * epoch) * 48}" in proc.stderr
    a, b = results(one), results(resumed)
    assert b["world_size"] == 3 and a["steps"] == b["steps"] == 10
    assert [e["samples_seen"] for e in b["log_history"]] == [48 * step for step in range(1, 11)]
    for after, before in zip(b["log_history"], a["log_history"], strict=True):
        assert after["train_loss"] == pytest.approx(before["train_loss"], rel=1e-5)
    assert a["log_history"][-1]["train_loss"] < a["log_history"][0]["train_loss"] * 0.7  # it learns
    assert update_distance(resumed, one, tiny_lm["model"]) < 1e-5
    assert a["eval_tokens"] == b["eval_tokens"] == 5 * 31  # 5 blocks (none repeated to even out), 31 targets each
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("data_format", ["text", "chat"])
def test_a_stream_makes_the_blocks_preparation_makes_in_an_order_of_seed_and_epoch(tiny_lm, tmp_path, data_format):
    """Read in file order, a stream's blocks are the prepared ones (each 1000 documents packed alone; chat prompts
    masked); shuffled, each epoch packs the documents in another order, the same at every reading, and a resume at
    sample k is that order from k on."""
    data = ["--train_file", tiny_lm["chat" if data_format == "chat" else "train"], "--validation_file"]
    data += [tiny_lm["chat" if data_format == "chat" else "validation"], "--data_format", data_format]
    args = parse(tiny_lm, "--streaming", "--max_train_steps", "1", data=data)
    tokenizer, _ = load_tokenizer(args)
    stream, held_out = streamed_data(args, tokenizer, 32)
    raw = load_raw_datasets(train_file=data[1], validation_file=data[3])
    made = tokenize_and_pack(raw, tokenizer, data_format=data_format, text_column="text", block_size=32)
    stream.shuffle_buffer = 0
    in_order = blocks(stream)
    assert in_order == [list(map(int, b)) for b in made["train"]["input_ids"]]
    labels = [list(map(int, block["labels"])) for block in stream]
    assert labels == [list(map(int, b)) for b in made["train"]["labels"]]
    assert held_out["validation"]["input_ids"] == [list(map(int, b)) for b in made["validation"]["input_ids"]]
    stream.shuffle_buffer = 10_000
    first, again, second = blocks(stream, 0), blocks(stream, 0), blocks(stream, 1)
    assert first == again and first != second and first != in_order
    assert len(first) == len(second) == len(in_order)  # the same documents, packed in another order:
    tokens = [Counter(t for block in made for t in block) for made in (first, second, in_order)]
    assert all(sum(((a - b) + (b - a)).values()) < 2 * 32 for a, b in zip(tokens, tokens[1:]))  # ends dropped
    assert blocks(stream, 1, start=7) == second[7:]


def test_a_streams_checkpoint_knows_its_training_data_not_its_held_out_data(tiny_lm, tmp_path):
    """The identity a checkpoint keeps of a stream (common.data.fingerprint) is its training file's content: one word
    changed far into it is another identity; another --validation_file is the same."""
    identity = lambda *data: fingerprint(  # noqa: E731
        streamed_data((args := parse(tiny_lm, *STREAM, data=list(data))), load_tokenizer(args)[0], 32)[0]
    )
    train, validation = tiny_lm["train"], tiny_lm["validation"]
    changed, other = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    lines = train.read_text().splitlines()
    changed.write_text("\n".join([*lines[:-1], lines[-1].replace("one", "two", 1)]) + "\n")
    other.write_text("\n".join(validation.read_text().splitlines()[:20]) + "\n")
    base = identity("--train_file", train, "--validation_file", validation)
    assert identity("--train_file", changed, "--validation_file", validation) != base
    assert identity("--train_file", train, "--validation_file", other) == base


def stream_error(capsys, lm, tmp_path, *extra, data=None):
    """The one error line a --streaming run's arguments and first reading give, in this process."""
    try:
        args = parse(lm, *STREAM, *extra, data=data)
        streamed_data(args, load_tokenizer(args)[0], 32)
    except RecipeError as err:
        return f"error: {err}"
    except SystemExit as err:
        assert err.code == 2
        (line,) = error_lines(capsys.readouterr().err)
        return line
    raise AssertionError("no error")


def test_what_streaming_cannot_do_is_one_line_naming_the_fix(tiny_lm, tmp_path, capsys):
    """Without --max_train_steps (a stream has no length), without a held-out file (a stream cannot hold a share out),
    with the options of prepared data, and with a file that is not its format: each one line naming what to do."""
    line = None
    try:
        load_recipe("lm_finetune").parse_args([str(a) for a in lm_args(tiny_lm, "unused", "--streaming")])
    except SystemExit:
        (line,) = error_lines(capsys.readouterr().err)
    assert line == (
        "error: --streaming reads the data as it trains, so no epoch length is known to plan by: pass "
        "--max_train_steps (the stream starts again when it ends)"
    )
    line = stream_error(capsys, tiny_lm, tmp_path, data=["--train_file", tiny_lm["train"]])
    assert line == (
        "error: --streaming cannot hold a share of a stream out for validation: pass --validation_file (held-out "
        "rows in the format of --train_file), or drop --streaming"
    )
    line = stream_error(capsys, tiny_lm, tmp_path, "--num_train_epochs", "3")
    assert line == (
        "error: --num_train_epochs would do nothing with --streaming (a stream has no length: --max_train_steps sets "
        "the run's): drop it, or drop --streaming"
    )
    line = stream_error(capsys, tiny_lm, tmp_path, "--prepare_only")
    assert line == (
        "error: --prepare_only would do nothing with --streaming (its blocks are made as the run reads the data, "
        "never prepared): drop it, or drop --streaming"
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "one two"}\n{"text": "three\n')
    line = stream_error(capsys, tiny_lm, tmp_path, data=["--train_file", broken, "--validation_file", broken])
    assert line.startswith(f"error: --train_file {broken}: cannot be read as json (") and line.endswith(
        'each line must be one JSON object, such as {"text": "..."}'
    )
    line = stream_error(capsys, tiny_lm, tmp_path, "--text_column", "body")
    assert line == f"error: --train_file {tiny_lm['train']}: --text_column body: not in the data (columns: text); " \
        "pass --text_column text"  # fmt: skip


@pytest.mark.slow
def test_a_bad_row_deep_in_a_stream_and_a_stream_shorter_than_a_step_are_one_line(tiny_lm, tmp_path):
    """What only reading the stream finds, in the loader's worker as the run trains, is the worker's one line and
    exit 2, with no model saved; so is a stream too short for one step."""
    bad = tmp_path / "bad.jsonl"
    lines = tiny_lm["train"].read_text().splitlines()
    bad.write_text("\n".join([*lines[:450], '{"text": 7}', *lines[450:]]) + "\n")
    out = tmp_path / "bad"
    data = ["--train_file", bad, "--validation_file", tiny_lm["validation"]]
    proc = run([BIN / "python", RECIPE, *lm_args(tiny_lm, out, *STREAM, data=data)], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: --train_file {bad}: "), line  # the subject: the option and its file
    assert "Traceback" not in proc.stderr and not (out / "model.safetensors").exists()
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[:20]) + "\n")
    data = ["--train_file", short, "--validation_file", tiny_lm["validation"]]
    proc = run([BIN / "python", RECIPE, *lm_args(tiny_lm, tmp_path / "short", *STREAM, data=data)], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)  # one line naming the options that make a step smaller
    assert "--per_device_train_batch_size" in line and "--gradient_accumulation_steps" in line, line


def test_a_stream_resumed_where_it_ended_starts_its_next_pass(one_process, tiny_lm, tmp_path):
    """4 steps of 48 leave 4 of the stream's 196 blocks: a checkpoint there (the uninterrupted run's checkpoint-4)
    does not know the stream has ended. Resumed, the run finds the end and trains the next passes, as the run of 10
    steps that never stopped did: its loss at every step and its weights."""
    args = [*RUN, "--per_device_train_batch_size", "24"]  # one_process's
    out = tmp_path / "run"
    shutil.copytree(one_process / "checkpoint-4", out / "checkpoint-4")
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert (state["epoch"], state["samples_in_epoch"]) == (0, 192)
    cmd = [BIN / "python", RECIPE, *lm_args(tiny_lm, out, *args)]
    run([*cmd, "--resume_from_checkpoint", out / "checkpoint-4"])
    expected, history = results(one_process)["log_history"], results(out)["log_history"]
    assert (
        [e["samples_seen"] for e in history] == [e["samples_seen"] for e in expected] == [48 * i for i in range(1, 11)]
    )
    for got, want in zip(history, expected, strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert update_distance(out, one_process, tiny_lm["model"]) < 1e-5
    # Finished: trained further by a larger --max_train_steps alone (--num_train_epochs does nothing on a stream)
    proc = run([*cmd, "--resume_from_checkpoint", "latest"])
    (done,) = [line for line in proc.stderr.splitlines() if line.startswith("done:")]
    assert f"pass --resume_from_checkpoint {out / 'checkpoint-10'} with a larger --max_train_steps; " in done, done
    other = tmp_path / "other.jsonl"
    other.write_text(tiny_lm["train"].read_text().replace("one", "two", 1))
    changed = [*cmd, "--max_train_steps", "12", "--resume_from_checkpoint", out / "checkpoint-10"]
    changed[changed.index("--train_file") + 1] = other
    proc = run(changed, check=False)
    (line,) = error_lines(proc.stderr)
    assert proc.returncode == 2 and line.startswith(
        f"error: checkpoint {out / 'checkpoint-10'} was written for other training data (another stream); this run "
        f"differs in --train_file {tiny_lm['train']} -> {other}; "
    ), line


@pytest.mark.slow
def test_zero_py_under_zero3_streams_chats_as_one_process_of_the_whole_batch_does(tiny_lm, tmp_path):
    """zero.py, 2 processes x 2 under ZeRO-3, streaming conversations (prompts masked, the loss weighted by target
    tokens): the losses and weights of lm_finetune.py in one process x 4 on the same stream, and its samples: the
    first held-out conversations of the stream to their last reply, completed by every process of the sharded model."""
    data = ["--train_file", tiny_lm["chat_varied"], "--validation_file", tiny_lm["chat"], "--data_format", "chat"]
    args = [*STREAM, "--gradient_accumulation_steps", "1", "--max_train_steps", "6", "--max_grad_norm", "0"]
    one, zero3 = tmp_path / "one", tmp_path / "zero3"
    run([BIN / "python", RECIPE, *lm_args(tiny_lm, one, *args, "--per_device_train_batch_size", "4", data=data)])
    cmd = [ACCELERATE_LAUNCH, "--config_file", REPO / "accelerate_configs" / "zero3.yaml"]
    cmd += ["--num_processes", "2", "--mixed_precision", "no", REPO / "recipes" / "zero.py"]
    run(cmd + lm_args(tiny_lm, zero3, *args, "--per_device_train_batch_size", "2", data=data))
    a, b = results(one), results(zero3)
    assert b["distributed_type"] == "DEEPSPEED" and b["world_size"] == 2 and b["steps"] == 6
    for got, want in zip(b["log_history"], a["log_history"], strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert update_distance(zero3, one, tiny_lm["model"]) < 1e-5
    assert a["eval_tokens"] == b["eval_tokens"] and b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    rows = samples(zero3)
    assert rows == samples(one) and [(r["step"], r["samples_seen"]) for r in rows] == [(6, 24)] * 4
    asked = [json.loads(line)["messages"][0]["content"] for line in tiny_lm["chat"].read_text().splitlines()[:4]]
    assert [r["prompt"] for r in rows] == [f"<|user|> {question} <|end|> <|assistant|> " for question in asked]


def test_a_folder_of_data_files_streams_and_is_known_by_its_files(tiny_lm, tmp_path):
    """--dataset_name <folder> with --streaming: its train and validation files stream, and the checkpoint's identity
    is their content: a changed byte in the train file is another identity."""
    folder = tmp_path / ".cache" / "corpus"  # under a cache folder, as data often is
    folder.mkdir(parents=True)
    shutil.copy(tiny_lm["train"], folder / "train.jsonl")
    shutil.copy(tiny_lm["validation"], folder / "validation.jsonl")
    args = parse(tiny_lm, *STREAM, data=["--dataset_name", folder])
    tokenizer, _ = load_tokenizer(args)
    stream, held_out = streamed_data(args, tokenizer, 32)
    stream.shuffle_buffer = 0
    raw = load_raw_datasets(train_file=tiny_lm["train"], validation_file=tiny_lm["validation"])
    made = tokenize_and_pack(raw, tokenizer, data_format="text", text_column="text", block_size=32)
    assert blocks(stream) == [list(map(int, b)) for b in made["train"]["input_ids"]]
    assert len(held_out["validation"]) == len(made["validation"])
    before = fingerprint(stream)
    text = (folder / "train.jsonl").read_text()
    (folder / "train.jsonl").write_text(text.replace("one", "two", 1))
    assert fingerprint(streamed_data(args, tokenizer, 32)[0]) != before


PLACED_STOP = """
import os, signal, sys
from accelerate import Accelerator
sys.path.insert(0, {repo!r})
from common import preemption
from common.text import load_tokenizer, streamed_data
sys.path.insert(0, {recipes!r})
import lm_finetune

accelerator = Accelerator(cpu=True)
preemption.install_stop_handlers()
preemption.StopOnSignal(accelerator)  # in the loop: a signal is recorded, the loop stops at a step
args = lm_finetune.parse_args({argv!r})
stream, _ = streamed_data(args, load_tokenizer(args)[0], 32)
made, read = stream.make_blocks, []

def make_blocks(batch):
    read.append(len(batch["text"]))
    if len(read) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return made(batch)

stream.make_blocks = make_blocks
try:
    stream.resume_at(0, 10**9)
except preemption.Preempted as stop:
    print(len(read), stop)
"""


@pytest.mark.slow
def test_a_stop_while_a_resumed_stream_is_placed_ends_the_run_there(tiny_lm, tmp_path):
    """Placing a resumed stream at its position reads the epoch up to it (minutes, deep into a large corpus): a stop
    signal that comes meanwhile ends the run at the next 1000 rows, nothing trained, not after the whole placing."""
    corpus = tmp_path / "train.jsonl"
    corpus.write_text(tiny_lm["train"].read_text() * 9)  # 5,400 rows: 6 batches of rows
    argv = [str(a) for a in lm_args(tiny_lm, tmp_path / "out", *STREAM)]
    argv[argv.index("--train_file") + 1] = str(corpus)
    script = PLACED_STOP.format(repo=str(REPO), recipes=str(REPO / "recipes"), argv=argv)
    proc = run([BIN / "python", "-c", script], env=user_env(ACCELERATE_USE_CPU="true"))
    assert proc.stdout.strip() == (
        "2 stopped by SIGTERM before training started; nothing to save, run it again (exit 75)"
    ), proc.stderr[-3000:]


def test_a_compressed_corpus_streams_and_prepares_as_the_plain_file_does(tiny_lm, tmp_path):
    """data.jsonl.gz (a corpus too large for the disk is often kept compressed): the blocks of data.jsonl, streamed and
    read whole."""
    packed = tmp_path / "train.jsonl.gz"
    packed.write_bytes(gzip.compress(tiny_lm["train"].read_bytes()))
    plain, compressed = [
        parse(tiny_lm, *STREAM, data=["--train_file", train, "--validation_file", tiny_lm["validation"]])
        for train in (tiny_lm["train"], packed)
    ]
    tokenizer, _ = load_tokenizer(plain)
    streams = [streamed_data(args, tokenizer, 32)[0] for args in (plain, compressed)]
    assert blocks(streams[0]) == blocks(streams[1]) and len(blocks(streams[0])) == 196
    read = [load_raw_datasets(train_file=t, validation_file=tiny_lm["validation"]) for t in (packed, tiny_lm["train"])]
    assert read[0]["train"]["text"] == read[1]["train"]["text"] and len(read[0]["train"]) == 600
