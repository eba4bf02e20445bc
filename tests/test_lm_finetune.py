"""The causal-LM recipe on a tiny Llama built here, launched as users launch it on CPU."""

import argparse
import hashlib
import json
import logging
import math
import re
import shlex
import shutil
import sys
from unittest import mock

import pytest
import torch
from accelerate import Accelerator, PartialState
from conftest import (
    BIN,
    LM_INTERRUPTED_ARGS,
    REPO,
    accelerate_cpu,
    card,
    chat_args,
    cpu_env,
    error_lines,
    eval_loss,
    interrupt,
    is_png,
    lm_args,
    load_recipe,
    preempted_at,
    results,
    run,
    samples,
    update_distance,
    user_env,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.card import launch_record, write_card
from common.runtime import RecipeError
from common.text import (
    IGNORE_INDEX,
    block_size_for,
    chat_example,
    load_raw_datasets,
    prepared_blocks,
    target_tokens,
    window_tokens,
)

RECIPE = REPO / "recipes" / "lm_finetune.py"


@pytest.mark.floor
@pytest.mark.slow
def test_two_processes_learn_and_from_pretrained_reproduces_the_eval_loss(tiny_lm, tmp_path):
    out = tmp_path / "run"
    run([REPO / "launch.sh", "lm_finetune", *lm_args(tiny_lm, out, "--num_train_epochs", "3")])
    res = results(out)
    assert res["world_size"] == 2 and res["effective_batch_size"] == 16 and res["block_size"] == 32
    before = eval_loss(tiny_lm["model"], tiny_lm)
    assert before > 2.5  # about ln(17): the untrained model guesses
    assert res["eval_loss"] < 0.5 * before, res
    assert res["perplexity"] == pytest.approx(math.exp(res["eval_loss"]))
    assert res["tokens_per_second"] > 0 and res["mfu"] is None  # no GPU peak to compare with on CPU
    # the steady rate is the same work less the first step (which pays one-time costs)
    assert res["steady_tokens_per_second"] == pytest.approx(res["steady_samples_per_second"] * 32)
    assert res["steady_tokens_per_second"] > res["tokens_per_second"] * (res["steps"] - 1) / res["steps"]
    assert eval_loss(out, tiny_lm) == pytest.approx(res["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_one_process_learns_from_a_dataset_folder_with_gradient_checkpointing(tiny_lm, tmp_path):
    """--dataset_name takes what datasets.load_dataset takes: a hub id, or (here, offline) a folder
    whose files name the splits."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    shutil.copy(tiny_lm["train"], folder / "train.jsonl")
    shutil.copy(tiny_lm["validation"], folder / "validation.jsonl")
    out = tmp_path / "run"
    args = [
        a
        for a in lm_args(tiny_lm, out, "--num_train_epochs", "2", "--gradient_checkpointing")
        if str(a) not in ("--train_file", "--validation_file", str(tiny_lm["train"]), str(tiny_lm["validation"]))
    ]
    run([BIN / "python", RECIPE, *args, "--dataset_name", folder])  # one process: no launcher needed
    res = results(out)
    assert res["world_size"] == 1 and res["eval_loss"] < 0.6 * eval_loss(tiny_lm["model"], tiny_lm)
    assert res["eval_loss"] == pytest.approx(eval_loss(out, tiny_lm), rel=1e-4)  # the same validation split
    saved, given = (json.loads((folder / "config.json").read_text()) for folder in (out, tiny_lm["model"]))
    assert saved["use_cache"] == given["use_cache"] is True  # checkpointing is training's: the model keeps its cache


def test_a_tiny_run_in_one_process_trains_saves_reports_and_writes_its_model_card(
    tiny_lm, tmp_path, monkeypatch, caplog
):
    """The fast tier's one real run (pytest -m 'not slow'): the recipe end to end in this machine's one
    process, 3 optimizer steps, through every stage a launch has, in seconds. It evaluates after each step, and
    completes the first half of the first 4 held-out documents greedily each time, into samples.jsonl and
    TensorBoard; the same run without samples trains the same weights and losses, to the bit. Its model card."""
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, off = tmp_path / "run", tmp_path / "off"
    args = ("--max_train_steps", "3", "--checkpointing_steps", "3", "--eval_steps", "1")
    proc = run([BIN / "python", RECIPE, *lm_args(tiny_lm, out, *args, "--report_to", "tensorboard")])
    # what the samples cost, said at each evaluation against the evaluation's own time
    said = re.findall(
        r"step (\d): 4 samples of up to 20 tokens in [\d.]+ s \(\d+% of the evaluation's [\d.]+ s\)", proc.stderr
    )
    assert said == ["1", "2", "3"], proc.stderr[-3000:]
    res = results(out)
    assert res["steps"] == 3 and res["world_size"] == 1 and res["samples_seen"] == 3 * 8
    assert len(res["log_history"]) == 3 and res["eval_tokens"] > 0  # a log at each evaluation
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
    assert eval_loss(out, tiny_lm) == pytest.approx(res["eval_loss"], rel=1e-4)

    # The model card: what the Hub reads, and the run's data, command, hyperparameters and metrics
    meta, text = card(out)
    assert meta["library_name"] == "transformers" and "base_model" not in meta  # a local folder is no Hub id
    assert {"accelerate-recipes", "lm_finetune", "text-generation"} <= set(meta["tags"])
    assert meta["metrics"] == ["loss", "perplexity"]
    sha = hashlib.sha256(tiny_lm["train"].read_bytes()).hexdigest()
    assert f"--train_file `{tiny_lm['train']}`, sha256 `{sha}`" in text and res["data_fingerprint"] in text
    assert res["launch"]["command"].startswith("./launch.sh lm_finetune --config cpu --num_processes 1 ")
    assert res["launch"]["command"] in text and "--max_train_steps 3" in res["launch"]["command"]
    assert "| effective batch | 8 (8 a process x 1 processes x 1 accumulation) |" in text
    assert f"| eval_loss | {res['eval_loss']:.6g} |" in text and "| steps | 3 (" in text
    assert "![training curves](training_curves.png)" in text and is_png(out / "training_curves.png")
    files = json.loads((out / ".model-files.json").read_text())["files"]
    assert {"README.md", "training_curves.png", "model.safetensors"} <= set(files)  # the run's: overwritten by runs
    # Without matplotlib (the optional extra `bench`) the card says nothing of pictures, and one line says why
    bare = out.parent / "without_matplotlib"
    shutil.copytree(out, bare)
    (bare / "training_curves.png").unlink()
    (bare / "samples.jsonl").write_text("{}\n")  # what other steps of a run may leave there: linked when present
    (bare / "merged").mkdir()
    PartialState()  # the recipes' logger needs it
    with monkeypatch.context() as patch, caplog.at_level(logging.INFO, logger="recipes"):
        patch.setitem(sys.modules, "matplotlib", None)
        assert write_card(bare, results(bare)) == ["README.md"]
    (said,) = [m for m in caplog.messages if "matplotlib" in m]  # accelerate's logger puts [RANK 0] before it
    assert said.endswith("matplotlib is not installed (pip install -e '.[bench]'): the model card has no pictures")
    assert ".png" not in card(bare)[1] and not (bare / "training_curves.png").exists()
    assert "- [samples.jsonl](samples.jsonl)\n- [merged](merged/)\n" in card(bare)[1]
    assert "- [samples.jsonl](samples.jsonl)\n" in text and "merged" not in text  # it sampled
    # The command on the card masks credentials in the arguments, as launch.sh's printed command does
    secrets = ["pa55word", "hf_" + "S3cr3t" * 6]
    argv = [str(RECIPE), "--dataset_name", f"https://user:{secrets[0]}@example.org/d", "--hub_token", secrets[1]]
    monkeypatch.setattr(sys, "argv", argv)
    command = launch_record(Accelerator(cpu=True), argparse.Namespace(recipe="lm_finetune"))["command"]
    assert command.endswith(" --dataset_name 'https://***@example.org/d' --hub_token '***'"), command
    assert command.startswith("./launch.sh lm_finetune --config cpu --num_processes 1 --mixed_precision no ")
    # started from another folder (launch.sh says its path): the command runs launch.sh by its path, from that folder
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RECIPE_LAUNCH_SH", str(REPO / "launch.sh"))
    record = launch_record(Accelerator(cpu=True), argparse.Namespace(recipe="lm_finetune"))
    assert record["command"].startswith(f"{REPO / 'launch.sh'} lm_finetune --config cpu ") and record["cwd"] == str(
        tmp_path
    )

    rows = samples(out)
    assert [(r["step"], r["samples_seen"]) for r in rows] == [(step, 8 * step) for step in (1, 2, 3) for _ in "1234"]
    held_out = [json.loads(line)["text"].split() for line in tiny_lm["validation"].read_text().splitlines()[:4]]
    assert [r["prompt"] for r in rows[:4]] == [" ".join(words[: len(words) // 2]) for words in held_out]
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    assert all(0 < len(tokenizer(r["completion"])["input_ids"]) <= 20 for r in rows)  # --max_new_tokens' default
    events = EventAccumulator(str(out / "lm_finetune"), size_guidance={"tensors": 0})
    events.Reload()
    shown = [(t.step, t.tensor_proto.string_val[0].decode()) for t in events.Tensors("samples/0/text_summary")]
    assert [step for step, _ in shown] == [1, 2, 3]
    assert all(
        f"    {r['prompt']}\n" in text and f"    {r['completion']}" in text for r, (_, text) in zip(rows[::4], shown)
    )

    run([BIN / "python", RECIPE, *lm_args(tiny_lm, off, *args, "--max_new_tokens", "0")])
    assert not (off / "samples.jsonl").exists()
    weights, without = (load_file(folder / "model.safetensors") for folder in (out, off))
    assert weights.keys() == without.keys() and all(torch.equal(weights[k], without[k]) for k in weights)
    for key in ("log_history", "eval_history"):
        strip = lambda h: [{k: v for k, v in e.items() if "seconds" not in k} for e in h]  # noqa: E731
        assert strip(results(off)[key]) == strip(res[key])


@pytest.mark.slow
def test_a_pretrained_model_trains_in_training_mode_from_its_first_step(tiny_lm, tmp_path):
    """from_pretrained returns a model in eval mode: trained so, dropout is off and transformers' gradient
    checkpointing (training mode only) saves no memory until the first evaluation. The first step's loss
    with attention dropout 0.9 differs from the one without."""
    losses = []
    for dropout in (0.0, 0.9):
        model = tmp_path / f"model-{dropout}"
        shutil.copytree(tiny_lm["model"], model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "attention_dropout": dropout}))
        out = tmp_path / f"run-{dropout}"
        args = lm_args({**tiny_lm, "model": model}, out, "--max_train_steps", "1", "--logging_steps", "1")
        run([BIN / "python", RECIPE, *args])
        losses.append(results(out)["log_history"][0]["train_loss"])
    assert losses[0] != pytest.approx(losses[1], rel=1e-3), losses


@pytest.mark.parametrize("suffix", [".txt", ".csv", ".parquet", ".jsonl"])
def test_local_files_of_every_format_load_with_a_held_out_split(tmp_path, suffix):
    import datasets

    lines = [f"line {i}" for i in range(40)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".txt":
        path.write_text("\n".join(lines) + "\n")
    else:
        table = datasets.Dataset.from_dict({"text": lines})
        {".csv": table.to_csv, ".parquet": table.to_parquet, ".jsonl": table.to_json}[suffix](str(path))
    raw = load_raw_datasets(train_file=path, validation_split_percentage=10, seed=0)
    assert len(raw["train"]) == 36 and len(raw["validation"]) == 4
    assert sorted([*raw["train"]["text"], *raw["validation"]["text"]]) == sorted(lines)


# Chats whose replies hold 1 to 24 words: the target tokens of a 32-token block vary from a few to
# most of it. No clipping and no weight decay, so the update is the gradient's alone.
@pytest.fixture(scope="module")
def chat_layouts(tiny_lm, tmp_path_factory):
    """17 steps of 8 chat blocks across the epoch end (an epoch is 15 steps and a remainder): 1 process x 8,
    1 x 2 x accumulation 4, and 2 processes x 4 (the only launch). Their output folders by name."""
    root = tmp_path_factory.mktemp("chat_layouts")
    outs = {name: root / name for name in ("1x8", "1x2x4", "2x4")}
    over_the_epoch_end = ("--max_train_steps", "17", "--learning_rate", "1e-3", "--validation_split_percentage", "5")
    run([BIN / "python", RECIPE, *chat_args(tiny_lm, outs["1x8"], 8, *over_the_epoch_end)])
    accumulated = ("--gradient_accumulation_steps", "4", *over_the_epoch_end)
    run([BIN / "python", RECIPE, *chat_args(tiny_lm, outs["1x2x4"], 2, *accumulated)])
    run(*accelerate_cpu(2, RECIPE, *chat_args(tiny_lm, outs["2x4"], 4, *over_the_epoch_end)))
    return outs


@pytest.mark.slow
def test_every_target_token_weighs_the_same_however_a_step_is_split_into_processes_and_accumulation(
    tiny_lm, chat_layouts
):
    """The step's loss is its target tokens' summed loss over their number, across every micro-batch
    and process (transformers' num_items_in_batch), so 2 processes x batch 4 and 1 process x batch 2 x
    accumulation 4 make the same update as 1 x 8. A mean per micro-batch, averaged, does not: it
    weighs a block with 3 target tokens like one with 30 (measured before the fix at 2 x 2 against 1 x 4:
    4.6e-3 apart)."""
    reference = results(chat_layouts["1x8"])
    for name in ("1x2x4", "2x4"):
        out = chat_layouts[name]
        assert results(out)["effective_batch_size"] == reference["effective_batch_size"] == 8
        assert update_distance(out, chat_layouts["1x8"], tiny_lm["model"]) < 1e-5, out
        # the logged loss is the same token-weighted mean
        curve = [h["train_loss"] for h in results(out)["log_history"]]
        assert curve == pytest.approx([h["train_loss"] for h in reference["log_history"]], rel=1e-5)
    assert results(chat_layouts["2x4"])["world_size"] == 2


@pytest.mark.slow
def test_accumulation_across_an_epoch_end_trains_what_one_big_batch_trains(tiny_lm, chat_layouts):
    """An epoch of the chats is 15 steps of 8 blocks and a remainder: 1 process x batch 2 x accumulation 4 and
    2 x 4 drop the remainder as 1 x 8 does (an epoch's last, shorter window trained as a step of its own made a
    different model: 6% of the update apart), so 17 steps across the epoch end train the same samples and weights."""
    outs = chat_layouts
    seen = {name: [h["samples_seen"] for h in results(out)["log_history"]] for name, out in outs.items()}
    assert seen["1x8"] == seen["1x2x4"] == seen["2x4"] == [8 * step for step in range(1, 18)], seen
    assert results(outs["1x8"])["epochs"] > 1  # the run crossed the epoch end
    for name in ("1x2x4", "2x4"):
        assert update_distance(outs[name], outs["1x8"], tiny_lm["model"]) < 1e-5, name


def test_target_tokens_counts_the_shifted_labels_and_a_step_without_any_is_a_zero_update(tiny_lm):
    from accelerate import PartialState

    labels = torch.tensor(
        [
            [5, -100, -100, -100],  # the first position is never a target: 0
            [-100, -100, 7, -100],  # 1
            [3, 4, 5, 6],
        ]
    )  # 3
    assert target_tokens(labels) == 4 and [int(target_tokens(row)) for row in labels] == [0, 1, 3]

    class Single:  # the one-process accelerator window_tokens reduces with
        def reduce(self, tensor, reduction):
            return tensor

    PartialState()
    empty = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.full((1, 4), -100)}
    tokens = window_tokens(Single(), [empty, empty])
    assert tokens == 1  # not 0: no division by zero
    model = AutoModelForCausalLM.from_pretrained(tiny_lm["model"])
    loss = model(**empty, num_items_in_batch=tokens).loss
    assert loss.item() == 0.0 and not loss.isnan()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters() if p.grad is not None)


# 14 steps of 2 micro-batches (32 samples a step at 2 x 8 x 2) crossing epochs, the rate scaled by the effective batch,
# held-out loss every 4 steps (and at the end) on an odd number of blocks, 3 a process at a time.
LAYOUT_ARGS = (*LM_INTERRUPTED_ARGS, "--lr_scaling", "linear", "--eval_steps", "4")
LAYOUT_ARGS += ("--per_device_eval_batch_size", "3")


@pytest.fixture(scope="module")
def lm_layouts(tiny_lm, tmp_path_factory):
    """The runs the stop, resume and evaluation tests below read, LAYOUT_ARGS each: uninterrupted in 1 process x 16
    ("one") and in 2 processes x 8 ("two"); 2 x 8 stopped by SIGTERM to every process after checkpoint-4
    ("stopped", its checkpoints every 2 steps), then copies of it resumed with `latest` in 1 process x 16 (the same
    effective batch: "resumed") and in 1 process x 8 (half of it: "halved"). Two launches in all. Returns the
    folders and, for the stop and the resumes, their finished processes ("<name>_proc")."""
    root = tmp_path_factory.mktemp("lm_layouts")
    runs = {name: root / name for name in ("one", "two", "stopped", "resumed", "halved")}
    run([BIN / "python", RECIPE, *lm_args(tiny_lm, runs["one"], *LAYOUT_ARGS, "--per_device_train_batch_size", "16")])
    run(*accelerate_cpu(2, RECIPE, *lm_args(tiny_lm, runs["two"], *LAYOUT_ARGS)))
    stopped = lm_args(tiny_lm, runs["stopped"], *LAYOUT_ARGS, "--checkpointing_steps", "2")
    runs["stopped_proc"], _ = interrupt(*accelerate_cpu(2, RECIPE, *stopped), runs["stopped"], after_step=4)
    for name, batch in (("resumed", "16"), ("halved", "8")):
        shutil.copytree(runs["stopped"], runs[name])
        resume = ["--per_device_train_batch_size", batch, "--checkpointing_steps", "2", "--resume_from_checkpoint"]
        runs[f"{name}_proc"] = run([BIN / "python", RECIPE, *lm_args(tiny_lm, runs[name], *LAYOUT_ARGS, *resume,
                                                                     "latest")])  # fmt: skip
    return runs


def stopped_at(lm_layouts) -> int:
    """The step the SIGTERM stopped the 2-process run at: its newest checkpoint, the one its `preempted:` line says."""
    proc, stopped = lm_layouts["stopped_proc"], lm_layouts["stopped"]
    assert proc.returncode != 0, proc.stderr[-3000:]
    stop = max(int(p.name.split("-")[1]) for p in stopped.glob("checkpoint-*"))
    assert 4 < stop < 14 and preempted_at(proc.stderr) == stop, proc.stderr[-3000:]
    return stop


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_in_one_process_gives_the_same_loss_and_weights(tiny_lm, lm_layouts):
    """SIGTERM to every process of a 2-process `accelerate launch` job, as Slurm and Ctrl-C's neighbours
    send it: each process finishes the step, they save one checkpoint and exit 75. Resumed with
    `latest` in ONE process with the per-device batch doubled (a requeue that got fewer GPUs), the
    loss curve and the weights are the uninterrupted 2-process run's."""
    stop, straight, resumed = stopped_at(lm_layouts), lm_layouts["two"], lm_layouts["resumed"]
    files = json.loads((lm_layouts["stopped"] / f"checkpoint-{stop}" / "trainer_state.json").read_text())["files"]
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(files)  # both processes stopped at this step
    assert "2 x 8 x 2 -> 1 x 16 x 2, effective batch 32 -> 32" in lm_layouts["resumed_proc"].stderr
    a, b = results(straight), results(resumed)
    assert a["steps"] == b["steps"] == 14 and a["epochs"] > 2  # the resumed part crossed epoch boundaries
    assert a["world_size"] == 2 and b["world_size"] == 1 and len(b["log_history"]) == len(a["log_history"]) == 14
    for after, before in zip(
        b["log_history"], a["log_history"], strict=True
    ):  # the same curve, the checkpoint's first
        assert after["step"] == before["step"] and after["samples_seen"] == before["samples_seen"]
        assert after["lr"] == pytest.approx(before["lr"]) and after["train_loss"] == pytest.approx(
            before["train_loss"], rel=1e-5
        )
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    assert update_distance(resumed, straight, tiny_lm["model"]) < 1e-5


@pytest.mark.slow
def test_eval_steps_counts_every_held_out_token_once_on_any_layout_and_a_resumed_run_keeps_its_evaluations(
    tiny_lm, lm_layouts, tmp_path
):
    """--eval_steps 4 over 14 steps: held-out loss at steps 4, 8, 12 and the end, in results.json's eval_history. Two
    processes (a held-out set of an odd number of blocks, Accelerate repeats one to even out the last batch) count
    each token once, as one process on the whole batch does, and reach the same losses. A run stopped by SIGTERM
    after checkpoint-4 and resumed in one process has the same evaluations, none twice. samples.jsonl holds 4
    greedy completions at each evaluation, the same on 1 and 2 processes, stopped and resumed or not, and again
    after a resume from an older checkpoint, whose later evaluations run again."""
    one, two, stopped = lm_layouts["one"], lm_layouts["two"], lm_layouts["resumed"]
    assert preempted_at(lm_layouts["stopped_proc"].stderr) is not None, lm_layouts["stopped_proc"].stderr[-3000:]
    reference = results(one)["eval_history"]
    assert [e["step"] for e in reference] == [4, 8, 12, 14]
    blocks = reference[0]["eval_tokens"] / 31  # a 32-token block of plain text has 31 targets
    assert blocks == int(blocks) and blocks % 2 == 1  # the set does not divide by the processes
    for other in (two, stopped):
        history = results(other)["eval_history"]
        assert [e["step"] for e in history] == [4, 8, 12, 14]
        assert [e["eval_tokens"] for e in history] == [e["eval_tokens"] for e in reference]
        for mine, theirs in zip(history, reference):
            assert mine["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
        assert results(other)["eval_loss"] == pytest.approx(reference[-1]["eval_loss"], rel=1e-5)
    rows = samples(one)
    assert [(r["step"], r["samples_seen"]) for r in rows] == [
        (e["step"], e["samples_seen"]) for e in reference for _ in "1234"
    ]
    assert samples(two) == samples(stopped) == rows
    again = tmp_path / "again"  # the resumed run's folder, resumed once more from its checkpoint-8
    shutil.copytree(stopped, again)
    older = ["--per_device_train_batch_size", "16", "--resume_from_checkpoint", again / "checkpoint-8"]
    run([BIN / "python", RECIPE, *lm_args(tiny_lm, again, *LAYOUT_ARGS, *older)])
    assert samples(again) == rows


@pytest.mark.slow
def test_a_resume_with_another_effective_batch_continues_the_schedule_and_the_epoch_where_they_were(lm_layouts):
    """2 processes x 8 x accumulation 2 (32 a step), stopped by SIGTERM, resumed in 1 process x 8 x 2
    (16 a step) under --lr_scaling linear: one line says what changed; the run trains the samples
    --max_train_steps meant (in twice the steps), the learning rate is halved, and the schedule
    continues from the samples already seen: at every sample count both runs log, the resumed
    run's learning rate is half the uninterrupted run's (no warmup or decay replayed). The uninterrupted run
    is one process x 16 x 2: its rates are those of any layout of 32 a step (the schedule counts samples)."""
    stop, straight, resumed = stopped_at(lm_layouts), lm_layouts["one"], lm_layouts["halved"]
    (line,) = [ln for ln in lm_layouts["halved_proc"].stderr.splitlines() if "with another layout" in ln]
    a, b = results(straight), results(resumed)
    assert "2 x 8 x 2 -> 1 x 8 x 2, effective batch 32 -> 16" in line
    assert f"learning rate {a['learning_rate']:.4g} -> {a['learning_rate'] / 2:.4g} (linear)" in line
    assert b["learning_rate"] == pytest.approx(a["learning_rate"] / 2) and b["effective_batch_size"] == 16
    assert a["effective_batch_size"] == 32 and a["world_size"] == 1
    assert b["samples_seen"] == a["samples_seen"] and b["steps"] == stop + 2 * (14 - stop)
    lr_at = {h["samples_seen"]: h["lr"] for h in a["log_history"]}
    shared = [h for h in b["log_history"] if h["samples_seen"] in lr_at and h["step"] > stop]  # after the resume
    assert [h["step"] for h in b["log_history"]][:stop] == list(range(1, stop + 1))  # the checkpoint's log first
    assert len(shared) >= 14 - stop - 1
    for h in shared:
        assert h["lr"] == pytest.approx(lr_at[h["samples_seen"]] / 2, rel=1e-6), h
    assert b["log_history"][-1]["lr"] == pytest.approx(0.0, abs=1e-9)  # the cosine ends where the data ends


@pytest.mark.slow
def test_an_epoch_checkpoint_of_a_run_that_max_train_steps_cut_short_resumes_where_it_stopped(tiny_lm, tmp_path):
    """--checkpointing_steps epoch, --max_train_steps ending mid-epoch: the checkpoint is at the sample reached (it
    said the next epoch, and a longer run resumed from it skipped the rest of this one), results.json and the
    trackers count the epoch's share; resumed with a longer --max_train_steps, the run is the longer run."""
    steps = ["--lr_scheduler_type", "constant", "--logging_steps", "1", "--checkpointing_steps", "epoch"]
    short, longer = tmp_path / "short", tmp_path / "long"
    run([BIN / "python", RECIPE, *lm_args(tiny_lm, short, *steps, "--max_train_steps", "3")])
    state = json.loads((short / "checkpoint-3" / "trainer_state.json").read_text())
    assert (state["epoch"], state["samples_in_epoch"], state["samples_seen"]) == (0, 24, 24)
    per_epoch = state["num_samples"] // 8  # steps an epoch
    assert per_epoch > 6 and results(short)["epochs"] == round(3 / per_epoch, 2)
    run([BIN / "python", RECIPE, *lm_args(tiny_lm, longer, *steps, "--max_train_steps", "6")])
    resume = ["--max_train_steps", "6", "--resume_from_checkpoint", short / "checkpoint-3"]  # `latest`: finished
    run([BIN / "python", RECIPE, *lm_args(tiny_lm, short, *steps, *resume)])
    a, b = results(longer), results(short)
    assert [h["train_loss"] for h in b["log_history"]] == pytest.approx([h["train_loss"] for h in a["log_history"]])
    assert update_distance(short, longer, tiny_lm["model"]) < 1e-6


def test_chat_masks_everything_but_the_assistant_reply(tiny_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    messages = [{"role": "user", "content": "count from one two three"}, {"role": "assistant", "content": "four five"}]
    row = chat_example(tokenizer, messages)
    tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
    assert tokens == [
        "<|user|>",
        "count",
        "from",
        "one",
        "two",
        "three",
        "<|end|>",
        "<|assistant|>",
        "four",
        "five",
        "<|end|>",
    ]
    trained = [t for t, label in zip(tokens, row["labels"]) if label != IGNORE_INDEX]
    assert trained == ["four", "five", "<|end|>"]
    assert [label for label in row["labels"] if label != IGNORE_INDEX] == tokenizer.convert_tokens_to_ids(trained)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_chat_trains_a_replys_first_token_that_holds_the_prompts_last_space_and_no_header_before_a_first_reply(kind):
    """Byte-level BPE (GPT-2, Qwen2, Llama 3) and sentencepiece-like tokenizers fold the space a generation prompt ends
    with into the reply's first token (" four"): it is the reply's. A conversation the assistant opens trains neither
    the template's header nor its default system prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "byte-level":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.post_processor = processors.ByteLevel(trim_offsets=False)  # as GPT-2's and Qwen2's tokenizer.json
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind == "byte-level" else []
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    backend.train_from_iterator(["zero one two three four five six seven be brief"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = (  # a default system prompt before the first message, unless one is given
        "{% if messages[0].role != 'system' %}<|system|> be brief <|end|> {% endif %}"
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    for messages in (
        [{"role": "user", "content": "one two three"}, {"role": "assistant", "content": "four five"}],
        [{"role": "assistant", "content": "four five"}, {"role": "user", "content": "six"}],
    ):
        row = chat_example(tokenizer, messages)
        tokens = tokenizer.convert_ids_to_tokens(
            [t for t, label in zip(row["input_ids"], row["labels"]) if label >= 0]
        )
        trained = [word for token in tokens if (word := token.strip("\u0120\u2581"))]  # without the space markers
        assert trained == ["four", "five", "<|end|>"], tokens


@pytest.fixture(scope="module")
def lora_run(tiny_lm, tmp_path_factory):
    """A LoRA run of 2 processes (DDP) in chat mode through launch.sh, 6 steps: its output folder."""
    out = tmp_path_factory.mktemp("lora") / "run"
    run([REPO / "launch.sh", "lm_finetune", *chat_args(tiny_lm, out, 4, "--lora_r", "8")])
    return out


@pytest.mark.floor
@pytest.mark.slow
def test_a_lora_run_saves_an_adapter_peft_loads_its_merged_model_and_a_card_whose_command_trains_it_again(
    tiny_lm, lora_run
):
    """The adapter in the output folder (PeftModel), and merged/: the adapter merged into the base weights, which
    AutoModelForCausalLM loads as a plain model and which gives the eval loss the run reported. peft's README.md
    is replaced by the run's card, whose command, run again, trains the same adapter."""
    from peft import PeftModel

    out, res = lora_run, results(lora_run)
    assert res["world_size"] == 2 and res["distributed_type"] == "MULTI_CPU"
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_lm["model"])
    trainable = res["parameters"] - sum(p.numel() for p in base.parameters())
    assert trainable > 0
    model = PeftModel.from_pretrained(base, out)
    lora = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora and any(p.abs().sum() > 0 for p in lora.values()), "lora_B starts at zero; training moved it"
    assert eval_loss(out, tiny_lm, chat=True, model=model) == pytest.approx(res["eval_loss"], rel=1e-5)

    merged = out / "merged"
    assert not (merged / "adapter_config.json").exists() and not (merged / "README.md").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(merged)
    assert type(reloaded).__name__ == "LlamaForCausalLM" and not any(
        "lora" in n for n, _ in reloaded.named_parameters()
    )
    assert eval_loss(merged, tiny_lm, chat=True, model=reloaded) == pytest.approx(res["eval_loss"], rel=1e-5)
    weights, initial = load_file(merged / "model.safetensors"), load_file(tiny_lm["model"] / "model.safetensors")
    assert weights.keys() == initial.keys() and all(weights[k].dtype == torch.float32 for k in weights)
    changed = {k for k in weights if not torch.equal(weights[k], initial[k])}
    assert len(changed) == 14 and all(k.endswith("proj.weight") for k in changed)  # the 7 linear layers of 2 blocks
    # peft's README.md is replaced by the card; the card's command, run again, trains the same adapter
    meta, text = card(out)
    assert meta["library_name"] == "peft" and "lora" in meta["tags"] and "a LoRA adapter of rank 8" in text
    assert f"`AutoModelForCausalLM.from_pretrained({str(out / 'merged')!r})`, without peft" in text
    command = res["launch"]["command"]
    assert f"```bash\n{command}\n```" in text and "--num_processes 2" in command
    first = out.parent / "first"
    out.rename(first)
    out.mkdir()
    (out / "README.md").write_bytes(b"# My notes\n\nmine, not a run's\n")  # a user's: kept byte for byte
    proc = run(shlex.split(command), env=user_env())
    again, before = results(out), results(first)
    for key in ("eval_loss", "train_loss", "steps", "samples_seen", "effective_batch_size", "learning_rate"):
        assert again[key] == pytest.approx(before[key], rel=1e-6), key
    assert [h["train_loss"] for h in again["log_history"]] == pytest.approx(
        [h["train_loss"] for h in before["log_history"]], rel=1e-6
    )
    assert (out / "README.md").read_bytes() == b"# My notes\n\nmine, not a run's\n"
    assert f"{out / 'README.md'} is no run's (yours?): kept as it is, and the model card not written" in proc.stderr
    assert "README.md" not in json.loads((out / ".model-files.json").read_text())["files"]
    assert is_png(out / "training_curves.png")
    out.rename(out.parent / "again")  # the first run back in its place, for the other tests of lora_run
    first.rename(out)


# A task of lm-evaluation-harness's own form, on a local file: the next number of a count, one of four choices,
# scored by the log-likelihood of each (multiple choice), the right one at each position in turn.
NEXT_NUMBER_TASK = """\
task: next_number
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""


def next_number_rows() -> list:
    numbers = "zero one two three four five six seven eight nine".split()
    rows = []
    for i in range(12):
        count = [numbers[(i + k) % 10] for k in range(5)]
        choices = [numbers[(i + k) % 10] for k in (7, 2, 9)]
        choices.insert(i % 4, count.pop())
        rows.append({"context": " ".join(count), "choices": choices, "label": i % 4})
    return rows


@pytest.mark.slow
def test_lm_eval_scores_a_lora_runs_merged_model_offline_as_the_docs_say(lora_run, tmp_path):
    """docs/lm.md's lm_eval line on the LoRA run's merged/, offline, with a task written here (--tasks replaced by it,
    found through --include_path): its results JSON holds the task's accuracy over every row, and the log-likelihoods
    it logged (--log_samples) and that accuracy are the ones the merged model gives, computed here."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -e '.[eval]'")
    (line,) = [line for line in (REPO / "docs" / "lm.md").read_text().splitlines() if line.startswith("lm_eval ")]
    rows = next_number_rows()
    (tmp_path / "next_number.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "next_number.yaml").write_text(NEXT_NUMBER_TASK.format(data=tmp_path / "next_number.jsonl"))
    words = [word.replace("pretrained=outputs/lm", f"pretrained={lora_run}") for word in shlex.split(line)]
    words[words.index("--tasks") + 1] = "next_number"
    extra = ["--include_path", tmp_path / "tasks", "--output_path", tmp_path / "results", "--log_samples"]
    run([BIN / words[0], *words[1:], *extra], env=cpu_env(HF_DATASETS_CACHE=str(tmp_path / "cache")), cwd=tmp_path)
    (written,) = (tmp_path / "results").rglob("results_*.json")
    report = json.loads(written.read_text())
    accuracy = report["results"]["next_number"]["acc,none"]
    assert isinstance(accuracy, float) and 0 <= accuracy <= 1
    assert report["n-samples"]["next_number"] == {"original": len(rows), "effective": len(rows)}
    (samples,) = (tmp_path / "results").rglob("samples_next_number_*.jsonl")
    logged = {}
    for sample in map(json.loads, samples.read_text().splitlines()):
        logged[sample["doc_id"]] = [float(likelihood) for likelihood, _ in sample["filtered_resps"]]

    tokenizer = AutoTokenizer.from_pretrained(lora_run / "merged")
    model = AutoModelForCausalLM.from_pretrained(lora_run / "merged")
    right = 0
    for n, row in enumerate(rows):
        context = tokenizer(row["context"])["input_ids"]
        scores = []
        for choice in row["choices"]:
            ids = tokenizer(f"{row['context']} {choice}")["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
            scores.append(sum(logits[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
        assert logged[n] == pytest.approx(scores, abs=1e-4), row
        right += max(range(len(scores)), key=scores.__getitem__) == row["label"]
    assert accuracy == pytest.approx(right / len(rows))


@pytest.mark.parametrize(
    "extra, subject",
    [
        (["--text_column", "body"], "--text_column"),
        (["--block_size", "128"], "--block_size"),
        (["--model_name_or_path", "/no/such/model"], "--model_name_or_path"),
        (["--lora_r", "64"], "--lora_r"),
    ],
)
def test_bad_input_gets_one_error_line(tiny_lm, tmp_path, extra, subject):
    """The recipe's own process (python recipes/lm_finetune.py, forked warm: input validation needs no launcher; a
    recipe's error through launch.sh: tests/test_launch_sh.py): exit 2, one error line naming the option, no output
    folder. The rule for every refusal, read from its fields: tests/test_refusals.py."""
    out = tmp_path / "run"
    proc = run([BIN / "python", RECIPE, *lm_args(tiny_lm, out), *extra], check=False)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and subject in lines[0], proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_a_larger_tokenizer_is_refused_naming_the_option_and_with_it_trains_and_saves_the_new_vocabulary(
    tiny_lm, tmp_path
):
    """--tokenizer_name with 2 more tokens than the model's 17: refused in one line naming
    --resize_token_embeddings; with it, the embeddings and the output layer grow to 19 rows (the 17
    pretrained ones kept), training uses the new tokens, and the saved folder loads with from_pretrained
    at 19, with the larger tokenizer."""
    from accelerate import PartialState

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    tokenizer.add_tokens(["eleven", "twelve"])
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "train.jsonl"
    data.write_text(tiny_lm["train"].read_text().replace("five", "eleven").replace("six", "twelve"))
    lm = load_recipe("lm_finetune")
    PartialState()
    argv = [str(a) for a in lm_args(tiny_lm, tmp_path / "unused", "--tokenizer_name", tmp_path / "tokenizer")]
    args = lm.parse_args(argv)
    with pytest.raises(
        RecipeError,
        match="the tokenizer has 19 tokens but the model's vocabulary has 17 "
        r"\(config.vocab_size\): pass --resize_token_embeddings",
    ):
        lm.load_model_and_tokenizer(args)
    args = lm.parse_args(["--config_name", *argv[1:]])  # a new model: built at the tokenizer's size, not grown
    with pytest.raises(
        RecipeError, match="vocabulary has 17 .config.vocab_size.: pass --config_overrides vocab_size=19"
    ):
        lm.load_model_and_tokenizer(args)

    out = tmp_path / "run"
    proc = run(
        [
            BIN / "python",
            RECIPE,
            *lm_args(
                tiny_lm,
                out,
                "--train_file",
                data,
                "--tokenizer_name",
                tmp_path / "tokenizer",
                "--resize_token_embeddings",
                "--max_train_steps",
                "4",
            ),
        ]
    )
    assert "--resize_token_embeddings: 17 -> 19 embeddings" in proc.stderr
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert saved.config.vocab_size == 19 and saved.get_input_embeddings().weight.shape == (19, 64)
    assert saved.get_output_embeddings().weight.shape == (19, 64) and len(AutoTokenizer.from_pretrained(out)) == 19
    before = AutoModelForCausalLM.from_pretrained(tiny_lm["model"]).get_input_embeddings().weight
    after = saved.get_input_embeddings().weight
    moved = (after[:17] - before).norm() / before.norm()
    assert 0 < moved < 0.5, moved  # the pretrained rows trained a little (measured 0.21), not replaced (about 1.4)
    start = before.mean(0)  # the new rows start there (mean resizing; these 17 rows' covariance is singular)
    assert all((row - start).norm() > 0.1 * start.norm() for row in after[17:])  # the new tokens trained theirs
    assert results(out)["steps"] == 4 and math.isfinite(results(out)["eval_loss"])


@pytest.mark.slow
def test_config_name_trains_a_new_model_built_from_the_config(tiny_lm, tmp_path):
    """--config_name (with --config_overrides, as zero.py takes them): the model is the config's, one layer
    here, randomly initialized (its weights are not the folder's), trained and saved loadable."""
    out = tmp_path / "run"
    args = [
        str(a)
        for a in lm_args(
            tiny_lm, out, "--config_overrides", "num_hidden_layers=1", "--max_train_steps", "4", "--logging_steps", "1"
        )
    ]
    args[args.index("--model_name_or_path")] = "--config_name"
    run([BIN / "python", RECIPE, *args])
    saved = AutoModelForCausalLM.from_pretrained(out)
    pretrained = AutoModelForCausalLM.from_pretrained(tiny_lm["model"])
    assert saved.config.num_hidden_layers == 1 and len(saved.model.layers) == 1
    a, b = saved.model.layers[0].mlp.up_proj.weight, pretrained.model.layers[0].mlp.up_proj.weight
    assert (a - b).norm() > 0.5 * b.norm()  # another draw, not the folder's weights trained for 4 steps
    res = results(out)
    assert res["steps"] == 4 and len(res["log_history"]) == 4 and math.isfinite(res["eval_loss"])


def test_the_lm_data_order_follows_the_seed(tiny_lm, tmp_path):
    """The training order is the EpochSampler's, seeded by the run's --seed (a resume refuses another)."""
    from accelerate import Accelerator
    from transformers import AutoConfig

    from common.text import lm_dataloaders

    accelerator = Accelerator(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    config = AutoConfig.from_pretrained(tiny_lm["model"])
    lm_finetune = load_recipe("lm_finetune")
    orders = []
    for seed in (7, 8):
        args = lm_finetune.parse_args([str(a) for a in lm_args(tiny_lm, tmp_path / "unused", "--seed", str(seed))])
        train, _, _ = lm_dataloaders(args, accelerator, tokenizer, config)
        assert train.sampler.seed == seed
        orders.append(train.sampler.order(0).tolist())
    assert orders[0] != orders[1]


def test_held_out_prompts_are_a_documents_first_half_or_a_conversation_to_its_last_reply(tiny_lm, tmp_path):
    """The default prompts are the first held-out rows, as the run holds them out; a prompt or --max_new_tokens that
    does not fit the model's positions is one line."""
    from common.samples import prompts_for

    lm, tokenizer = load_recipe("lm_finetune"), AutoTokenizer.from_pretrained(tiny_lm["model"])
    config = AutoModelForCausalLM.from_pretrained(tiny_lm["model"]).config  # 64 positions
    args = lm.parse_args([str(a) for a in chat_args(tiny_lm, tmp_path / "unused", 4)])
    held_out = load_raw_datasets(train_file=tiny_lm["chat_varied"], validation_split_percentage=10, seed=args.seed)
    conversations = held_out["validation"]["messages"][:4]
    expected = [f"<|user|> {c[0]['content']} <|end|> <|assistant|> " for c in conversations]
    assert [shown for shown, _ in prompts_for(args, tokenizer, config)] == expected  # no prepared data: the raw rows
    # Prepared, the data keeps its first held-out rows: the prompts are read from there, not from the corpus again
    PartialState()
    args.prepared_data_dir = str(tmp_path / "prepared")
    prepared_blocks(args, tokenizer, block_size_for(args, tokenizer, config))
    assert (tmp_path / "prepared" / "held_out.jsonl").is_file()
    with mock.patch("common.text.load_raw_datasets", side_effect=AssertionError("the corpus read again")):
        assert [shown for shown, _ in prompts_for(args, tokenizer, config)] == expected
    asked = tmp_path / "asked.jsonl"  # a training row: the reply it ends with is the model's to write
    asked.write_text(tiny_lm["chat"].read_text().splitlines()[0] + "\n")
    args.sample_prompts = asked
    ((shown, ids),) = prompts_for(args, tokenizer, config)
    question = json.loads(asked.read_text())["messages"][0]["content"]
    assert shown == f"<|user|> {question} <|end|> <|assistant|> " and tokenizer.decode(ids) == shown.strip()
    long = tmp_path / "long.txt"
    long.write_text(" ".join(["one"] * 45) + "\n")  # 45 tokens and 20 new: past 64
    args = lm.parse_args([str(a) for a in lm_args(tiny_lm, tmp_path / "unused", "--sample_prompts", long)])
    with pytest.raises(RecipeError, match=f"--sample_prompts {long}: prompt 1 is 45 tokens, and with --max_new_"):
        prompts_for(args, tokenizer, config)
    args.max_new_tokens = 64
    with pytest.raises(RecipeError, match="--max_new_tokens 64 leaves no room for a prompt in the 64 positions"):
        prompts_for(args, tokenizer, config)


def test_samples_are_greedy_in_eval_mode_draw_no_random_number_and_end_at_the_first_eos(tiny_lm):
    from accelerate import Accelerator

    from common.samples import generate

    accelerator, tokenizer = Accelerator(cpu=True), AutoTokenizer.from_pretrained(tiny_lm["model"])
    tokenizer.pad_token = tokenizer.eos_token  # as load_causal_lm sets it
    model = accelerator.prepare(AutoModelForCausalLM.from_pretrained(tiny_lm["model"]).train())
    modes = []
    model.model.layers[0].register_forward_hook(lambda module, *_: modes.append(module.training))
    prompts = [(text, tokenizer(text)["input_ids"]) for text in ("one two three", "seven")]  # left-padded
    rng = torch.get_rng_state()
    completions = generate(accelerator, model, tokenizer, prompts, 12)
    assert torch.equal(torch.get_rng_state(), rng) and model.training and modes and not any(modes)
    assert completions == generate(accelerator, model, tokenizer, prompts, 12)  # greedy
    for (_, ids), completion in zip(prompts, completions):
        alone = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=1)[0, len(ids) :]
        words = tokenizer.convert_ids_to_tokens(alone)
        assert completion.split() == words[: words.index("<eos>") + 1 if "<eos>" in words else None]


def test_a_resumed_run_keeps_the_samples_of_the_evaluations_its_checkpoint_recorded(tmp_path):
    """The rows of later evaluations (a resume from an older checkpoint trains them again) and of one the checkpoint
    was saved before (the final evaluation, run again) go, as does a line cut short by a kill."""
    from common.samples import keep_recorded

    path = tmp_path / "samples.jsonl"
    rows = [{"step": s, "samples_seen": 8 * s, "prompt": p, "completion": "c"} for s in (4, 8, 12) for p in "ab"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 14, "samp')
    keep_recorded(path, [{"step": 4, "samples_seen": 32}, {"step": 8, "samples_seen": 64}])
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
