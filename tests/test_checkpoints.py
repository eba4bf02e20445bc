"""What a run may do to --output_dir, and what it must never lose: checkpoints that replace a
damaged one of their step, --save_total_limit, crashes inside a save, checksums, a finished run
resumed, two runs into one folder, --overwrite_output_dir, a full disk.

The rules of checkpoint.py and outputs.py are tested in this process with a real Accelerator and real saves;
what a user sees (exit codes, the one error line, a lock held by a running recipe, a full
filesystem) with real launches of lm_finetune.py."""

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from conftest import BIN, REPO, error_lines, free_port, lm_args, run, snapshot, user_env
from safetensors.torch import load_file

from common import checkpoint as ckpt
from common import outputs
from common.runtime import RecipeError, RunFinished, exit_codes

LM = REPO / "recipes" / "lm_finetune.py"


# In this process ----------------------------------------------------------------------------------


@pytest.fixture
def acc():
    """A prepared model and optimizer, as a recipe holds them when it saves."""
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))  # a checkpoint of 0.8 MB
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(2, 256)).sum().backward()
    optimizer.step()  # Adam's moments exist: the optimizer file has its real size
    yield accelerator, model
    outputs._RunLock.release_all()


def save(acc, out, step, limit=None):
    accelerator, model = acc
    return ckpt.write_checkpoint(accelerator, out, step, {"epoch": 0, "samples_in_epoch": step}, limit, model)


def change_weights(acc):
    with torch.no_grad():
        for p in acc[1].parameters():
            p.add_(1.0)


def steps(out):
    return sorted(int(p.name.split("-")[1]) for p in Path(out).iterdir() if ckpt.CHECKPOINT_RE.fullmatch(p.name))


def options(out, **kw):
    given = {
        "output_dir": str(out),
        "resume_from_checkpoint": None,
        "overwrite_output_dir": False,
        "recipe": "t",
        **kw,
    }
    return argparse.Namespace(**given)


def damage(path, how):
    if how == "truncated":
        file = path / "optimizer.bin"
        file.write_bytes(file.read_bytes()[:100])
    elif how == "bytes altered":  # same size: only the checksum tells
        file = path / "model.safetensors"
        data = bytearray(file.read_bytes())
        data[-7] ^= 0xFF
        file.write_bytes(bytes(data))
    elif how == "position altered":  # the marker itself: where a resume would start
        marker = path / ckpt.STATE_FILE
        marker.write_text(marker.read_text().replace('"samples_in_epoch": 6', '"samples_in_epoch": 7'))
    elif how == "marker cut short":  # a copy, or a disk, that stopped inside it
        marker = path / ckpt.STATE_FILE
        marker.write_text(marker.read_text()[:100])
    elif how == "marker empty":
        (path / ckpt.STATE_FILE).write_bytes(b"")
    else:  # a folder without its marker (an old copy cut short)
        (path / ckpt.STATE_FILE).unlink()


@pytest.mark.parametrize(
    "how", ["truncated", "bytes altered", "position altered", "marker cut short", "marker empty", "no marker"]
)
def test_a_complete_save_replaces_a_damaged_checkpoint_of_its_step_and_the_limit_keeps_intact_ones(
    acc, tmp_path, how, caplog
):
    """Whatever is damaged in the newest checkpoint, even the marker itself (a requeued job always passes latest),
    a resume with latest passes it over with a warning and continues from the one before; given by path, it is
    refused with a fix that, followed, resumes; a save of its step later replaces it."""
    out = tmp_path / "run"
    for step in (2, 4, 6):
        save(acc, out, step, limit=2)
    outputs._RunLock.release_all()
    assert steps(out) == [4, 6]
    damage(out / "checkpoint-6", how)
    if how != "no marker":  # given by path (a folder without its marker is refused as not a checkpoint)
        with pytest.raises(RecipeError, match="the checkpoint is damaged: .*or `latest` to pick the newest intact"):
            outputs.OutputDir(acc[0], options(out, resume_from_checkpoint=str(out / "checkpoint-6")))
        outputs._RunLock.release_all()
    with caplog.at_level(logging.WARNING, logger="recipes"):  # the run resumes there...
        assert (
            outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest")).resume_from
            == out / "checkpoint-4"
        )
    assert "ignoring damaged checkpoint" in caplog.text or "ignoring incomplete checkpoint" in caplog.text

    change_weights(acc)  # ...and reaches step 6 again, with other weights than the damaged folder's
    save(acc, out, 6, limit=2)
    assert steps(out) == [4, 6]
    assert ckpt.checkpoint_damage(out / "checkpoint-4") is None
    assert ckpt.checkpoint_damage(out / "checkpoint-6") is None
    saved = load_file(out / "checkpoint-6" / "model.safetensors")
    for name, value in acc[0].get_state_dict(acc[1]).items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert ckpt.resolve_checkpoint(out, "latest") == out / "checkpoint-6"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != outputs.LOCK_FILE]  # no .tmp-


def test_a_checkpoint_replaced_keeps_a_users_file_inside_its_shard_folder(tmp_path, acc):  # acc: the logger's state
    """DeepSpeed and FSDP checkpoints keep their shards in a folder (pytorch_model/): a note put there stays when a
    save of the same step replaces the checkpoint, as one beside the shards does."""
    final, tmp = tmp_path / "checkpoint-5", tmp_path / ".tmp-checkpoint-5"
    for folder, shard in ((final, b"old"), (tmp, b"new")):
        (folder / "pytorch_model").mkdir(parents=True)
        (folder / "pytorch_model" / "shard.pt").write_bytes(shard)
    ckpt.write_json(final / ckpt.STATE_FILE, {"files": {"pytorch_model/shard.pt": 3}})
    ckpt.write_json(tmp / ckpt.STATE_FILE, {"files": {"pytorch_model/shard.pt": 3}})
    for note in (final / "NOTES.txt", final / "pytorch_model" / "NOTES.txt"):
        note.write_text("mine")
    ckpt._install(tmp, final)
    files = ["NOTES.txt", "pytorch_model/NOTES.txt", "pytorch_model/shard.pt", ckpt.STATE_FILE]
    assert sorted(snapshot(tmp_path)) == sorted(f"checkpoint-5/{name}" for name in files)
    assert [(final / name).read_text() for name in files[:3]] == ["mine", "mine", "new"]


def test_a_checkpoint_replaced_over_one_whose_marker_is_unreadable_keeps_no_file_of_its_other_processes(tmp_path, acc):
    """A save of the same step over a checkpoint whose marker does not read (the run's own, damaged): the files the
    earlier save wrote once per process, of a process count the new save does not have (random states, ZeRO shards,
    torch.distributed.checkpoint shards), go with it, since a resume on that count would read them; a note stays."""
    final, tmp = tmp_path / "checkpoint-5", tmp_path / ".tmp-checkpoint-5"
    per_process = ["random_states_{}.pkl", "pytorch_model/zero_pp_rank_{}_mp_rank_00_optim_states.pt",
                   "pytorch_model_fsdp_0/__{}_0.distcp"]  # fmt: skip
    for folder, ranks in ((final, (0, 1)), (tmp, (0,))):
        for name in per_process:
            for rank in ranks:
                (folder / name.format(rank)).parent.mkdir(parents=True, exist_ok=True)
                (folder / name.format(rank)).write_text(f"{folder.name} {rank}")
    (final / ckpt.STATE_FILE).write_text('{"files": {"random_sta')  # cut short
    ckpt.write_json(tmp / ckpt.STATE_FILE, {"files": {name.format(0): 1 for name in per_process}})
    (final / "pytorch_model" / "NOTES.txt").write_text("mine")
    ckpt._install(tmp, final)
    kept = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file())
    assert kept == sorted([*(name.format(0) for name in per_process), "pytorch_model/NOTES.txt", ckpt.STATE_FILE])
    assert [(final / name.format(0)).read_text() for name in per_process] == [".tmp-checkpoint-5 0"] * 3
    assert (final / "pytorch_model" / "NOTES.txt").read_text() == "mine"


def test_the_limit_keeps_and_says_so_a_checkpoint_whose_marker_is_unreadable(acc, tmp_path, caplog):
    """Which files of a checkpoint are a run's only its marker says: one cut short is kept, with a warning, not
    reported deleted."""
    out = tmp_path / "run"
    save(acc, out, 2)
    marker = out / "checkpoint-2" / ckpt.STATE_FILE
    marker.write_text(marker.read_text()[:50])
    with caplog.at_level(logging.INFO, logger="recipes"):
        save(acc, out, 4, limit=1)
    assert marker.is_file() and "deleted" not in caplog.text
    assert f"kept {out / 'checkpoint-2'} (--save_total_limit 1): its trainer_state.json is unreadable" in caplog.text


def test_the_limit_keeps_the_intact_checkpoints_written_last_and_latest_is_the_one_written_last(acc, tmp_path):
    out = tmp_path / "run"
    for step in (2, 4, 6, 8):
        save(acc, out, step)
    damage(out / "checkpoint-6", "truncated")
    damage(out / "checkpoint-8", "truncated")
    save(acc, out, 7, limit=2)  # resumed from 4, the newest intact one: 6 and 8 are of the trajectory it left
    assert steps(out) == [4, 7]  # the 2 intact ones written last; 2 and the damaged 6 and 8 go
    save(acc, out, 9)
    save(acc, out, 3)  # a run resumed by path from an earlier step: its checkpoints are the newest
    assert ckpt.resolve_checkpoint(out, "latest") == out / "checkpoint-3"
    save(acc, out, 5, limit=2)
    assert steps(out) == [3, 5] and ckpt.resolve_checkpoint(out, "latest") == out / "checkpoint-5"


class Crash(BaseException):
    """The process dies here (BaseException: nothing in checkpoint.py catches it)."""


def crashing(monkeypatch, at):
    """os.replace, os.unlink and shutil.rmtree, the steps that change what `latest` sees, fail from call
    number `at` on, as if the process had died there. Returns the call counter."""
    calls = {"n": 0}

    def counted(real):
        def call(*args, **kwargs):
            if at is not None and calls["n"] >= at:
                raise Crash
            calls["n"] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "replace", counted(os.replace))
    monkeypatch.setattr(shutil, "rmtree", counted(shutil.rmtree))
    monkeypatch.setattr(os, "unlink", counted(os.unlink))
    return calls


@pytest.mark.parametrize(
    "before", ["an intact checkpoint-6 alone", "checkpoint-4 and a damaged checkpoint-6", "a note in checkpoint-6"]
)
def test_a_crash_at_any_moment_of_a_save_leaves_an_intact_checkpoint_that_latest_finds(
    acc, tmp_path, monkeypatch, before
):
    def setup(out):
        if before.startswith(("an intact", "a note")):
            save(acc, out, 6, limit=1)
            if before.startswith("a note"):  # it stays, in the checkpoint that replaces this one
                (out / "checkpoint-6" / "notes.txt").write_text("mine")
        else:
            save(acc, out, 4)
            save(acc, out, 6)
            damage(out / "checkpoint-6", "bytes altered")

    probe = tmp_path / "probe"
    setup(probe)
    with monkeypatch.context() as m:
        calls = crashing(m, None)
        save(acc, probe, 6, limit=1)
    assert calls["n"] >= 4  # the old folder out of the way, the new one in, the old one deleted, ...
    for at in range(calls["n"]):
        out = tmp_path / f"crash-{at}"
        setup(out)
        with monkeypatch.context() as m:
            crashing(m, at)
            with pytest.raises(Crash):
                save(acc, out, 6, limit=1)
        # The next run (a requeue, --max_restarts) resumes with `latest`.
        found = outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest")).resume_from
        outputs._RunLock.release_all()
        assert found is not None and ckpt.checkpoint_damage(found) is None, f"crash at step {at}: {found}"
        assert found.name in ("checkpoint-6", "checkpoint-4"), found
        assert not [p.name for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))]
        if before.startswith("a note"):
            assert (out / "checkpoint-6" / "notes.txt").read_text() == "mine"


def test_checksums_are_written_and_a_changed_byte_is_found(acc, tmp_path, caplog):
    out = tmp_path / "run"
    save(acc, out, 2)
    save(acc, out, 4)
    state = json.loads((out / "checkpoint-4" / ckpt.STATE_FILE).read_text())
    assert set(state["sha256"]) == set(state["files"]) >= {"model.safetensors", "optimizer.bin"}
    damage(out / "checkpoint-4", "bytes altered")
    assert (out / "checkpoint-4" / "model.safetensors").stat().st_size == state["files"]["model.safetensors"]
    assert ckpt._size_damage(out / "checkpoint-4")[0] is None  # sizes alone cannot tell
    with caplog.at_level(logging.WARNING, logger="recipes"):
        assert ckpt.resolve_checkpoint(out, "latest") == out / "checkpoint-2"
    assert "ignoring damaged checkpoint" in caplog.text
    assert "model.safetensors does not match the sha256" in caplog.text
    with pytest.raises(
        RecipeError, match="the checkpoint is damaged: model.safetensors does not match the sha256.*`latest`"
    ):
        ckpt.resolve_checkpoint(out, str(out / "checkpoint-4"))


def test_a_finished_runs_last_checkpoint_short_of_its_end_is_said_as_such(acc, tmp_path):
    """Resuming it with a larger --max_train_steps trains the steps after it again, on the longer schedule."""
    out = tmp_path / "run"
    save(acc, out, 4)
    ckpt.write_json(out / "results.json", {"steps": 6, "versions": {}, "finished_at": time.time()})
    with pytest.raises(RunFinished, match=rf"pass --resume_from_checkpoint {out / 'checkpoint-4'} \(step 4 of 6: the "
                       r"steps after it train again\) with a larger --max_train_steps"):  # fmt: skip
        outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest"))


def test_latest_on_a_finished_run_is_done_unless_it_was_trained_further(acc, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    save(acc, out, 4)
    ckpt.save_model(acc[0], acc[1], out)
    ckpt.write_json(out / "results.json", {"steps": 4, "versions": {}, "finished_at": time.time()})
    # a copy of the folder (cp -r, a download) gives its files new times, here the checkpoint's marker the newest:
    # the times the files record decide
    os.utime(out / "results.json", (time.time() - 60,) * 2)
    before = snapshot(out)
    with pytest.raises(
        RunFinished, match=f"{out} holds a finished run .results.json, 4 steps.: nothing left to train"
    ):
        outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest"))
    assert snapshot(out) == before and not (out / outputs.LOCK_FILE).exists()

    # The entry point turns it into one `done:` line and exit 0 (a requeued job that had finished).
    with pytest.raises(SystemExit) as exit_:
        with exit_codes():
            outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest"))
    assert exit_.value.code == 0
    assert [line for line in capsys.readouterr().err.splitlines() if line.strip()] == [
        f"done: {out} holds a finished run (results.json, 4 steps): nothing left to train; to train it further pass "
        f"--resume_from_checkpoint {out / 'checkpoint-4'} with a larger --max_train_steps or --num_train_epochs; to "
        "start over, pass "
        "--overwrite_output_dir instead of --resume_from_checkpoint"
    ]
    # A checkpoint folder given as the run's folder: named as one, nothing written
    line = rf"--output_dir {out / 'checkpoint-4'} is a checkpoint of the run in {out}; pass --output_dir {out} \("
    with pytest.raises(RecipeError, match=line):
        outputs.OutputDir(acc[0], options(out / "checkpoint-4", resume_from_checkpoint="latest"))
    assert snapshot(out) == before

    # Resumed by path to train further, the run saved checkpoint-6, then was stopped: `latest` continues it.
    save(acc, out, 6)
    assert outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest")).resume_from == out / "checkpoint-6"
    outputs._RunLock.release_all()
    # Resumed by path from an earlier step, the run saved checkpoint-3, then was stopped: `latest` continues that
    # trajectory, not the finished one nor the one at step 6.
    save(acc, out, 3)
    assert outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest")).resume_from == out / "checkpoint-3"
    outputs._RunLock.release_all()
    # A restart (--max_restarts) of a run resumed from checkpoint-4 continues from its own latest, not checkpoint-4.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    resumed = outputs.OutputDir(acc[0], options(out, resume_from_checkpoint=str(out / "checkpoint-4")))
    assert resumed.resume_from == out / "checkpoint-3"
    outputs._RunLock.release_all()
    # A restart of a job that began from checkpoint-4 and has saved nothing yet starts from checkpoint-4 again: the
    # newer checkpoints and the finished run were saved before torch's agent, its parent, started the job.
    for i, path in enumerate(ckpt.complete_checkpoints(out)):
        state = {**ckpt.read_state(path), "saved_at": 1e9 + i}
        ckpt.write_json(path / ckpt.STATE_FILE, {**state, ckpt.MARKER_HASH: ckpt.marker_digest(state)})
    ckpt.write_json(out / "results.json", {"steps": 4, "versions": {}, "finished_at": 1e9})
    resumed = outputs.OutputDir(acc[0], options(out, resume_from_checkpoint=str(out / "checkpoint-4")))
    assert resumed.resume_from == out / "checkpoint-4"


def test_overwrite_output_dir_deletes_what_runs_wrote_and_nothing_else(acc, tmp_path, tiny_lm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    for step in (2, 4):
        save(acc, out, step)
    lm = AutoModelForCausalLM.from_pretrained(tiny_lm["model"])
    ckpt.save_model(acc[0], lm, out, AutoTokenizer.from_pretrained(tiny_lm["model"]))
    written = json.loads((out / ckpt.MODEL_FILES).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(written)
    ckpt.write_json(out / "results.json", {"steps": 4, "versions": {}})
    (out / ".tmp-checkpoint-6").mkdir()  # a save that crashed
    for stopped in (".universal-checkpoint-4", ".tmp-zero-shards"):  # a stopped ZeRO conversion or fp32 export
        (out / stopped / "global_step4").mkdir(parents=True)
        (out / stopped / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(64))
    # The user's own things, some named like ours but not as we name them.
    for folder in ("best-checkpoint-final", "checkpoint-best", "my-checkpoint-3", "lm_finetune"):
        (out / folder).mkdir()
        (out / folder / "weights.bin").write_bytes(os.urandom(64))
    (out / "notes.txt").write_text("lr 3e-3 was too high")
    (out / "checkpoint-9.tar").write_bytes(b"an archive")
    users = {
        k: v
        for k, v in snapshot(out).items()
        if not k.startswith(("checkpoint-2", "checkpoint-4", ".universal-checkpoint-4", ".tmp-zero-shards"))
        and Path(k).name not in written
        and k not in ("results.json", ckpt.MODEL_FILES)
    }

    # Starting over and resuming at once contradict each other: refused before anything changes.
    before = snapshot(out)
    for spec in ("latest", str(out / "checkpoint-4")):
        with pytest.raises(RecipeError) as refused:
            outputs.OutputDir(acc[0], options(out, resume_from_checkpoint=spec, overwrite_output_dir=True))
        assert refused.value.subject == "--overwrite_output_dir"
        assert snapshot(out) == before

    assert outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True)).resume_from is None
    assert {k: v for k, v in snapshot(out).items() if k != outputs.LOCK_FILE} == users
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "best-checkpoint-final",
            "checkpoint-best",
            "my-checkpoint-3",
            "lm_finetune",
            "notes.txt",
            "checkpoint-9.tar",
            outputs.LOCK_FILE,
        ]
    )  # the lock: this run holds it until it exits

    # A later save replaces a save of other files entirely: no old shard or config stays beside it.
    ckpt.save_model(acc[0], lm, out)
    ckpt.save_model(acc[0], acc[1], out)
    assert json.loads((out / ckpt.MODEL_FILES).read_text())["files"] == ["model.safetensors"]
    assert not (out / "config.json").exists() and not (out / "generation_config.json").exists()


def lora_model(path, dtype=torch.float32):
    """The model at `path` with a LoRA adapter on every linear layer whose B is not zero: it changes the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # A's initialization too
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=dtype),
        LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def test_a_lora_models_save_is_also_merged_into_its_base_in_its_dtype_and_whole_or_not_at_all(acc, tiny_lm, tmp_path):
    """save_model of a peft LoRA model writes the adapter and merged/: the adapter merged into the base weights by
    peft, bit for bit, in their dtype (bf16 here, as a bf16 full fine-tune saves), with config, generation config and
    tokenizer, and no adapter_config.json or README.md, so that from_pretrained loads it alone. The trained model is
    left as it was. A second save replaces merged/ whole; a merge that fails (weights no longer finite) leaves the
    earlier save as it was and no half-written folder."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = acc[0].prepare(lora_model(tiny_lm["model"], torch.bfloat16))
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    expected = copy.deepcopy(model).merge_and_unload(safe_merge=True)  # peft's own, of the model in memory
    out, tokenizer = tmp_path / "run", AutoTokenizer.from_pretrained(tiny_lm["model"])
    for _ in range(2):
        ckpt.save_model(acc[0], model, out, tokenizer)
        assert sorted(p.name for p in (out / ckpt.MERGED).iterdir()) == [
            "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json",
        ]  # fmt: skip
        assert ckpt.MERGED in ckpt.model_files(out) and (out / "adapter_config.json").is_file()
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [ckpt.MODEL_FILES]
    merged = load_file(out / ckpt.MERGED / "model.safetensors")
    assert merged.keys() == expected.state_dict().keys()
    assert all(
        merged[k].dtype == torch.bfloat16 and torch.equal(merged[k], v) for k, v in expected.state_dict().items()
    )
    base = load_file(Path(tiny_lm["model"]) / "model.safetensors")
    assert sum(not torch.equal(merged[k], v.to(torch.bfloat16)) for k, v in base.items()) == 14  # 7 linear a layer
    assert json.loads((out / ckpt.MERGED / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(out / ckpt.MERGED)  # its dtype: "auto" in transformers 5
    ids = torch.tensor([[5, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected(input_ids=ids).logits)
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())  # merged on copies

    before = snapshot(out)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("inf"))
    with pytest.raises(ValueError, match="NaNs detected in the merged weights"):  # peft's safe merge checks
        ckpt.save_model(acc[0], model, out, tokenizer)
    assert snapshot(out) == before and not (out / ".tmp-model").exists()

    outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True))  # merged/ goes with the run's other files
    assert not (out / ckpt.MERGED).exists() and not (out / "adapter_config.json").exists()
    outputs._RunLock.release_all()
    (out / ckpt.MERGED).mkdir()
    (out / ckpt.MERGED / "notes.txt").write_text("mine")  # a user's merged/ is not written over, nor deleted
    with pytest.raises(RecipeError, match=r"holds files that no run of these recipes wrote \(merged\)"):
        outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True))
    assert (out / ckpt.MERGED / "notes.txt").read_text() == "mine"


def test_a_tied_output_head_gathered_once_is_merged_tied_and_a_missing_weight_is_refused(tmp_path):
    """ZeRO-3 may gather a tied head once: the merged model ties it again. A weight the gathered state dict lacks
    is an error, not a meta tensor that save_pretrained would write or trip on."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    model = lora_model(tmp_path / "tied")
    expected = {k: v.clone() for k, v in model.merge_and_unload(safe_merge=True).state_dict().items()}
    model = lora_model(tmp_path / "tied")
    head = "base_model.model.lm_head.weight"
    state_dict = {k: v for k, v in model.state_dict().items() if k != head}
    ckpt.save_merged(model, state_dict, tmp_path / "merged")
    assert state_dict == {}  # consumed
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(v, expected[k]) for k, v in reloaded.state_dict().items())
    state_dict = {k: v for k, v in model.state_dict().items() if not k.endswith("model.norm.weight")}
    with pytest.raises(RuntimeError, match="the gathered weights lack model.norm.weight"):
        ckpt.save_merged(model, state_dict, tmp_path / "merged-again")


def test_resuming_another_folders_checkpoint_is_a_new_run_in_this_folder(acc, tmp_path):
    """Continuing this folder's run by path is fine; another folder's checkpoint is a new run here,
    refused where a run is already, unless --overwrite_output_dir starts that folder over."""
    first, second = tmp_path / "first", tmp_path / "second"
    save(acc, first, 2)
    save(acc, second, 4)
    ckpt.write_json(second / "results.json", {"steps": 4, "versions": {}})
    before = snapshot(tmp_path)
    with pytest.raises(
        RecipeError,
        match=f"--output_dir {second} already holds a run .checkpoint-4, results.json. "
        f"and --resume_from_checkpoint {first / 'checkpoint-2'} is another folder's "
        "checkpoint; pass --overwrite_output_dir to start over there from it, or "
        "another --output_dir",
    ):
        outputs.OutputDir(acc[0], options(second, resume_from_checkpoint=str(first / "checkpoint-2")))
    assert snapshot(tmp_path) == before
    # A path that is not there is said to be missing (a typo of latest, too), not taken for a damaged checkpoint.
    for spec, said in ((second / "checkpoint-40", "no such file or directory; check the path"),
                       ("Latest", "no such file or directory (did you mean latest?); check the path")):  # fmt: skip
        with pytest.raises(RecipeError, match=re.escape(f"--resume_from_checkpoint {spec}: {said}")):
            outputs.OutputDir(acc[0], options(second, resume_from_checkpoint=str(spec)))
    # The run's folder itself is not a checkpoint: said so, not taken for another folder's checkpoint.
    said = f"--resume_from_checkpoint {second}: not a complete checkpoint .no trainer_state.json.; pass its newest, "
    with pytest.raises(RecipeError, match=f"{said}{second / 'checkpoint-4'}, or `latest`$"):
        outputs.OutputDir(acc[0], options(second, resume_from_checkpoint=str(second)))
    # ... and given with a new --output_dir, where `latest` alone would start over: the fix says where latest looks.
    elsewhere = f"{second / 'checkpoint-4'}, or `latest` with --output_dir {second} to continue that run in its folder"
    with pytest.raises(RecipeError, match=re.escape(elsewhere)):
        outputs.OutputDir(acc[0], options(tmp_path / "new", resume_from_checkpoint=str(second)))
    assert not (tmp_path / "new").exists()
    # A file given for a checkpoint: the checkpoint it is in, else the newest beside it, else what a checkpoint is.
    (second / "ckpt.bin").write_bytes(b"")
    (tmp_path / "weights.bin").write_bytes(b"")
    newest = second / "checkpoint-4"
    for spec, fix in ((newest / "trainer_state.json", f"the checkpoint folder it is in, {newest}"),
                      (second / "ckpt.bin", f"the newest checkpoint beside it, {newest}"),
                      (tmp_path / "weights.bin", "a checkpoint-<step> folder written by a recipe")):  # fmt: skip
        said = f"--resume_from_checkpoint {spec} is a file, not a checkpoint folder: pass {fix}"
        with pytest.raises(RecipeError, match=re.escape(said)):
            outputs.OutputDir(acc[0], options(second, resume_from_checkpoint=str(spec)))
    (second / "ckpt.bin").unlink()
    (tmp_path / "weights.bin").unlink()
    # A checkpoint of its own, given by path, continues the run (to train it further, say).
    assert (
        outputs.OutputDir(acc[0], options(second, resume_from_checkpoint=str(second / "checkpoint-4"))).resume_from
        == second / "checkpoint-4"
    )
    outputs._RunLock.release_all()
    assert snapshot(tmp_path) == before
    # Started over from the other folder's checkpoint: this folder's run is gone, the other one untouched.
    assert (
        outputs.OutputDir(
            acc[0], options(second, resume_from_checkpoint=str(first / "checkpoint-2"), overwrite_output_dir=True)
        ).resume_from
        == first / "checkpoint-2"
    )
    assert sorted(p.name for p in second.iterdir()) == [outputs.LOCK_FILE]
    assert snapshot(first) == {k.removeprefix("first/"): v for k, v in before.items() if k.startswith("first/")}


def test_a_refused_run_leaves_a_lock_file_as_it_found_it(acc, tmp_path):
    """A lock file left by a killed run (content, no lock) is no obstacle, and a run refused for
    another reason puts its content back; a lock held by a live process refuses the run."""
    out = tmp_path / "run"
    save(acc, out, 2)
    (out / outputs.LOCK_FILE).write_text("pid 1 on a node that was rebooted\n")
    before = snapshot(out)
    with pytest.raises(RecipeError, match="already holds a run"):
        outputs.OutputDir(acc[0], options(out))
    outputs._RunLock.release_all()
    assert snapshot(out) == before

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(out / outputs.LOCK_FILE)!r}, os.O_RDWR)\n"
                "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
                "print('locked', flush=True)\n"
                "time.sleep(120)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RecipeError, match=r"is in use by another run \(pid 1 on a node that was rebooted\); wait"):
            outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest"))
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()
    # The holder died: its lock with it.
    assert outputs.OutputDir(acc[0], options(out, resume_from_checkpoint="latest")).resume_from == out / "checkpoint-2"
    lock_text = (out / outputs.LOCK_FILE).read_text()
    assert lock_text.startswith(f"pid {os.getpid()} on {socket.gethostname()}, started ")
    outputs._RunLock.release_all()
    assert not (out / outputs.LOCK_FILE).exists()  # a run that went on removes the lock file at exit


def test_a_filesystem_without_locks_is_used_with_one_warning(acc, tmp_path, monkeypatch, caplog):
    def refuse(fd, operation):
        raise OSError(38, "Function not implemented")  # ENOSYS: Lustre mounted without -o flock

    monkeypatch.setattr(outputs.fcntl, "lockf", refuse)
    with caplog.at_level(logging.WARNING, logger="recipes"):
        assert outputs.OutputDir(acc[0], options(tmp_path / "run")).resume_from is None
    assert caplog.text.count("cannot lock --output_dir") == 1 and "would not be stopped" in caplog.text
    assert not (tmp_path / "run" / outputs.LOCK_FILE).exists()


# Real launches ------------------------------------------------------------------------------------


def lm(tiny_lm, out, *extra):
    return [BIN / "python", LM, *lm_args(tiny_lm, out, "--dataloader_num_workers", "0", *extra)]


def refused(cmd, folder, message):
    before = snapshot(folder)
    proc = run(cmd, check=False, timeout=180)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
    assert snapshot(folder) == before, "existing output changed"
    return lines[0]


@pytest.mark.slow
def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_run_leaves_no_lock(acc, tiny_lm, tmp_path):
    out = tmp_path / "run"
    with tempfile.TemporaryFile("w+") as log:
        cmd = lm(tiny_lm, out, "--max_train_steps", "1000", "--checkpointing_steps", "3")
        first = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=user_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not (out / "checkpoint-3" / ckpt.STATE_FILE).exists():
                assert first.poll() is None and time.monotonic() < deadline, "the first run did not reach checkpoint-3"
                time.sleep(0.05)
            first.send_signal(signal.SIGSTOP)  # frozen while it holds the lock: nothing changes under the test
            line = refused(
                lm(tiny_lm, out, "--resume_from_checkpoint", "latest"),
                out,
                f"--output_dir {out} is in use by another run (pid {first.pid} on {socket.gethostname()}, started ",
            )
            assert line.endswith("wait for it to end, or pass another --output_dir")
        finally:
            first.kill()  # like the OOM killer: no exit handler runs
            first.wait()
    assert (out / outputs.LOCK_FILE).exists()  # the file stays; the lock died with the process
    resumed = outputs.OutputDir(
        acc[0], options(out, resume_from_checkpoint="latest", recipe="lm_finetune")
    ).resume_from
    assert resumed is not None and resumed.name.startswith("checkpoint-")
    assert (out / outputs.LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


# A full disk --------------------------------------------------------------------------------------


def checkpoint_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a tmpfs of `size` bytes mounted in this process (as root, as CI runs)."""
    mounted = []

    def mount(size):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs in this process needs root")
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], capture_output=True, text=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    outputs._RunLock.release_all()
    for folder in mounted:
        subprocess.run(["umount", "-l", folder], check=True)


def test_a_full_disk_fails_the_save_with_one_line_and_keeps_every_checkpoint(acc, tmp_path, small_disk):
    probe = tmp_path / "probe"
    save(acc, probe, 2)
    size = checkpoint_bytes(probe / "checkpoint-2")

    # No checkpoint yet: the space needed is estimated from the model and optimizer state.
    out = small_disk(size // 4) / "run"
    with pytest.raises(RecipeError) as failed:
        save(acc, out, 2)
    needed = float(str(failed.value).split("it needs about ")[1].split(" kB")[0]) * 1e3
    assert 0.8 * size < needed < 1.2 * size, (needed, size)
    assert not out.exists() or not list(out.iterdir())

    # Two checkpoints fit, a third and the final weights do not.
    out = small_disk(int(2.2 * size)) / "run"
    outputs.OutputDir(acc[0], options(out))
    save(acc, out, 2)
    save(acc, out, 4)
    before = snapshot(out)
    with pytest.raises(
        RecipeError,
        match=f"^no space left on the filesystem of {out} to save the checkpoint "
        f"{out / 'checkpoint-6'}: it needs about .* kB, .* kB free; free space "
        "there or pass another --output_dir .the checkpoints already saved are "
        "intact.$",
    ):
        save(acc, out, 6)
    kept = [outputs.LOCK_FILE, "checkpoint-2", "checkpoint-4"]
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == kept
    with pytest.raises(
        RecipeError, match=f"^no space left on the filesystem of {out} to save the model in {out}: it needs about"
    ):
        ckpt.save_model(acc[0], acc[1], out)
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == kept
    assert ckpt.resolve_checkpoint(out, "latest") == out / "checkpoint-4"


@pytest.mark.slow
def test_a_full_disk_while_saving_a_checkpoint_stops_every_process_with_one_line(tiny_lm, tmp_path):
    """Two processes formed into one group the way srun starts them (no launcher in between, so
    each one's exit code is seen): the main process fails to write a checkpoint (it writes the
    weights and the optimizer state), the other may not. Both exit 2, at once, one error line says
    how much a checkpoint needs, the checkpoints saved before stay intact and no half-written
    folder is left. In a mount namespace of its own (`unshare -rm`: no root needed)."""
    folder, after = tmp_path / "disk", tmp_path / "after"
    out = folder / "run"
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = (
            f"ACCELERATE_USE_CPU=true RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
            f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
        )
        args = lm(tiny_lm, out, "--max_train_steps", "20", "--checkpointing_steps", "2", "--ddp_timeout", "60")
        cmd = " ".join(shlex.quote(str(c)) for c in args)
        ranks.append(f"env {env} timeout 240 {cmd} 2> {tmp_path}/rank{rank}.err & pid{rank}=$!")
    # 2.5 MB: two checkpoints of the tiny model (0.95 MB each) fit, not three.
    script = (
        f"mount -t tmpfs -o size=2500k tmpfs {folder} || exit 99\n"
        + "\n".join(ranks)
        + f'\nwait $pid0; rc0=$?; wait $pid1; rc1=$?; echo "exit codes $rc0 $rc1"; cp -a {folder}/. {after}/'
    )
    folder.mkdir()
    after.mkdir()
    try:
        proc = subprocess.run(
            ["unshare", "-rm", "bash", "-c", script],
            cwd=REPO,
            env=user_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    except FileNotFoundError:
        pytest.skip("no unshare here: cannot mount a small filesystem")
    if proc.returncode == 99 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr[:300]}")
    assert "exit codes 2 2" in proc.stdout, proc.stdout + proc.stderr
    stderr = [(tmp_path / f"rank{rank}.err").read_text() for rank in (0, 1)]
    lines = error_lines(stderr[0]) + error_lines(stderr[1])
    assert len(lines) == 1, stderr[0][-3000:] + stderr[1][-3000:]
    assert not any("Traceback" in text for text in stderr)
    failed = int(lines[0].split(f"to save the checkpoint {out}/checkpoint-")[1].split(":")[0])
    assert lines[0].startswith(
        f"error: no space left on the filesystem of {out} to save the checkpoint {out}/checkpoint-"
    )
    assert "it needs about " in lines[0] and "free; free space there or pass another --output_dir" in lines[0]
    saved = sorted(p.name for p in (after / "run").iterdir())
    assert failed >= 4 and saved == [f"checkpoint-{step}" for step in range(2, failed, 2)]  # no .tmp-, no results.json
    for name in saved:
        assert ckpt.checkpoint_damage(after / "run" / name) is None
