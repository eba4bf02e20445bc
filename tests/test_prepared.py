"""Prepared data (common.prepared): the LM recipes' text tokenized and packed once into a folder with a manifest,
reused by later runs and other nodes with the same inputs, refused for other inputs, resumed after an interruption,
prepared ahead with --prepare_only."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from accelerate import PartialState
from conftest import (
    BIN,
    REPO,
    error_lines,
    interrupt,
    lm_args,
    load_recipe,
    preempted_at,
    results,
    run,
    snapshot,
    update_distance,
    user_env,
)

from common import prepared
from common.data import fingerprint
from common.runtime import RecipeError
from common.text import load_raw_datasets, load_tokenizer, prepared_blocks, tokenize_and_pack

RECIPE = REPO / "recipes" / "lm_finetune.py"


def prepare_here(lm, folder, *extra, data=None):
    """prepared_blocks in this process, as lm_dataloaders calls it, into `folder`."""
    PartialState()  # which the recipes' logger needs
    args = load_recipe("lm_finetune").parse_args(
        [str(a) for a in lm_args(lm, "unused", "--prepared_data_dir", folder, *extra, data=data)]
    )
    tokenizer, _ = load_tokenizer(args)
    return prepared_blocks(args, tokenizer, 32)


def losses(res) -> list:
    return [entry["train_loss"] for entry in res["log_history"]]


def manifest(folder) -> dict:
    return json.loads((folder / prepared.MANIFEST).read_text())


def ids(data, split) -> list:
    return [list(map(int, block)) for block in data[split]["input_ids"]]


def test_a_small_corpus_is_one_chunk_packed_as_before_and_chunks_drop_less_than_a_block_each(tiny_lm, tmp_path,
                                                                                           monkeypatch):  # fmt: skip
    data, folder = prepare_here(tiny_lm, tmp_path / "one")
    tokenizer, _ = load_tokenizer(load_recipe("lm_finetune").parse_args([str(a) for a in lm_args(tiny_lm, "x")]))
    raw = load_raw_datasets(train_file=tiny_lm["train"], validation_file=tiny_lm["validation"])
    before = tokenize_and_pack(raw, tokenizer, data_format="text", text_column="text", block_size=32)
    for split in ("train", "validation"):
        assert ids(data, split) == ids(before, split)  # the blocks of one chunk are those of tokenize_and_pack
        assert len(manifest(folder)["splits"][split]["parts"]) == 1
    assert manifest(folder)["splits"]["train"]["blocks"] == len(before["train"]) == 196

    monkeypatch.setenv(prepared.CHUNK_BYTES_ENV, "4000")  # the 35 kB of text in 8 or more chunks
    chunked, folder = prepare_here(tiny_lm, tmp_path / "chunked")
    parts = len(manifest(folder)["splits"]["train"]["parts"])
    assert parts >= 8 and len(os.listdir(folder / "train")) == parts
    assert 196 - parts <= len(chunked["train"]) <= 196  # each chunk drops fewer than block_size tokens
    assert ids(chunked, "train")[:3] == ids(before, "train")[:3]


def test_prepared_data_that_is_damaged_or_not_prepared_data_is_one_line_and_left_alone(tiny_lm, tmp_path):
    folder = tmp_path / "prepared"
    prepare_here(tiny_lm, folder)
    arrow = next((folder / "train").rglob("data-*.arrow"))
    size = arrow.stat().st_size
    arrow.write_bytes(arrow.read_bytes()[: size // 2])
    cut = snapshot(folder)
    with pytest.raises(RecipeError) as err:
        prepare_here(tiny_lm, folder)
    relative = arrow.relative_to(folder)
    assert str(err.value) == (
        f"--prepared_data_dir {folder} is damaged ({relative} has {size // 2:,} bytes, not {size:,}); delete it to "
        "prepare it again, or pass another --prepared_data_dir"
    )
    assert snapshot(folder) == cut
    (folder / prepared.MANIFEST).write_text("{")  # a manifest cut short
    with pytest.raises(RecipeError, match=r"is damaged \(its manifest.json does not parse \(JSONDecodeError\)\)"):
        prepare_here(tiny_lm, folder)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(RecipeError, match="holds files that are not prepared data"):
        prepare_here(tiny_lm, other)
    assert snapshot(other) == {"todo.txt": snapshot(other)["todo.txt"]}
    empty = tmp_path / "empty"  # a folder made for it is used
    empty.mkdir()
    data, _ = prepare_here(tiny_lm, empty)
    assert len(data["train"]) == 196 and (empty / prepared.MANIFEST).is_file()


def test_tokenizing_uses_one_process_for_small_data_and_the_cpus_for_large():
    cpus = len(os.sched_getaffinity(0))
    assert prepared.default_workers(10 * 2**20) == 1
    assert prepared.default_workers(10 * 2**30) == min(cpus, prepared.MAX_WORKERS)


def byte_level_bpe(eos="<eos>", **kwargs):
    """A byte-level BPE of 300 tokens trained on a few sentences, with an EOS and a special token <sep>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs!"] * 50
    backend.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=[eos, "<sep>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, **kwargs)


TEXTS = ["The quick brown fox.", "  spaces  and\ttabs\n", "<sep> a special token <eos> inside", "ünïcödé 数字 123",
         "x" * 3000, "jumps over<sep>the lazy dog"]  # fmt: skip


@pytest.mark.parametrize("setting", ["word level", "byte-level BPE", "special tokens split", "truncation set",
                                     "bos added", "a tokenizer of its own"])  # fmt: skip
def test_the_token_ids_are_the_tokenizers_own_however_it_is_set(tiny_lm, setting):
    """The prepared ids equal tokenizer(texts)["input_ids"]: the backend's faster encoding (no offsets) is used only
    when it makes the same ids, whatever the tokenizer's settings; a tokenizer that changes the text itself is
    called as it is."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from common.text import ids_of

    if setting == "word level":
        tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    elif setting == "special tokens split":
        tokenizer = byte_level_bpe(split_special_tokens=True)
    elif setting == "truncation set":  # a tokenizer.json that truncates: tokenizer() turns it off for each call
        tokenizer = byte_level_bpe()
        tokenizer.backend_tokenizer.enable_truncation(8)
    elif setting == "bos added":
        tokenizer = byte_level_bpe()
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<sep> $A", special_tokens=[("<sep>", tokenizer.convert_tokens_to_ids("<sep>"))]
        )
    elif setting == "a tokenizer of its own":  # a subclass that lowercases the text: the backend alone would not

        class Lowercasing(PreTrainedTokenizerFast):
            def __call__(self, text, *args, **kwargs):
                return super().__call__([t.lower() for t in text], *args, **kwargs)

        tokenizer = Lowercasing(tokenizer_object=byte_level_bpe().backend_tokenizer, eos_token="<eos>")
    else:
        tokenizer = byte_level_bpe()
    encode = ids_of(tokenizer)
    for texts in (TEXTS, TEXTS[::-1] * 3, ["THE QUICK"]):  # the first batch decides; later ones follow it
        assert encode(texts) == tokenizer(texts, return_attention_mask=False)["input_ids"]
    if setting == "a tokenizer of its own":
        assert encode(["ABC"]) != [e.ids for e in tokenizer.backend_tokenizer.encode_batch(["ABC"])]


def test_the_progress_bar_counts_a_small_split_with_the_next_chunk_and_estimates_the_total_from_bytes(monkeypatch):
    """A held-out split of a few hundred tokens, done in the map's start-up time, is not shown alone (it said
    1k tok/s and an ETA of hours); once a quarter chunk is done the bar holds every token, its total the corpus's
    bytes at the tokens-per-byte seen so far. A resumed preparation starts from the chunks it had finished."""
    monkeypatch.setenv(prepared.CHUNK_BYTES_ENV, str(4000))
    progress = prepared.Progress(total_bytes=10_000, done_bytes=0, done_tokens=0, desc="tokenizing")
    progress.add(nbytes=200, tokens=50)  # the held-out split
    assert (progress.bar.n, progress.bar.total) == (0, None)
    progress.add(nbytes=4000, tokens=1000)  # the first chunk of train
    assert (progress.bar.n, progress.bar.total) == (1050, 1050 * 10_000 // 4200)
    progress.add(nbytes=5800, tokens=1450)
    assert (progress.bar.n, progress.bar.total) == (2500, 2500)
    progress.close()
    resumed = prepared.Progress(total_bytes=10_000, done_bytes=4200, done_tokens=1050, desc="tokenizing")
    resumed.add(nbytes=800, tokens=200)  # under a quarter chunk: held
    assert resumed.bar.n == 1050
    resumed.add(nbytes=1000, tokens=250)
    assert (resumed.bar.n, resumed.bar.total) == (1500, 1500 * 10_000 // 6000)
    resumed.close()


def test_a_files_digest_is_read_once_and_again_after_any_write(tmp_path, monkeypatch):
    """file_sha256 remembers a digest by the file's stat, ctime included: a file not written since is not read again
    (the remembered digest is what it returns); one written since, even to the same size with its mtime set back,
    is; and a cache it cannot write to costs a reading, not an error."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepared, "SETTLED_SECONDS", 0.0)
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"text": "one"}\n')
    assert prepared.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    (memo,) = (tmp_path / "cache" / "file_digests").iterdir()
    saved = json.loads(memo.read_text())
    memo.write_text(json.dumps({**saved, "sha256": "remembered"}))
    assert prepared.file_sha256(path) == "remembered"  # not read again

    mtime = path.stat().st_mtime_ns
    path.write_bytes(b'{"text": "two"}\n')  # the same size
    os.utime(path, ns=(mtime, mtime))
    assert (
        path.stat().st_mtime_ns == mtime
        and prepared.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    )

    monkeypatch.setattr(prepared, "SETTLED_SECONDS", 3600.0)  # just written: read each time, not remembered
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_bytes(b"x")
    assert prepared.file_sha256(fresh) == hashlib.sha256(b"x").hexdigest() and len(list(memo.parent.iterdir())) == 1
    monkeypatch.setattr(prepared, "SETTLED_SECONDS", 0.0)
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "file" / "cache"))  # cannot be made
    assert prepared.file_sha256(fresh) == hashlib.sha256(b"x").hexdigest()


# Launched as users launch ---------------------------------------------------------------------------------------


def test_a_checkpoint_knows_prepared_blocks_by_their_inputs_not_only_by_the_blocks_it_samples(tiny_lm, tmp_path):
    """One word of one document changed: one block differs, one that fingerprint() does not sample, and the digest
    of the inputs the blocks carry tells the two apart. Another --validation_file leaves the train blocks' identity
    (and so the checkpoints' resume) as it was."""
    PartialState()
    data, _ = prepare_here(tiny_lm, tmp_path / "a")
    n, rows = len(data["train"]), tiny_lm["train"].read_text().splitlines()
    sampled = {i * n // 64 for i in range(64)}
    for r in range(len(rows) // 2, len(rows) // 2 + 10):  # a row whose block is not among those sampled
        changed = tmp_path / f"train-{r}.jsonl"
        row = json.loads(rows[r])
        words = row["text"].split()
        words[0] = "one" if words[0] != "one" else "two"  # the word-level tokenizer: one token for one
        changed.write_text("\n".join([*rows[:r], json.dumps({"text": " ".join(words)}), *rows[r + 1 :]]) + "\n")
        files = ["--train_file", changed, "--validation_file", tiny_lm["validation"]]
        other, _ = prepare_here(tiny_lm, tmp_path / f"b-{r}", data=files)
        differ = {i for i, (a, b) in enumerate(zip(ids(data, "train"), ids(other, "train"))) if a != b}
        if len(other["train"]) == n and differ and not differ & sampled:
            break
    else:
        pytest.fail("no row found whose block is not sampled")
    assert fingerprint(other["train"]) != fingerprint(data["train"])

    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(tiny_lm["validation"].read_text().splitlines(keepends=True)[1:]))
    third, _ = prepare_here(tiny_lm, tmp_path / "c", data=["--train_file", tiny_lm["train"],
                                                           "--validation_file", validation])  # fmt: skip
    assert fingerprint(third["train"]) == fingerprint(data["train"])
    assert ids(third, "validation") != ids(data, "validation")


@pytest.mark.slow
def test_a_second_run_reuses_the_prepared_data_and_trains_the_same(tiny_lm, tmp_path):
    """Nothing given: the blocks go to the datasets cache under the inputs' digest; a second run with the same
    inputs loads them without tokenizing, a damaged folder there is prepared again. The user's cache, as every
    one-process run of the tests has it (so each runs forked from the process with its libraries imported), and a
    training file no other run has: a column the recipe does not read, in its first row, makes its digest (and so
    its folder) this test's alone."""
    import datasets

    train = tmp_path / "train.jsonl"
    first_row, *rows = tiny_lm["train"].read_text().splitlines(keepends=True)
    train.write_text("".join([json.dumps({**json.loads(first_row), "note": uuid.uuid4().hex}) + "\n", *rows]))
    cache = Path(datasets.config.HF_DATASETS_CACHE)

    def train_run(name):
        args = lm_args(tiny_lm, tmp_path / name, "--max_train_steps", "4", "--logging_steps", "1",
                       data=["--train_file", train, "--validation_file", tiny_lm["validation"]])  # fmt: skip
        proc = run([BIN / "python", RECIPE, *args])
        return proc.stdout + proc.stderr, results(tmp_path / name)

    def left_beside(folder) -> list:
        """What else in the cache carries this folder's digest: a partial folder or a lock left behind."""
        return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))

    said, first = train_run("first")
    (folder,) = [Path(p) for p in re.findall(r"preparing the data in (\S+)", said)]
    try:
        assert folder.parent == cache / "prepared" and left_beside(folder) == []  # no partial folder left
        written, at = snapshot(folder), (folder / prepared.MANIFEST).stat().st_mtime_ns
        splits = manifest(folder)["splits"]
        said, second = train_run("second")
        assert f"reusing the prepared data in {folder}: 196 train and 19 validation blocks" in said
        assert "preparing" not in said and "tokenizing" not in said
        assert snapshot(folder) == written and (folder / prepared.MANIFEST).stat().st_mtime_ns == at
        assert losses(second) == losses(first) and second["eval_loss"] == first["eval_loss"]

        arrow = next((folder / "train").rglob("data-*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[:100])
        said, third = train_run("third")
        assert f"prepared data in {folder} is damaged" in said and "preparing it again" in said
        assert losses(third) == losses(first)
        assert manifest(folder)["splits"] == splits
        assert folder.is_dir() and left_beside(folder) == []
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the user's cache as it was


@pytest.fixture(scope="module")
def prepared_ahead(tiny_lm, tmp_path_factory):
    """--prepare_only through launch.sh (2 processes on this CPU host) into a named folder: (folder, process)."""
    root = tmp_path_factory.mktemp("prepared_ahead")
    folder, out = root / "prepared", root / "out"
    proc = run([REPO / "launch.sh", "lm_finetune", *lm_args(tiny_lm, out, "--prepare_only", "--prepared_data_dir",
                                                              folder)])  # fmt: skip
    assert not out.exists(), "--prepare_only claims nothing in --output_dir"
    return folder, proc


@pytest.mark.slow
def test_a_run_on_prepared_data_stopped_in_two_processes_resumes_in_three_to_the_uninterrupted_weights(
    prepared_ahead, tiny_lm, tmp_path
):
    """Through launch.sh from the folder prepared ahead: 2 processes x 12 x 2 accumulation stopped by SIGTERM after
    epoch 0, resumed with `latest` in 3 processes x 8 x 2 (the same effective batch of 48), end on the loss curve
    and weights of one uninterrupted process x 24 x 2 (the step's samples summed in one process: the equal of
    every layout, so the 2-process part before the stop is held to it too). Prepared ahead by --prepare_only, once,
    the folder is read and left as it was; --max_eval_samples 5 counts each of its 5 blocks once on 1 and on 3
    processes."""
    folder, proc = prepared_ahead
    (done,) = [line for line in proc.stderr.splitlines() if line.startswith("done:")]
    assert done.startswith("done: prepared 196 train and 19 validation blocks of 32 tokens in ")
    assert str(folder) in done
    assert proc.stderr.count("preparing the data in") == 1  # the main process; the other found it ready
    written = snapshot(folder)
    args = ["--prepared_data_dir", folder, "--gradient_accumulation_steps", "2", "--max_train_steps", "10"]
    args += ["--logging_steps", "1", "--checkpointing_steps", "2", "--max_eval_samples", "5"]

    def launch(processes, out, batch, *extra):
        cmd = [REPO / "launch.sh", "lm_finetune", "--num_processes", str(processes)]
        return cmd + lm_args(tiny_lm, out, *args, "--per_device_train_batch_size", str(batch), *extra)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    trained = run([BIN / "python", RECIPE, *lm_args(tiny_lm, straight, *args, "--per_device_train_batch_size", "24")])
    assert "preparing" not in trained.stderr and f"reusing the prepared data in {folder}" in trained.stderr
    proc, _ = interrupt(launch(2, resumed, 12), user_env(), resumed, after_step=4)
    stop = preempted_at(proc.stderr)
    # mid-run, past epoch 0 (196 blocks are 4 steps of 48); a quiet machine trains a few more steps (30 a second)
    # before the signal is agreed on
    assert stop is not None and 4 <= stop < 10, proc.stderr[-3000:]
    proc = run(launch(3, resumed, 8, "--resume_from_checkpoint", "latest"))
    assert "2 x 12 x 2 -> 3 x 8 x 2, effective batch 48 -> 48" in proc.stderr
    a, b = results(straight), results(resumed)
    assert (a["world_size"], b["world_size"]) == (1, 3) and a["steps"] == b["steps"] == 10 and a["epochs"] > 2
    for after, before in zip(b["log_history"], a["log_history"], strict=True):
        assert after["samples_seen"] == before["samples_seen"]
        assert after["train_loss"] == pytest.approx(before["train_loss"], rel=1e-5)
    assert update_distance(resumed, straight, tiny_lm["model"]) < 1e-5
    assert a["eval_tokens"] == b["eval_tokens"] == 5 * 31  # 5 blocks (not one repeated to even out), 31 targets each
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    assert snapshot(folder) == written


def other_tokenizer(lm, tmp_path):
    """The model's tokenizer with another chat template."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(lm["model"] / name, folder / name)
    (folder / "chat_template.jinja").write_text((folder / "chat_template.jinja").read_text() + "{{ '' }}")
    return ["--tokenizer_name", folder]


def other_train_file(lm, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(lm["train"].read_text().replace("one", "two", 1))
    return ["--train_file", path]


CHANGES = {  # what changes, the option the line names
    "train_file": (other_train_file, "another --train_file (sha256 "),
    "tokenizer": (other_tokenizer, "another tokenizer (--tokenizer_name, or the model's) (chat_template_sha256 "),
    "block_size": (lambda lm, tmp_path: ["--block_size", "16"], "another --block_size (32 vs 16 now)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", CHANGES)
def test_a_prepared_folder_of_other_inputs_is_refused_in_one_line_and_left_unchanged(prepared_ahead, tiny_lm,
                                                                                     tmp_path, change):  # fmt: skip
    folder, _ = prepared_ahead
    written = snapshot(folder)
    make, named = CHANGES[change]
    extra = make(tiny_lm, tmp_path)
    args = lm_args(tiny_lm, tmp_path / "out", "--prepared_data_dir", folder, "--prepare_only")
    if extra[0] == "--train_file":
        args[args.index("--train_file") + 1] = extra[1]
    else:
        args += extra
    proc = run([BIN / "python", RECIPE, *args], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: --prepared_data_dir {folder} was prepared from {named}"), line
    assert line.endswith("; pass another --prepared_data_dir, or leave it out (a folder named by the inputs, in the "
                         "datasets cache)")  # fmt: skip
    assert snapshot(folder) == written and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_preparation_killed_halfway_resumes_at_its_chunks_and_equals_an_uninterrupted_one(tiny_lm, tmp_path,
                                                                                            monkeypatch):  # fmt: skip
    """A run's preparation killed (SIGKILL) after 5 of its chunks, run again: it keeps them and prepares the rest, to
    the blocks an uninterrupted preparation of the same inputs and chunks makes (prepared_blocks here, as the
    recipe calls it)."""
    import datasets

    train = tmp_path / "train.jsonl"
    train.write_text(tiny_lm["train"].read_text() * 2)  # 1200 rows, 70 kB
    # 30 chunks; the user's datasets cache (the folder is named), so the run again is forked from the warm process
    env = user_env(**{prepared.CHUNK_BYTES_ENV: "2000"})

    def command(folder):
        args = lm_args(tiny_lm, tmp_path / "out", "--prepare_only", "--prepared_data_dir", folder)
        args[args.index("--train_file") + 1] = train
        return [str(a) for a in [BIN / "python", RECIPE, *args]]

    folder = tmp_path / "prepared"
    proc = subprocess.Popen(command(folder), cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while len(done := sorted(tmp_path.glob(".prepared.*.partial/train/part-*/part.json"))) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, "no 5 chunks prepared"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not folder.exists()  # no half-prepared folder where a run would look
    first = done[0].parent / next(p.name for p in done[0].parent.iterdir() if p.suffix == ".arrow")
    inode = first.stat().st_ino

    resumed = run(command(folder), env=env)
    found = [line for line in resumed.stderr.splitlines() if "resuming the preparation in" in line]
    assert found and int(found[0].split(": ")[-1].split(" of ")[0]) >= 5, resumed.stderr[-2000:]
    assert (folder / "train" / "part-00000" / first.name).stat().st_ino == inode  # kept, not written again
    assert not list(tmp_path.glob(".prepared.*.partial"))

    straight = tmp_path / "straight"
    monkeypatch.setenv(prepared.CHUNK_BYTES_ENV, env[prepared.CHUNK_BYTES_ENV])
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    prepare_here(tiny_lm, straight, data=["--train_file", train, "--validation_file", tiny_lm["validation"]])
    a, b = manifest(folder), manifest(straight)
    assert a["splits"] == b["splits"] and len(a["splits"]["train"]["parts"]) > 20
    for split in ("train", "validation"):
        assert ids(prepared.load_prepared(folder, a), split) == ids(prepared.load_prepared(straight, b), split)


@pytest.mark.slow
def test_runs_started_together_prepare_once_and_a_preparer_that_stalls_or_dies_is_named_or_taken_over(
    tiny_lm, tmp_path
):
    """A sweep's jobs started at once on the same data, into the default folder: one prepares, the other waits for it
    and reuses its folder. A preparer stopped (SIGSTOP) is named by a run that waits for it, after --ddp_timeout of
    nothing written, in one line, exit 2; one that dies takes its lock with it, and the run waiting resumes its
    chunks."""
    train = tmp_path / "train.jsonl"
    train.write_text(tiny_lm["train"].read_text() * 2)  # 1200 rows, 70 kB in 70 chunks: seconds of work
    env = user_env(**{prepared.CHUNK_BYTES_ENV: "1000", "HF_DATASETS_CACHE": str(tmp_path / "cache")})
    cache = tmp_path / "cache" / "prepared"

    def start(name, *extra):
        args = lm_args(tiny_lm, tmp_path / "out", "--prepare_only", "--preprocessing_num_workers", "1", *extra)
        args[args.index("--train_file") + 1] = train
        log = tmp_path / f"{name}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([str(a) for a in [BIN / "python", RECIPE, *args]], cwd=REPO, env=env,
                                    start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        return proc, log

    def until(what, proc=None, seconds=300):
        deadline = time.monotonic() + seconds
        while not what():
            assert (proc is None or proc.poll() is None) and time.monotonic() < deadline, "waited in vain"
            time.sleep(0.05)

    def parts():
        return len(list(cache.glob(".*.partial/train/part-*/part.json")))

    first, first_log = start("first")
    try:
        until(lambda: parts() >= 3, first)
        first.send_signal(signal.SIGSTOP)  # so that the second one finds it at work, however slowly it starts
        second, second_log = start("second")
        until(lambda: "waiting for it" in second_log.read_text(), second)
        first.send_signal(signal.SIGCONT)
        assert first.wait(300) == 0 and second.wait(300) == 0, second_log.read_text()[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    said = first_log.read_text() + second_log.read_text()
    assert said.count("preparing the data in") == 1 and "reusing the prepared data in" in second_log.read_text()
    (folder,) = cache.iterdir()  # the prepared folder alone: no partial folder, no lock left
    assert len(manifest(folder)["splits"]["train"]["parts"]) > 50

    shutil.rmtree(cache)
    dies, _ = start("dies")
    try:
        until(lambda: parts() >= 3, dies)
        dies.send_signal(signal.SIGSTOP)
        stalled = start("stalled", "--ddp_timeout", "3")[0]
        assert stalled.wait(300) == 2
        (line,) = error_lines((tmp_path / "stalled.log").read_text())
        assert "another run has prepared the same data into" in line and "written nothing for 3 s" in line, line
        waiting, waiting_log = start("waiting")
        until(lambda: "waiting for it" in waiting_log.read_text(), waiting)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dies.pid, signal.SIGKILL)
    assert waiting.wait(300) == 0, waiting_log.read_text()[-2000:]
    resumed = [line for line in waiting_log.read_text().splitlines() if "resuming the preparation in" in line]
    assert resumed and int(resumed[0].split(": ")[-1].split(" of ")[0]) >= 3
    (folder,) = cache.iterdir()
    assert len(manifest(folder)["splits"]["train"]["parts"]) > 50
