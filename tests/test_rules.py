"""The rules a run holds whatever the case, each tried on cases of its own: a run writes only what it owns; a
stop is honoured from a process's first line, with an exit code a requeue understands; an operating-system
error names the path, where it came from and the fix; no mean is taken over data that holds nothing to average;
what a run writes, its user's group can read."""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from accelerate import Accelerator
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    FAST_MODEL,
    REPO,
    digits_args,
    error_lines,
    free_port,
    lm_args,
    load_recipe,
    read_only,
    results,
    run,
    snapshot,
    user_env,
)  # fmt: skip

from common import checkpoint as ckpt
from common import outputs
from common.runtime import LOST_PEERS, RecipeError

LM = REPO / "recipes" / "lm_finetune.py"


@pytest.fixture
def acc():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model, optimizer = accelerator.prepare(
        torch.nn.Linear(8, 8), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
    )
    yield accelerator, model
    outputs._RunLock.release_all()


def options(out, **kw):
    import argparse

    given = {"resume_from_checkpoint": None, "overwrite_output_dir": False, **kw}
    return argparse.Namespace(output_dir=str(out), recipe="t", **given)


# 1. A run writes only what it owns ----------------------------------------------------------------


@pytest.mark.parametrize("flags", [{}, {"resume_from_checkpoint": "latest"}, {"overwrite_output_dir": True}])
@pytest.mark.parametrize(
    "what",
    ["a model", "results.json", "another trainer's checkpoints", "a link to a checkpoint", "samples.jsonl"],
)
def test_a_folder_holding_what_no_run_wrote_is_never_written_over(acc, tiny_lm, tmp_path, flags, what):
    """--output_dir pointed at the pretrained model's own folder, at a folder with a results.json of the user's, or
    at transformers Trainer's output (checkpoint-500/trainer_state.json): refused whatever the flags, the folder as
    it was. A checkpoint or results.json is a run's when its record names the recipe."""
    folder = tmp_path / "folder"
    if what == "a model":
        shutil.copytree(tiny_lm["model"], folder)
    elif what == "results.json":
        folder.mkdir()
        (folder / "results.json").write_text('{"my": "own results"}')
    elif what == "another trainer's checkpoints":
        (folder / "checkpoint-500").mkdir(parents=True)
        (folder / "checkpoint-500" / "trainer_state.json").write_text('{"global_step": 500, "log_history": []}')
        (folder / "checkpoint-500" / "pytorch_model.bin").write_bytes(b"weights")
    elif what == "samples.jsonl":  # a user's prompts, say
        folder.mkdir()
        (folder / "samples.jsonl").write_text('{"prompt": "count from one"}\n')
    elif what == "a link to a checkpoint":  # another run's, whose files rotation or --overwrite_output_dir deleted
        (target := tmp_path / "other" / "checkpoint-8").mkdir(parents=True)
        (target / "trainer_state.json").write_text('{"sha256": {"w.bin": "0"}, "files": {"w.bin": 1}}')
        (target / "w.bin").write_bytes(b"w")
        folder.mkdir()
        (folder / "checkpoint-8").symlink_to(target)
    before = snapshot(tmp_path)
    named = {"a model": "model.safetensors, config", "results.json": "results.json (no versions in results.json"}
    named["another trainer's checkpoints"] = "checkpoint-500 (no sha256 in trainer_state.json: another program's)"
    named["a link to a checkpoint"] = "checkpoint-8 (a symbolic link)"
    named["samples.jsonl"] = "samples.jsonl (not the rows a run's samples are)"
    with pytest.raises(
        RecipeError, match=f"holds files that no run of these recipes wrote \\({re.escape(named[what])}"
    ):
        outputs.OutputDir(acc[0], options(folder, **flags))
    assert snapshot(tmp_path) == before


def test_a_checkpoint_whose_record_is_cut_short_is_a_runs_damaged_one_and_is_never_deleted(acc, tmp_path):
    """A checkpoint-<step> whose trainer_state.json does not read (a copy cut short, a disk error) is a run's,
    damaged, not another program's (whose record reads and lacks the checksums): a new run is told the folder holds a
    run, latest says every checkpoint is damaged, and --overwrite_output_dir starts over without deleting it (which of
    its files a run wrote, its record no longer says)."""
    folder = tmp_path / "folder"
    (folder / "checkpoint-8").mkdir(parents=True)
    (folder / "checkpoint-8" / "trainer_state.json").write_text('{"sha256": {"w.b')
    (folder / "checkpoint-8" / "w.bin").write_bytes(b"w")
    before = snapshot(tmp_path)
    for flags, said in (
        ({}, "already holds a run \\(checkpoint-8\\); pass --resume_from_checkpoint latest to continue it"),
        ({"resume_from_checkpoint": "latest"}, "every checkpoint in .* is damaged \\(the newest, checkpoint-8: "
                                               "trainer_state.json is unreadable"),
    ):  # fmt: skip
        with pytest.raises(RecipeError, match=said):
            outputs.OutputDir(acc[0], options(folder, **flags))
        outputs._RunLock.release_all()
        assert snapshot(tmp_path) == before
    outputs.OutputDir(acc[0], options(folder, overwrite_output_dir=True))
    assert {k: v for k, v in snapshot(tmp_path).items() if "checkpoint-8" in k} == before


def test_a_runs_samples_are_a_run_in_the_folder_and_go_with_overwrite(acc, tmp_path):
    """samples.jsonl (common.samples) is the run's: a new run there is refused as it is beside a results.json, and
    --overwrite_output_dir deletes it, with the temporary file a resume rewrites it through."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "samples.jsonl").write_text('{"step": 4, "samples_seen": 32, "prompt": "one", "completion": "two"}\n{"st')
    (out / ".samples.jsonl.tmp").write_text("")
    with pytest.raises(RecipeError, match=r"already holds a run \(samples.jsonl, .samples.jsonl.tmp\); pass"):
        outputs.OutputDir(acc[0], options(out))
    outputs._RunLock.release_all()
    outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True))
    assert sorted(p.name for p in out.iterdir()) == [outputs.LOCK_FILE]


def test_what_a_run_wrote_beside_its_weights_goes_with_them(acc, tmp_path):
    """zero.py's fp32/ export is recorded with the weights: --overwrite_output_dir removes it, not a user's folder."""
    out = tmp_path / "run"
    run = outputs.OutputDir(acc[0], options(out))
    run.save_model(acc[1])
    (out / "fp32").mkdir()
    (out / "fp32" / "model.safetensors").write_bytes(b"weights")
    (out / "fp32" / "model.safetensors").chmod(0o600)  # as DeepSpeed's converter writes it
    run.record_written("fp32")
    umask = os.umask(0o022)
    os.umask(umask)
    assert (out / "fp32" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # the user's group reads it
    (out / "mine").mkdir()
    outputs._RunLock.release_all()  # the run ended
    outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True))
    assert sorted(p.name for p in out.iterdir()) == [outputs.LOCK_FILE, "mine"]
    outputs._RunLock.release_all()
    # a user's own fp32/ where zero.py --save_fp32 would export: refused before the run, as any name a save writes
    (out / "fp32").mkdir()
    (out / "fp32" / "NOTES.txt").write_text("mine")
    with pytest.raises(RecipeError, match=r"holds files that no run of these recipes wrote \(fp32\)"):
        outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True))
    assert (out / "fp32" / "NOTES.txt").read_text() == "mine"


def test_a_model_card_a_library_writes_leaves_a_users_readme_as_it_is(acc, tmp_path):
    """peft's save_pretrained writes a README.md (a model card) beside the adapter: the user's README.md in
    --output_dir (their project's, with --output_dir .) stays, and the weights are saved, not refused after training;
    where there is none the card is the run's, recorded, and replaced by the next save."""

    class Carded(torch.nn.Linear):
        def save_pretrained(self, folder, state_dict, safe_serialization):
            from safetensors.torch import save_file

            Path(folder).mkdir()
            save_file({k: v.contiguous() for k, v in state_dict.items()}, Path(folder) / "adapter_model.safetensors")
            (Path(folder) / "README.md").write_text("a model card")

    model = acc[0].prepare(Carded(4, 4))
    for folder, readme in ((tmp_path / "project", "my project"), (tmp_path / "fresh", None)):
        folder.mkdir()
        if readme:
            (folder / "README.md").write_text(readme)
        for _ in range(2):
            outputs.OutputDir(acc[0], options(folder, overwrite_output_dir=True)).save_model(model)
            outputs._RunLock.release_all()
            assert (folder / "README.md").read_text() == (readme or "a model card")
            assert ("README.md" in ckpt.model_files(folder)) == (readme is None)
            assert (folder / "adapter_model.safetensors").is_file()


def test_an_option_that_does_nothing_is_no_input(acc, tmp_path, monkeypatch):
    """cifar's --data_dir (default data) is CIFAR's folder: an ImageFolder run under data/ may write to data/runs
    (--data_dir would itself be refused as doing nothing), and not inside --train_dir."""
    monkeypatch.chdir(tmp_path)
    for split in ("train", "val"):
        for label in ("a", "b"):
            (tmp_path / "data" / split / label).mkdir(parents=True)
    argv = ["--dataset", "imagefolder", "--train_dir", "data/train", "--val_dir", "data/val", "--model", "resnet18"]
    cifar = load_recipe("cifar")
    args = cifar.parse_args([*argv, "--output_dir", "data/runs/exp1"])
    cifar.parse_args(["--output_dir", "cifar_run"])  # a later parse in this process, whose --data_dir is an input
    outputs.OutputDir(acc[0], args)  # what does nothing is its own parse's
    outputs._RunLock.release_all()
    with pytest.raises(RecipeError, match="--output_dir data/train/runs lies inside --train_dir data/train, which"):
        outputs.OutputDir(acc[0], cifar.parse_args([*argv, "--output_dir", "data/train/runs"]))


def test_a_link_to_a_folder_that_is_gone_is_named_as_such(tmp_path):
    """A scratch folder purged under a link to it: the link and its missing target, not 'a file where a folder
    must be', which would have the user delete the link; named by the option the path is on."""
    from common.args import ArgumentParser
    from common.runtime import os_error_line

    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "scratch" / "runs")
    parser = ArgumentParser()
    parser.add_argument("--output_dir")
    for given in (link, link / "exp1"):
        args = parser.parse_args(["--output_dir", str(given)])  # held by the frame that fails, as main() holds it
        assert args.values_by_option == {"--output_dir": str(given)}
        with pytest.raises(OSError) as err:
            given.mkdir(parents=True, exist_ok=True)  # as the run lock's folder is made
        where = f"--output_dir {link}" if given == link else f"{link} (on the path of --output_dir {given})"
        assert os_error_line(err.value) == (
            f"{where}: a symbolic link to {tmp_path / 'scratch' / 'runs'}, which does not exist; create that "
            "folder, or remove the link"
        )


def test_an_os_error_names_the_option_of_the_parse_the_failing_code_ran_with(tmp_path):
    """The option a failing path came from is found in the arguments the failing code holds (the innermost frame's),
    not in the process's last parse: a test's later parse, or a forked warm process's earlier one, names nothing."""
    from common.args import ArgumentParser
    from common.runtime import os_error_line

    parser = ArgumentParser()
    parser.add_argument("--output_dir")
    (blocked := tmp_path / "file").write_text("not a folder")

    def save(args):  # as a recipe's code holds its own arguments
        Path(args.output_dir, "checkpoint-1").mkdir(parents=True)

    mine = parser.parse_args(["--output_dir", str(blocked)])
    later = parser.parse_args(["--output_dir", str(tmp_path / "other")])
    with pytest.raises(OSError) as err:
        save(mine)
    assert os_error_line(err.value) == (
        f"--output_dir {blocked}: file exists; it is a file where a folder must be: remove it or use another path"
    )
    assert later.values_by_option == {"--output_dir": str(tmp_path / "other")}  # each parse keeps its own


def test_an_os_error_on_a_file_kept_beside_an_options_folder_names_the_option(tmp_path):
    """The preparation's lock lives beside --prepared_data_dir (.<name>.<digest>.lock): on a read-only filesystem
    the line names the option whose folder it belongs to, whose other value is the fix."""
    import errno

    from common.args import ArgumentParser
    from common.runtime import os_error_line

    parser = ArgumentParser()
    parser.add_argument("--prepared_data_dir")
    folder = tmp_path / "prep"

    def prepare(args):  # as common.prepared.one_preparation takes its lock
        lock = Path(args.prepared_data_dir).parent / f".{Path(args.prepared_data_dir).name}.0123abcd.lock"
        raise OSError(errno.EROFS, "Read-only file system", str(lock))

    with pytest.raises(OSError) as err:
        prepare(parser.parse_args(["--prepared_data_dir", str(folder)]))
    line = os_error_line(err.value)
    assert line.startswith(f"{tmp_path}/.prep.0123abcd.lock (kept beside --prepared_data_dir {folder} while it is ")
    assert "read-only file system" in line


def test_files_a_save_did_not_write_outlive_overwrite_and_rotation(acc, tmp_path):
    """A checkpoint folder holds what its save wrote, listed in its marker: --overwrite_output_dir and
    --save_total_limit delete that, not a note a user put beside it, nor a checkpoint-<step>/ no save wrote."""
    out = tmp_path / "run"
    for step in (2, 4):
        ckpt.write_checkpoint(acc[0], out, step, {"args": {}}, model=acc[1])
    (out / "checkpoint-2" / "my_eval.txt").write_text("mine")
    (out / "checkpoint-999").mkdir()
    (out / "checkpoint-999" / "notes.txt").write_text("mine")
    ckpt.write_checkpoint(acc[0], out, 6, {"args": {}}, total_limit=1, model=acc[1])  # rotates 2 and 4 out
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-6", "checkpoint-999"]
    assert [p.name for p in (out / "checkpoint-2").iterdir()] == ["my_eval.txt"]
    outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True))
    assert sorted(p.name for p in out.iterdir()) == [outputs.LOCK_FILE, "checkpoint-2", "checkpoint-999"]
    assert (out / "checkpoint-2" / "my_eval.txt").read_text() == (out / "checkpoint-999" / "notes.txt").read_text()
    # a save replacing a folder of its step (a run resumed from an earlier checkpoint, a folder with a note alone):
    # what a save wrote there goes, the notes stay, and the new checkpoint is whole
    for step in (2, 999):
        ckpt.write_checkpoint(acc[0], out, step, {"args": {}}, model=acc[1])
        assert ckpt.checkpoint_damage(out / f"checkpoint-{step}") is None
    assert (out / "checkpoint-2" / "my_eval.txt").read_text() == (out / "checkpoint-999" / "notes.txt").read_text()
    written = set(ckpt.read_state(out / "checkpoint-2")["files"]) | {ckpt.STATE_FILE}
    assert {p.name for p in (out / "checkpoint-2").iterdir()} == written | {"my_eval.txt"}


def test_a_setting_set_or_unset_since_the_checkpoint_is_listed():
    """An option the checkpoint's run left unset (not recorded) and this one sets, or the reverse, changed too."""
    from argparse import Namespace

    saved = {"seed": 1, "learning_rate": 0.1, "weight_decay": 0.01, "max_train_steps": 8}
    now = Namespace(seed=1, learning_rate=0.1, weight_decay=None, warmup_steps=3, max_train_steps=20)
    assert ckpt.changed_settings(saved, now) == ["--warmup_steps None -> 3", "--weight_decay 0.01 -> None"]


def test_the_final_save_writes_over_nothing_that_appeared_since_the_start(acc, tmp_path):
    """A file of the user's with the name of one the model writes, put there while the run trained: refused, in one
    line naming it, the folder as it was; what a save moves in is recorded before it moves (a save cut short leaves
    nothing unrecorded)."""
    out = tmp_path / "run"
    (out / "model.safetensors").mkdir(parents=True)
    (out / "model.safetensors" / "x").write_text("mine")
    before = snapshot(out)
    with pytest.raises(RecipeError) as refused:
        ckpt.save_model(acc[0], acc[1], out)
    assert refused.value.subject == str(out / "model.safetensors")
    assert snapshot(out) == before and not (out / ".tmp-model").exists()
    shutil.rmtree(out / "model.safetensors")
    ckpt.save_model(acc[0], acc[1], out)
    assert ckpt.model_files(out) == ["model.safetensors"]


def test_an_output_dir_inside_an_input_folder_is_refused(acc, tmp_path):
    """An --output_dir inside --train_dir would add its folder to the data (an ImageFolder takes it for a class)."""
    (tmp_path / "train" / "cat").mkdir(parents=True)
    with pytest.raises(
        RecipeError, match=r"--output_dir .*/train/out lies inside --train_dir .*, which the run reads"
    ):
        outputs.OutputDir(acc[0], options(tmp_path / "train" / "out", train_dir=str(tmp_path / "train")))
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["cat"]


def test_an_input_inside_the_output_dir_is_refused_before_anything_is_deleted(acc, tmp_path, monkeypatch):
    """--pretrained_path (or --model_name_or_path) in the --output_dir of a finished run, with --overwrite_output_dir:
    the earlier run's model, which this run reads, was deleted and then reported missing."""
    out = tmp_path / "run"
    ckpt.save_model(acc[0], acc[1], out)
    before = snapshot(out)
    for name in ("pretrained_path", "model_name_or_path"):
        args = options(out, overwrite_output_dir=True, **{name: str(out / "model.safetensors")})
        with pytest.raises(RecipeError) as refused:
            outputs.OutputDir(acc[0], args)
        assert refused.value.subject == f"--{name}"
        assert snapshot(out) == before
    monkeypatch.chdir(
        out
    )  # a value that is no path but names a file there (an option's choice, the recipe's name) is no input
    (out / "t").mkdir()  # options()'s recipe, as a tracker's folder under a run started in its --output_dir
    outputs.OutputDir(acc[0], options(out, overwrite_output_dir=True, report_to="t", lr_scheduler_type="t"))


# Mistakes every process of a 2-process launch meets (or the main one, while the other waits for it): each launched
# once (the first test that needs it), for the test of its line and for the race between the processes' ends.


def _weights_inside_the_output_dir(folder, lm, digits):
    """--pretrained_path in the --output_dir, with --overwrite_output_dir: refused before the folder is claimed."""
    import torchvision
    from safetensors.torch import save_file

    out = folder / "run"
    out.mkdir()
    weights = {k: v.contiguous() for k, v in torchvision.models.resnet18().state_dict().items()}
    save_file(weights, out / "w.safetensors")
    extra = [*FAST_MODEL, "--pretrained_path", out / "w.safetensors", "--overwrite_output_dir"]
    extra += ["--max_train_steps", "1"]
    return ["cifar", "--num_processes", "2", *digits_args(digits, out, *extra)], {"CUDA_VISIBLE_DEVICES": ""}


def _a_model_folder_as_output_dir(folder, lm, digits):
    model = folder / "model"
    shutil.copytree(lm["model"], model)
    args = lm_args(lm, model, "--model_name_or_path", model, "--resume_from_checkpoint", "latest")
    return ["lm_finetune", *args], {"CUDA_VISIBLE_DEVICES": ""}


def _a_cache_that_is_a_file(folder, lm, digits):
    (folder / "file").write_text("not a folder")
    args = ["lm_finetune", "--config", "cpu", *lm_args(lm, folder / "run")]
    return args, {"HF_DATASETS_CACHE": str(folder / "file")}


def _a_path_under_a_file(folder, lm, digits):
    (folder / "file").write_text("not a folder")
    argv = [*lm_args(lm, folder / "run"), "--prepared_data_dir", folder / "file" / "prepared"]
    return ["lm_finetune", "--config", "cpu", *argv, "--max_train_steps", "1"], {}


def _a_block_size_the_model_does_not_take(folder, lm, digits):
    return ["lm_finetune", *lm_args(lm, folder / "run", "--block_size", "65")], {}


REFUSED_IN_TWO = {
    "weights inside the output_dir": _weights_inside_the_output_dir,
    "a model folder as output_dir": _a_model_folder_as_output_dir,
    "a cache that is a file": _a_cache_that_is_a_file,
    "a path under a file": _a_path_under_a_file,
    "a block_size the model does not take": _a_block_size_the_model_does_not_take,
}


@pytest.fixture(scope="module")
def refused_in_two(tiny_lm, digits, tmp_path_factory):
    """refused_in_two(name) -> (the finished ./launch.sh of REFUSED_IN_TWO[name], its folder, the folder's files
    before it): each launched once."""
    done = {}

    def launched(name):
        if name not in done:
            folder = tmp_path_factory.mktemp(name.replace(" ", "_"))
            args, env = REFUSED_IN_TWO[name](folder, tiny_lm, digits)
            before = snapshot(folder)
            proc = run([REPO / "launch.sh", *args], env=user_env(**env), check=False, timeout=240)
            done[name] = proc, folder, before
        return done[name]

    return launched


@pytest.mark.slow
def test_weights_inside_the_output_dir_through_launch_sh_are_one_line_and_left_as_they_were(refused_in_two):
    """In 2 processes, with --overwrite_output_dir: refused before the folder is claimed, nothing deleted."""
    proc, folder, before = refused_in_two("weights inside the output_dir")
    out = folder / "run"
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"--pretrained_path {out / 'w.safetensors'} lies inside --output_dir {out}, where the run saves" in lines[0]
    assert snapshot(folder) == before


@pytest.mark.slow
def test_a_model_folder_as_output_dir_through_launch_sh_is_one_line_and_left_as_it_was(refused_in_two):
    proc, folder, before = refused_in_two("a model folder as output_dir")
    model = folder / "model"
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"--output_dir {model} is --model_name_or_path {model}, which the run reads" in lines[0]
    assert snapshot(folder) == before


@pytest.mark.slow
def test_a_mistake_every_process_meets_is_one_line_and_exit_2_whichever_process_ends_first(refused_in_two):
    """Each process meets the mistake on its own (or the one waiting for the main process meets its error); torch's
    agent sends SIGTERM to the others once the first exits (2): the stop is not the cause, whoever it reached. Every
    launch of REFUSED_IN_TWO, as the order varies from one to the next (before: 3 of 7 ended in exit 75 and
    "preempted", no error line)."""
    for name in REFUSED_IN_TWO:
        proc, _, _ = refused_in_two(name)
        said = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "preempted:", "stopped:"))]
        assert proc.returncode == 2 and len(said) == 1 and said[0].startswith("error: "), (name, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
    proc, _, _ = refused_in_two("a block_size the model does not take")
    assert error_lines(proc.stderr) == [
        "error: --block_size 65 is larger than the model accepts (64, its config's max_position_embeddings); "
        "pass --block_size 64 or less"
    ], proc.stderr[-3000:]


# 3. A checkpoint resumes only what produced it, and a refusal names what differs ------------------


@pytest.mark.slow
def test_a_checkpoint_resumes_only_its_own_data_and_lists_every_setting_that_changed(tiny_lm, tmp_path):
    """Another file with as many rows, or the same file in other blocks, is other data: refused, naming what
    differs. A setting that changes the computation (clipping, weight decay, the schedule) is taken from this
    command line and listed."""
    out = tmp_path / "run"
    base = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--dataloader_num_workers", "0"]
    run([BIN / "python", LM, *lm_args(tiny_lm, out, *base, "--max_train_steps", "2")])
    other = tmp_path / "other.jsonl"  # the same number of rows, other sentences
    rows = tiny_lm["train"].read_text().splitlines()
    other.write_text("\n".join(json.dumps({"text": " ".join(reversed(json.loads(r)["text"].split()))}) for r in rows))
    before, resume = snapshot(out), ["--resume_from_checkpoint", out / "checkpoint-2"]  # the finished run, further
    for extra, differs in (
        (["--train_file", other], f"--train_file {tiny_lm['train']} -> {other}"),
        (["--block_size", "16"], "--block_size 32 -> 16"),
    ):
        proc = run([BIN / "python", LM, *lm_args(tiny_lm, out, *base, *extra, *resume)],
                   check=False)  # fmt: skip
        lines = error_lines(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert "was written for other training data" in lines[0] and f"this run differs in {differs}" in lines[0]
        assert snapshot(out) == before
    changed = ["--max_grad_norm", "0.5", "--weight_decay", "0.1", "--lr_scheduler_type", "linear"]
    proc = run([BIN / "python", LM, *lm_args(tiny_lm, out, *base, *changed, *resume)])
    assert (
        "with settings that differ from the checkpoint's: --lr_scheduler_type cosine -> linear, --weight_decay 0.0 -> "
        "0.1, --max_grad_norm 1.0 -> 0.5"
    ) in proc.stderr


@pytest.mark.slow
def test_another_norm_layer_is_another_model(digits, tmp_path):
    """GroupNorm in place of BatchNorm: the same parameters, other buffers. Refused, not loaded into other layers,
    naming the setting that made it another."""
    out = tmp_path / "run"
    args = digits_args(digits, out, *FAST_MODEL, "--max_train_steps", "2", "--checkpointing_steps", "2")
    run([BIN / "python", REPO / "recipes/cifar.py", *args, "--dataloader_num_workers", "0"])
    again = [*args, "--norm_layer", "group", "--resume_from_checkpoint", out / "checkpoint-2"]
    proc = run([BIN / "python", REPO / "recipes/cifar.py", *again], check=False)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "holds another model (other layers, as many" in lines[0], (
        proc.stderr[-3000:]
    )
    assert "this run differs from it in --norm_layer batch -> group; resume with the model arguments" in lines[0]
    # Another optimizer: the same model, another optimizer state, which fails to load: the change named as the cause
    again = [*args, "--optimizer", "adamw", "--resume_from_checkpoint", out / "checkpoint-2"]
    proc = run([BIN / "python", REPO / "recipes/cifar.py", *again], check=False)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].endswith(
        "this run differs from it in --optimizer sgd -> adamw: resume with the checkpoint's settings, or use another "
        "--output_dir"
    ), lines[0]


# 4. What the user asked for runs, or nothing runs -------------------------------------------------


def test_fp16_on_cpu_which_accelerate_would_quietly_replace_is_refused(tiny_lm, tmp_path):
    """fp16 on CPU trains fp32 while reporting fp16: one line instead. What `accelerate launch --mixed_precision fp16`
    gives each process (ACCELERATE_MIXED_PRECISION) given to one, which common.preflight refuses before the
    Accelerator is built (the DeepSpeed path, where a config file's fp16 decides, and what accelerate launch passes
    on: tests/test_launcher.py, in-process). (An FSDP config on CPU, which Accelerate would train as DDP, trains FSDP2
    here: tests/test_fsdp.py.)"""
    env = user_env(ACCELERATE_USE_CPU="true", ACCELERATE_MIXED_PRECISION="fp16")
    proc = run([BIN / "python", LM, *lm_args(tiny_lm, tmp_path / "r")], env=env, check=False)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: mixed precision fp16 needs a GPU: on CPU Accelerate trains in fp32"), lines
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_torch_compile_without_a_cpp_compiler_is_one_line_and_nothing_is_written(digits, tmp_path):
    """inductor's CPU code needs a C++ compiler: without one the first step failed in a 135-line traceback."""
    out = tmp_path / "run"
    cmd = [BIN / "python", REPO / "recipes/cifar.py", *digits_args(digits, out, "--max_train_steps", "2")]
    proc = run([*cmd, "--torch_compile"], env=user_env(CXX="/nonexistent/g++"), check=False, timeout=600)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: torch.compile (--torch_compile, --dynamo_backend inductor) needs a C++ compiler for inductor's CPU "
        "code, and it found none (or not $CXX); install g++ (apt install g++, conda install gxx), or train without "
        "compiling"
    ], proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, change, said",
    [  # accelerate launch refuses it, Accelerate's plugin does, DeepSpeed's config model does
        ("fsdp", {"fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": "sometimes"}}, "error: Accelerate "
         "cannot set up the accelerate config's settings here (ValueError: invalid truth value sometimes)"),
        ("zero2", {"deepspeed_config": {"zero_stage": 2, "offload_param_device": "gpu0"}}, "error: DeepSpeed "
         "refuses its config (DeepSpeedZeroConfig: offload_param.device: Input should be 'none', 'cpu' or 'nvme' "
         "(got 'gpu0'))"),  # offload_param: an optimizer offload would load DeepSpeed's CPU Adam first (6 s)
    ],
    ids=["fsdp plugin", "deepspeed"],
)  # fmt: skip
def test_a_config_value_a_library_refuses_is_one_line_and_nothing_is_written(tiny_lm, tmp_path, config, change, said):
    """A value of the accelerate config that Accelerate's plugins or DeepSpeed refuse is one line naming the value,
    wherever the library meets it, not a traceback. (One accelerate launch itself refuses: launch.sh relays it in one
    line, tests/test_launch_sh.py's typo.yaml, and tests/test_fixes.py follows its fix to a run.)"""
    import yaml

    path = tmp_path / "mine.yaml"
    path.write_text(
        yaml.safe_dump({**yaml.safe_load((REPO / f"accelerate_configs/{config}.yaml").read_text()), **change})
    )
    args = ["lm_finetune", "--config", path, *lm_args(tiny_lm, tmp_path / "r", "--max_train_steps", "1")]
    proc = run([REPO / "launch.sh", *args], env=user_env(CUDA_VISIBLE_DEVICES=""), check=False)
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(said.format(config=path)) and "Traceback" not in proc.stderr, lines
    assert not (tmp_path / "r").exists()


# 5. Every stop is honoured ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_before_training_ends_the_process_with_75_and_nothing_half_written(tiny_lm, tmp_path, sig):
    """Slurm's time-limit warning, preemption, or the terminal closing (torch's agent passes its SIGHUP on) while the
    run claims its folder and reads its data: the process ends at once with 75 (requeue.sbatch requeues it), saying
    nothing was saved, and leaves no output behind; a signal that lands once training started stops at a
    checkpoint, 75 as well."""
    out = tmp_path / "run"
    cmd = [BIN / "python", LM, *lm_args(tiny_lm, out, "--max_train_steps", "1000", "--checkpointing_steps", "5")]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [str(c) for c in cmd], cwd=REPO, env=user_env(), stderr=err, stdout=subprocess.DEVNULL,
            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL),  # CI may start us with it ignored (nohup)
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (out / outputs.LOCK_FILE).exists():  # the run has claimed its folder: data and model are next
            assert proc.poll() is None and time.monotonic() < deadline, "the run never claimed its folder"
            time.sleep(0.01)
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 75
        err.seek(0)
        stderr = err.read()
    assert "Traceback" not in stderr, stderr[-3000:]
    name = signal.Signals(sig).name
    if f"stopped by {name} before training started; nothing to save" in stderr:
        assert not out.exists(), sorted(p.name for p in out.iterdir())
    else:  # it landed in the loop: a checkpoint of the step it stopped at
        assert f"preempted: stopped by {name} " in stderr and ckpt.resolve_checkpoint(out, "latest") is not None


DATASETS_MAP = """
import sys, time
sys.path.insert(0, {repo!r})
import common

def work(batch):
    print("working", flush=True)
    time.sleep(120)  # a tokenizer over a large shard
    return batch

with common.exit_codes():
    import datasets
    datasets.Dataset.from_dict({{"x": list(range(8))}}).map(work, batched=True, num_proc=2, load_from_cache_file=False)
"""


@pytest.mark.slow
def test_a_stop_while_datasets_map_workers_run_ends_the_process_at_once(tmp_path):
    """--preprocessing_num_workers: datasets' map forks workers, which inherit the stop handlers; a stop ends them
    with the process (their pool's terminate() sends SIGTERM), not when their shard is done (or never)."""
    script = tmp_path / "map.py"
    script.write_text(DATASETS_MAP.format(repo=str(REPO)))
    proc = subprocess.Popen([BIN / "python", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        assert "working" in proc.stdout.readline()
        time.sleep(1)  # both workers at work
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        code = proc.wait(timeout=60)
        assert code == 75 and time.monotonic() - stopped < 20, proc.stderr.read()[-3000:]
        assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    finally:
        for process in [*workers, proc]:
            with contextlib.suppress(psutil.Error, OSError):
                process.kill()
        proc.wait()


def test_a_terminal_closing_stops_a_run_unless_nohup_said_otherwise():
    """SIGHUP is a stop (a checkpoint, exit 75) like SIGTERM, except in a process started with it ignored (nohup),
    which keeps running when the terminal closes."""
    code = (
        f"import signal, sys; sys.path.insert(0, {str(REPO)!r}); from common import preemption; "
        "preemption.install_stop_handlers(); print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)"
    )
    for nohup in (False, True):
        disposition = signal.SIG_IGN if nohup else signal.SIG_DFL  # set either way: CI may start us under nohup
        proc = subprocess.run(
            [BIN / "python", "-c", code], preexec_fn=lambda: signal.signal(signal.SIGHUP, disposition),
            capture_output=True, text=True,
        )  # fmt: skip
        assert proc.stdout.strip() == str(nohup), proc.stderr


@pytest.mark.slow
def test_a_process_waiting_for_a_group_that_never_forms_honours_a_stop_and_its_timeout(tiny_lm, tmp_path):
    """WORLD_SIZE, RANK and MASTER_ADDR left from another job make `python recipe.py` wait for processes that never
    come, inside torch's C++ store (where Python's signal handlers do not run): SIGTERM still ends it at once, as a
    stop before training, and --ddp_timeout ends the wait with a line naming the variables."""
    port = free_port()
    env = user_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [str(c) for c in (BIN / "python", LM, *lm_args(tiny_lm, tmp_path / "run"))]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:  # rank 0 hosts the group's store, and waits in it
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        time.sleep(0.1)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    tic, (_, stderr) = time.monotonic(), proc.communicate(timeout=60)
    assert proc.returncode == 75 and time.monotonic() - tic < 10, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        "preempted: stopped by SIGTERM before training started; nothing to save, run it again (exit 75)"
    ], stderr[-3000:]
    proc = run([*cmd, "--ddp_timeout", "5"], env=env, check=False)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: the processes did not meet within --ddp_timeout 5 s: the 2 processes of WORLD_SIZE=2 (this one "
        f"RANK=0) at 127.0.0.1:{port}: a process still starting (a first DeepSpeed run on CPU builds its ops), one "
        "that did not start or cannot reach that address, or variables left from another job (unset them: python "
        "alone runs one process)"
    ], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    # RANK=1 left alone: no rank 0 hosts the store, torch retries reaching it for minutes past the timeout; this one
    # process says so itself, in time
    tic, env = time.monotonic(), {**env, "RANK": "1", "LOCAL_RANK": "1"}
    proc = run([*cmd, "--ddp_timeout", "5"], env=env, check=False)
    assert proc.returncode == 2 and time.monotonic() - tic < 5 + 30, (time.monotonic() - tic, proc.stderr[-3000:])
    lines = error_lines(proc.stderr)  # once failed under load with two lines: kept whole to show what they were
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: the processes did not meet within --ddp_timeout 5 s") and "RANK=1" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("whom", ["launch.sh", "rank 1"])
def test_a_stop_while_the_main_process_prepares_the_data_ends_every_process_in_one_line(tiny_lm, tmp_path, whom):
    """SIGTERM to launch.sh (every process gets it), or to the other process alone, while the main process tokenizes
    and the other waits for it in a collective: whichever ends first breaks that collective for the other, which
    says so in one line; exit 75 (the stop), no "Connection closed by peer" traceback, nothing written."""
    import psutil

    big = tmp_path / "big.jsonl"
    big.write_text(Path(tiny_lm["train"]).read_text() * 1000)  # tokenizing takes seconds: the stop lands in it
    out = tmp_path / "run"
    # one process tokenizes, as the stop lands in it (test_a_stop_while_datasets_map_workers_run: in a pool's map)
    args = lm_args(tiny_lm, out, "--max_train_steps", "1000", "--preprocessing_num_workers", "1",
                   data=["--train_file", big])  # fmt: skip
    cmd = [REPO / "launch.sh", "lm_finetune", "--num_processes", "2", *args]
    with tempfile.TemporaryFile("w+") as log:
        # a cache of its own: blocks another run prepared from the same text would be reused, not tokenized
        env = user_env(CUDA_VISIBLE_DEVICES="", HF_DATASETS_CACHE=str(tmp_path / "cache"))
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while (log.seek(0) or True) and "tokenizing train" not in log.read():
            assert proc.poll() is None and time.monotonic() < deadline, "the main process never tokenized"
            time.sleep(0.05)
        if whom == "launch.sh":
            proc.send_signal(signal.SIGTERM)
        else:
            (rank1,) = [
                p for p in psutil.Process(proc.pid).children(recursive=True)
                if p.environ().get("RANK") == "1" and str(LM) in " ".join(p.cmdline())
                and "RANK" not in p.parent().environ()
            ]  # fmt: skip
            rank1.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75
        log.seek(0)
        text = log.read()
    assert "Traceback" not in text and "Connection closed" not in text, text[-3000:]
    # one line, by the process that ended first; a process whose collective that broke is not the cause
    lines = [line for line in text.splitlines() if line.startswith(("preempted:", "stopped:", "error:", "launch.sh:"))]
    assert lines == [
        "preempted: stopped by SIGTERM before training started; nothing to save, run it again (exit 75)"
    ], text[-3000:]
    assert not out.exists() or {p.name for p in out.iterdir()} <= {outputs.LOCK_FILE}


@pytest.mark.slow
def test_a_process_stopped_longer_than_the_collective_timeout_ends_the_job_with_one_line(tiny_lm, tmp_path):
    """One process suspended (SIGSTOP, as `scontrol suspend` does to a job's processes) for longer than --ddp_timeout:
    the other stops waiting for it in bounded time, one line says why and what to do, exit 124; the checkpoints
    saved before are intact."""
    import psutil

    out = tmp_path / "run"
    env = user_env(ACCELERATE_USE_CPU="true")
    cmd = [ACCELERATE_LAUNCH, "--config_file", REPO / "accelerate_configs/cpu.yaml", "--num_processes", "2"]
    cmd += ["--main_process_port", env["MASTER_PORT"], LM]
    cmd += lm_args(tiny_lm, out, "--max_train_steps", "1000", "--checkpointing_steps", "2", "--ddp_timeout", "5")
    cmd += ["--hang_timeout", "0"]  # the watch off: the collective's own timeout is what this tries
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stderr=err, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 180
            while not (out / "checkpoint-2" / ckpt.STATE_FILE).exists():
                assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint-2"
                time.sleep(0.05)
            (rank1,) = [
                p for p in psutil.Process(proc.pid).children(recursive=True)
                if p.environ().get("RANK") == "1" and str(LM) in " ".join(p.cmdline()) and p.parent().pid != p.pid
                and "RANK" not in p.parent().environ()
            ]  # fmt: skip
            rank1.suspend()
            sent = time.monotonic()
            code = proc.wait(timeout=120)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
            for p in psutil.process_iter():
                if str(LM) in " ".join(p.cmdline() or []) and str(out) in " ".join(p.cmdline() or []):
                    p.kill()
        err.seek(0)
        stderr = err.read()
    lines = error_lines(stderr)
    assert code != 0 and lines == [f"error: {LOST_PEERS}"], stderr[-3000:]
    assert took < 60 and ckpt.checkpoint_damage(out / "checkpoint-2") is None


# Data prepared by one process while the others wait: for as long as it takes, not for --ddp_timeout ------------

NUMBERS = "zero one two three four five six seven eight nine".split()
CORPUS_ROWS = 300_000  # tokenized and packed in about 10 s on 2 quiet cores (twice --ddp_timeout 5), 30 s loaded


def counting_corpus(path: Path, rows: int = CORPUS_ROWS) -> Path:
    """`rows` jsonl rows of the tiny model's counting text, about 310 bytes each."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            start = rng.randrange(10)
            text = " ".join(NUMBERS[(start + i) % 10] for i in range(rng.randrange(57, 64)))
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """counting_corpus's rows, written once for the tests here that tokenize it (writing them takes 4 to 14 s, as
    long as the run that reads them); each run reads it with a datasets cache of its own, so none reuses another's
    blocks, and none writes into it (checked after the last of them)."""
    path = counting_corpus(tmp_path_factory.mktemp("corpus") / "big.jsonl")
    written = path.stat().st_size, path.stat().st_mtime_ns
    yield path
    assert (path.stat().st_size, path.stat().st_mtime_ns) == written, "a run wrote into its training data"


def tokenized_for(text: str) -> int:
    """The seconds the main process spent tokenizing the training data, as the progress bar last said (with an ETA,
    [mm:ss<, once a chunk is done; [mm:ss, before: a bar closed by an error in the first chunk)."""
    times = re.findall(r"tokenizing train: [^\n]*\[(\d+):(\d+)[<,]", text.replace("\r", "\n"))
    return max((int(minutes) * 60 + int(seconds) for minutes, seconds in times), default=0)


def preparing(tiny_lm, tmp_path, corpus, *extra):
    """./launch.sh lm_finetune in 2 processes on `corpus` with --ddp_timeout 5, a datasets cache of its own (the
    main process tokenizes it: nothing is cached), and its environment. One worker, so that tokenizing takes about 10 s
    or more whatever the machine's cores. The watchdog is off: at --ddp_timeout 5 it would name a first step
    slower than 2 s, which a loaded CI machine takes."""
    args = lm_args(tiny_lm, tmp_path / "run", "--ddp_timeout", "5", "--hang_timeout", "0",
                   "--preprocessing_num_workers", "1", *extra,
                   data=["--train_file", corpus, "--validation_file", tiny_lm["validation"]])  # fmt: skip
    env = user_env(CUDA_VISIBLE_DEVICES="", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    return [REPO / "launch.sh", "lm_finetune", "--num_processes", "2", *args], env


@pytest.mark.slow
def test_data_that_takes_longer_to_prepare_than_the_collective_timeout_trains(tiny_lm, corpus, tmp_path):
    """The main process tokenizes for longer than --ddp_timeout while the other waits for it: the wait lasts as long
    as the work (before: exit 124 after --ddp_timeout, blaming a stalled collective, the tokenizer part way)."""
    cmd, env = preparing(tiny_lm, tmp_path, corpus, "--max_train_steps", "2")
    proc = run(cmd, env=env, check=False)
    assert proc.returncode == 0 and results(tmp_path / "run")["steps"] == 2, proc.stderr[-3000:]
    assert tokenized_for(proc.stderr) > 5, "tokenized within --ddp_timeout: this tries nothing (raise CORPUS_ROWS)"


@pytest.mark.slow
def test_bad_data_met_after_the_collective_timeout_is_still_one_line_and_exit_2(tiny_lm, corpus, tmp_path):
    """A row without text at the end of a corpus that takes longer than --ddp_timeout to tokenize: the main process's
    error reaches the other, which waited for it all along; one line, exit 2, nothing written."""
    bad = Path(shutil.copy(corpus, tmp_path / "big.jsonl"))
    with open(bad, "a") as f:
        f.write('{"text": null}\n')
    cmd, env = preparing(tiny_lm, tmp_path, bad)
    proc = run(cmd, env=env, check=False)
    said = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "stopped:", "preempted:"))]
    assert proc.returncode == 2 and said == [
        f"error: --train_file {bad}: a row's text is None (NoneType), not text; remove or fill such rows, or pass "
        "the --text_column that holds the text"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists(), proc.stderr[-3000:]
    assert tokenized_for(proc.stderr) > 5, "tokenized within --ddp_timeout: this tries nothing (raise CORPUS_ROWS)"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "suspended"])
def test_a_main_process_lost_while_it_prepares_the_data_is_named_by_the_one_waiting(tiny_lm, corpus, tmp_path, how):
    """SIGKILL (the OOM killer) or SIGSTOP (`scontrol suspend`) to the main process while it tokenizes: the other
    process stops waiting in bounded time with a line naming it: one killed at once (before torch's agent stops the
    other: that stop is not the cause), and launch.sh names the signal; one suspended within --ddp_timeout, exit 124
    (before: "a process stalled" or "another process ended", naming none)."""
    cmd, env = preparing(tiny_lm, tmp_path, corpus, "--max_train_steps", "1000")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        rank0 = None
        try:
            deadline = time.monotonic() + 180
            while (log.seek(0) or True) and "tokenizing train" not in log.read():
                assert proc.poll() is None and time.monotonic() < deadline, "the main process never tokenized"
                time.sleep(0.05)
            (rank0,) = [
                p for p in psutil.Process(proc.pid).children(recursive=True)
                if p.environ().get("RANK") == "0" and str(LM) in " ".join(p.cmdline())
                and "RANK" not in p.parent().environ()
            ]  # fmt: skip
            rank0.kill() if how == "killed" else rank0.suspend()
            sent = time.monotonic()
            while not re.search(r"^(stopped|error):", (log.seek(0) or True) and log.read(), re.M):  # the other's line
                assert proc.poll() is None and time.monotonic() < sent + 60, "the other process kept waiting"
                time.sleep(0.05)
            took = time.monotonic() - sent
            if how == "suspended":
                rank0.resume()  # torch's agent stops it (as it would after a resume by Slurm)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            if rank0 is not None and how == "suspended":
                with contextlib.suppress(psutil.Error):
                    rank0.kill()
        log.seek(0)
        text = log.read().replace("\r", "\n")
    lines = [line for line in text.splitlines() if line.startswith(("preempted:", "stopped:", "error:", "launch.sh:"))]
    assert "Traceback" not in text, text[-3000:]
    main_lost = "the main process (rank 0) ended while it prepared the data, which this process waited for"
    if how == "killed":  # at once; launch.sh names the signal
        killed = f"process rank 0 (pid {rank0.pid}) was killed by SIGKILL (out of memory? see dmesg)"
        expected = 137, [f"stopped: {main_lost} (its output, or its launcher's, says why)", f"launch.sh: {killed}"]
    else:  # within --ddp_timeout
        stalled = "the main process (rank 0) did not answer for --ddp_timeout 5 s while it prepared the data"
        fate = "it stalled or was suspended; any checkpoint already saved is intact (exit 124)"
        expected = 124, [f"error: {stalled}, which this process waited for: {fate}"]
    assert (code, lines) == expected, text[-3000:]
    assert took < (10 if how == "killed" else 5 + 20), took


# 6. An operating-system error names the path, where it came from, and the fix ---------------------


@pytest.mark.slow
def test_a_cache_that_cannot_be_created_is_named_with_its_variable(refused_in_two):
    """HF_DATASETS_CACHE a file itself: the one line names the variable, the path and what is wrong with it, not the
    folder beneath it the run was making; in 2 processes the same line, whichever process says it. (A cache under a
    file: the next test.)"""
    proc, folder, before = refused_in_two("a cache that is a file")
    assert proc.returncode != 0 and error_lines(proc.stderr) == [
        f"error: $HF_DATASETS_CACHE {folder / 'file'}: file exists; it is a file where a folder must be: remove it "
        "or use another path"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (folder / "run").exists(), proc.stderr[-3000:]


@pytest.mark.slow
def test_a_path_under_a_file_is_named_with_its_option_in_two_processes(refused_in_two):
    """--prepared_data_dir under a file, in 2 processes: the main process prepares the data while the other waits for
    it, and fails; the one line names the option the path came from (the arguments the failing code ran with carry
    their parse's values: common.args.ParsedArgs), whichever process says it."""
    proc, folder, _ = refused_in_two("a path under a file")
    blocked, prepared = folder / "file", folder / "file" / "prepared"
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        f"error: {blocked} (on the path of --prepared_data_dir {prepared}): file exists; it is a file where a folder "
        "must be: remove it or use another path"
    ], proc.stderr[-3000:]


def test_a_cache_under_a_file_is_named_with_its_variable(tiny_lm, tmp_path, monkeypatch):
    """HF_DATASETS_CACHE under a file: the folder the run makes first under it (the prepared blocks', as
    recipes/lm_finetune.py does), with the variable and the recipe's arguments as a run has them; the line is the one
    its process prints (runtime._how_it_ended)."""
    import datasets

    from common import prepared
    from common.runtime import _how_it_ended

    (tmp_path / "file").write_text("not a folder")
    cache = tmp_path / "file" / "cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)  # read when datasets is imported
    args = load_recipe("lm_finetune").parse_args([str(a) for a in lm_args(tiny_lm, tmp_path / "run")])
    assert args.values_by_option["--output_dir"] == str(tmp_path / "run")  # beside the variable, not the cause
    digest = "0" * 64
    with pytest.raises(OSError) as failed, prepared.one_preparation(prepared.default_folder(digest), digest, 60):
        pass
    assert _how_it_ended(failed.value)[:3] == (
        2,
        "error",
        f"error: $HF_DATASETS_CACHE {cache}: not a directory; a part of that path is a file, not a folder",
    )


# 7. No computation divides by data it did not check -----------------------------------------------


def test_chat_data_whose_blocks_hold_no_reply_is_refused_before_training(tmp_path):
    """A held-out conversation whose reply falls in the remainder packing drops: its one block is all prompt. A
    mean over no token would be NaN in evaluation, at the end of every attempt to finish the run."""
    from common.text import load_raw_datasets, tokenize_and_pack

    rows = [{"messages": [{"role": "user", "content": "one " * 40}, {"role": "assistant", "content": "two"}]}] * 20
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = load_raw_datasets(train_file=path, validation_split_percentage=5)  # one conversation: one block of 32
    with pytest.raises(RecipeError, match=r"validation split: no block\(s\) of 32 tokens hold a token to train on"):
        tokenize_and_pack(raw, _chat_tokenizer(), data_format="chat", text_column="text", block_size=32)


def test_chat_data_whose_blocks_mostly_hold_no_reply_is_said_before_training(tmp_path, caplog):
    """Long prompts, short replies, small blocks: most steps would train on nothing (a loss over no token is none,
    not 0: TrainLog logs null). Said before training, with the fix."""
    from accelerate import PartialState

    from common.text import load_raw_datasets, tokenize_and_pack

    PartialState()
    rows = [{"messages": [{"role": "user", "content": "one " * 20}, {"role": "assistant", "content": "two"}]}] * 20
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = load_raw_datasets(train_file=path, validation_file=path)
    data = tokenize_and_pack(raw, _chat_tokenizer(), data_format="chat", text_column="text", block_size=4)
    blocks = len(data["train"])
    assert f"the train split: only 20 of {blocks} block(s) of 4 tokens hold a token to train on" in caplog.text


def _chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>", "one", "two"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return tokenizer


# 8. What a run writes, its user's group can read --------------------------------------------------


def test_what_a_run_writes_gets_the_permissions_the_umask_gives(acc, tmp_path):
    """safetensors writes 0600 whatever the umask: a colleague, or a job under a service account, could not read
    the model. Every file of a checkpoint and of the final save is as readable as the umask allows."""
    old = os.umask(0o002)
    try:
        out = tmp_path / "run"
        ckpt.write_checkpoint(acc[0], out, 2, {"epoch": 0, "samples_in_epoch": 0}, None, acc[1])
        ckpt.save_model(*acc, out)
        ckpt.write_json(out / "results.json", {"steps": 2, "versions": {}})
    finally:
        os.umask(old)
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and "checkpoint-2/model.safetensors" in modes
    assert set(modes.values()) == {0o664}, modes


@pytest.mark.slow
def test_a_run_from_read_only_inputs_resumes_on_another_layout_and_writes_only_its_output_dir(tiny_lm, tmp_path):
    """The model folder, the data files, the prepared data and a 2-process run's checkpoint, all on a read-only
    mount: a 1-process run resumes that checkpoint (by path, into its own new --output_dir) from the same prepared
    data and ends with the uninterrupted run's weights; every input is as it was (a conversion, a lock, a cache
    written beside an input fails on a read-only archive)."""
    from safetensors.torch import load_file

    inputs = tmp_path / "inputs"
    shutil.copytree(tiny_lm["model"], inputs / "model")
    lm = {"model": inputs / "model"}
    for name in ("train", "validation"):
        lm[name] = shutil.copy(tiny_lm[name], inputs / f"{name}.jsonl")
    steps = ["--max_train_steps", "6", "--checkpointing_steps", "3", "--prepared_data_dir", inputs / "prepared"]
    first = tmp_path / "first"
    run([REPO / "launch.sh", "lm_finetune", "--config", "cpu", "--num_processes", "2", *lm_args(lm, first, *steps)],
        env=user_env())  # fmt: skip
    before = {"inputs": snapshot(inputs), "first": snapshot(first)}
    denied = subprocess.run([*read_only(inputs), "touch", inputs / "model" / "x"], capture_output=True, text=True)
    assert denied.returncode and "Read-only file system" in denied.stderr, denied.stderr  # the mount holds
    resumed = tmp_path / "resumed"
    again = [*steps, "--resume_from_checkpoint", first / "checkpoint-3", "--per_device_train_batch_size", "16"]
    proc = run([*read_only(inputs, first), REPO / "launch.sh", "lm_finetune", "--config", "cpu", "--num_processes",
                "1", *lm_args(lm, resumed, *again)], env=user_env(), check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "reusing the prepared data" in proc.stderr
    assert {"inputs": snapshot(inputs), "first": snapshot(first)} == before
    a, b = load_file(first / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
