"""Faults: a process that dies, restarts that resume, and the bad-input cases of the README's table
that no other test file covers (each: one `error:` line naming the fix, exit 2, nothing existing
changed). Stop signals and resume equivalence are tested per recipe in test_cifar, test_lm_finetune
and test_zero."""

import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    BIN,
    LM_INTERRUPTED_ARGS,
    REPO,
    error_lines,
    interrupt,
    lm_args,
    rank_process,
    results,
    run,
    session_killed_at_exit,
    snapshot,
    user_env,
)
from make_tiny_lm import NUMBERS
from transformers import AutoConfig, AutoModelForCausalLM

from common.checkpoint import checkpoint_damage, complete_checkpoints
from common.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow  # every test here launches recipes (pytest -m 'not slow' skips them)

LM = REPO / "recipes" / "lm_finetune.py"


def refused(cmd, output_dir, *named, env=None):
    """Run a recipe that must refuse: exit 2, one error line naming each of `named` (the refusal's subject, the
    option or path it is about, and what else the rule under test says), output_dir as before."""
    before = snapshot(output_dir)
    proc = run(cmd, env=env, check=False, timeout=180)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and all(n in lines[0] for n in named), proc.stderr[-3000:]
    assert snapshot(output_dir) == before, "existing output changed"
    assert not list(Path(output_dir).parent.glob("**/.write-test-*"))
    return lines[0]


@pytest.fixture(scope="module")
def lm_checkpoint(tiny_lm, tmp_path_factory):
    """An lm_finetune run of 2 steps (1 process) with its checkpoint-2."""
    out = tmp_path_factory.mktemp("lm_run")
    run([BIN / "python", LM, *lm_args(tiny_lm, out, "--max_train_steps", "2", "--checkpointing_steps", "2")])
    return out / "checkpoint-2"


# A process that dies ----------------------------------------------------------------------------


@pytest.mark.floor
def test_a_killed_process_ends_the_job_within_the_shutdown_timeout(tiny_lm, tmp_path):
    """SIGKILL (the OOM killer, a lost node) on one rank: the other is stopped by the launcher
    within TORCH_ELASTIC_SHUTDOWN_TIMEOUT, not after the 10-minute collective timeout, and the
    checkpoints already written stay intact."""
    out = tmp_path / "run"
    cmd = [
        REPO / "launch.sh",
        "lm_finetune",
        *lm_args(tiny_lm, out, "--max_train_steps", "500", "--checkpointing_steps", "3"),
    ]
    proc, took = interrupt(
        cmd, user_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="20"), out, after_step=3, sig=signal.SIGKILL, rank=1
    )
    assert proc.returncode not in (0, PREEMPTED_EXIT_CODE), proc.stderr[-2000:]
    assert took < 20 + 15, f"the job took {took:.0f} s to end after a process died"
    assert checkpoint_damage(out / "checkpoint-3") is None
    assert not (out / "results.json").exists()


@pytest.fixture(scope="module")
def restarted_twice(tiny_lm, tmp_path_factory):
    """One job of --max_restarts 2 (LM_INTERRUPTED_ARGS, a checkpoint every 2 steps): rank 1 killed (SIGKILL) after
    checkpoint-2; then, in the restarted attempt, once it saved a checkpoint of its own, rank 1 stopped alone
    (SIGTERM: the job saves and ends that attempt with 75); the second restart finishes. Its output folder and the
    job's exit code and stderr."""
    out = tmp_path_factory.mktemp("restarted") / "run"
    args = lm_args(tiny_lm, out, *LM_INTERRUPTED_ARGS, "--checkpointing_steps", "2")
    cmd = [str(c) for c in (REPO / "launch.sh", "lm_finetune", "--max_restarts", "2", *args)]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=user_env(), stdout=subprocess.DEVNULL, stderr=err, text=True,
                                start_new_session=True)  # fmt: skip

        def wait_for(done, what):
            deadline = time.monotonic() + 300
            while not done():
                assert proc.poll() is None, f"the job ended before {what}: " + (err.seek(0) or err.read())[-3000:]
                assert time.monotonic() < deadline, f"no {what} in 300 s"
                time.sleep(0.05)

        with session_killed_at_exit(proc):
            wait_for(lambda: out / "checkpoint-2" in complete_checkpoints(out), "checkpoint-2")
            killed = rank_process(proc, 1)
            killed.kill()
            wait_for(lambda: "restart 1 of this job" in (err.seek(0) or err.read()), "a restart")
            resumed_from = complete_checkpoints(out)[-1]  # the first attempt's processes are gone by now
            wait_for(lambda: complete_checkpoints(out)[-1] != resumed_from, "a checkpoint of the restarted attempt")
            stopped = rank_process(proc, 1)
            assert stopped.pid != killed.pid
            stopped.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
        err.seek(0)
        return out, proc.returncode, err.read()


def test_max_restarts_restart_a_killed_process_and_a_stopped_one_and_the_job_ends_with_0(restarted_twice):
    """A process killed restarts the job from the latest checkpoint; one stopped alone (SIGTERM to one rank: the job
    saves a checkpoint and exits 75) restarts it too; the job ends with exit 0, not the first attempts' codes."""
    out, code, stderr = restarted_twice
    assert code == 0, stderr[-3000:]
    for attempt in (1, 2):
        assert f"restart {attempt} of this job (--max_restarts): resuming from the latest checkpoint" in stderr
    assert stderr.count("resumed from") == 2 and "preempted: stopped by SIGTERM" in stderr, stderr[-3000:]


def test_max_restarts_resume_from_the_latest_checkpoint_and_end_like_the_uninterrupted_run(
    restarted_twice, lm_uninterrupted
):
    """After a kill and a stop, each restarted from the latest checkpoint, the job ends as the uninterrupted run: its
    steps, eval loss, log (the log before each restart is kept: trainer_state.json's log_history) and weights."""
    (restarted, code, stderr), straight = restarted_twice, lm_uninterrupted
    assert code == 0, stderr[-3000:]
    assert results(restarted)["steps"] == 14
    assert results(restarted)["eval_loss"] == pytest.approx(results(straight)["eval_loss"], rel=1e-5)
    history = [
        [(h["step"], round(h["train_loss"], 4)) for h in results(run)["log_history"]] for run in (straight, restarted)
    ]
    assert history[0] == history[1]  # the log before the restart is kept (trainer_state.json's log_history)
    wa = AutoModelForCausalLM.from_pretrained(straight).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(restarted).state_dict()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mistake", ["--per_device_batch_size 3", "--text_column body"])
def test_max_restarts_do_not_repeat_a_mistake(tiny_lm, tmp_path, mistake):
    """A restart mends a crash, not a mistake: with --max_restarts 2, an unknown flag (argparse) or a column the
    data lacks (RecipeError, met as the data loads) is said once, and the job ends with exit 2 (before: the line
    three times)."""
    out = tmp_path / "run"
    refused(
        [REPO / "launch.sh", "lm_finetune", "--max_restarts", "2", *lm_args(tiny_lm, out), *mistake.split()],
        out,
        mistake.split()[0],  # the option, the refusal's subject
        env=user_env(),
    )  # fmt: skip ----------------------------------------------------------------------------------------


@pytest.fixture
def small_images(digits, tmp_path):
    """Two classes of digits, 8 training and 4 validation images each."""
    root = tmp_path / "images"
    for split, count in (("train", 8), ("val", 4)):
        for label in ("0", "1"):
            (root / split / label).mkdir(parents=True)
            for image in sorted((digits[split] / label).iterdir())[:count]:
                shutil.copy(image, root / split / label / image.name)
    return root


def cifar(images, out, *extra):
    return [
        BIN / "python",
        REPO / "recipes" / "cifar.py",
        "--dataset",
        "imagefolder",
        "--train_dir",
        images / "train",
        "--val_dir",
        images / "val",
        "--model",
        "resnet18",
        "--per_device_train_batch_size",
        "4",
        "--output_dir",
        out,
        *extra,
    ]


def test_a_corrupt_image_is_named(small_images, tmp_path):
    """The file is met in a DataLoader worker, mid-epoch; the error names it."""
    bad = small_images / "train" / "1" / "scan.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really an image" * 10)
    line = refused(
        cifar(small_images, tmp_path / "run", "--dataloader_num_workers", "1"),
        tmp_path / "run",
        f"{bad}: unreadable image",
    )
    assert "remove or replace the file" in line


@pytest.mark.slow
@pytest.mark.parametrize("met_by", ["every process", "one process"])
def test_a_corrupt_image_in_two_processes_is_one_line_of_its_own(digits, tmp_path, met_by):
    """A file every process reads (the data fingerprint's samples) is one line, not one per process; a file one
    process meets in training, while the other draws the progress bar, is a line of its own, and the other process,
    whose collective it left, adds no error line."""
    import torchvision

    root = tmp_path / "images"
    for split, count in (("train", 100), ("val", 4)):
        for label in ("0", "1"):
            shutil.copytree(digits[split] / label, root / split / label, ignore=lambda d, names: sorted(names)[count:])
    fingerprinted = {i * 200 // 64 for i in range(64)}  # common.data.fingerprint's samples of 200
    index = 0 if met_by == "every process" else min(set(range(200)) - fingerprinted)
    bad = Path(torchvision.datasets.ImageFolder(root / "train").samples[index][0])
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really an image" * 10)
    out = tmp_path / "run"
    args = cifar(root, out, "--dataloader_num_workers", "0", "--num_train_epochs", "1")[2:]  # no python, no recipe
    proc = run([REPO / "launch.sh", "cifar", "--num_processes", "2", *args], env=user_env(CUDA_VISIBLE_DEVICES=""),
               check=False)  # fmt: skip
    text = proc.stderr.replace("\r", "\n")
    lines = error_lines(text)
    assert proc.returncode == 2 and len(lines) == 1 and f"{bad}: unreadable image (" in lines[0], text[-3000:]
    assert "Traceback" not in text and not out.exists(), text[-3000:]


def test_an_image_folder_without_images_is_refused(small_images, tmp_path):
    for image in (small_images / "train").rglob("*.png"):
        image.unlink()
    refused(cifar(small_images, tmp_path / "run"), tmp_path / "run", "Found no valid file for the classes")


def test_an_output_dir_holding_a_run_is_not_overwritten_without_a_flag(tiny_lm, lm_checkpoint, tmp_path):
    out = lm_checkpoint.parent  # checkpoint-2, results.json and the saved model
    refused(
        [BIN / "python", LM, *lm_args(tiny_lm, out, "--max_train_steps", "2")],
        out,
        f"--output_dir {out}",  # the subject, as the user gave it
        "--overwrite_output_dir",  # the flag that would start over (or --resume_from_checkpoint)
    )


def test_overwrite_output_dir_starts_over_and_drops_the_old_checkpoints(tiny_lm, lm_checkpoint, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(lm_checkpoint.parent, out)
    proc = run([BIN / "python", LM, *lm_args(tiny_lm, out, "--max_train_steps", "1", "--overwrite_output_dir")])
    assert "deleting the earlier run's checkpoint-2" in proc.stderr
    assert results(out)["steps"] == 1 and not (out / "checkpoint-2").exists()


def test_an_unwritable_output_dir_is_refused_before_training(tiny_lm, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    refused(
        [BIN / "python", LM, *lm_args(tiny_lm, blocker / "run")],
        tmp_path,
        f"--output_dir {blocker / 'run'}",
        str(blocker),  # the file in the way
    )


@pytest.mark.parametrize("other", [[], ["--block_size", "16"]], ids=["same_data", "other_blocks"])
def test_a_checkpoint_of_another_recipe_is_refused(tiny_lm, lm_checkpoint, tmp_path, other):
    """Named as another recipe's before anything else it differs in (here the data's blocks)."""
    out = tmp_path / "run"
    cmd = [
        BIN / "python",
        REPO / "recipes" / "zero.py",
        *lm_args(tiny_lm, out, "--resume_from_checkpoint", lm_checkpoint, *other),
    ]
    refused(cmd, lm_checkpoint.parent, "was written by recipes/lm_finetune.py, this is recipes/zero.py")
    assert not out.exists()


def test_a_checkpoint_of_another_model_is_refused(tiny_lm, lm_checkpoint, tmp_path):
    other = tmp_path / "wider"
    shutil.copytree(tiny_lm["model"], other)
    config = AutoConfig.from_pretrained(other)
    config.update({"hidden_size": 32, "intermediate_size": 64})
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    out = tmp_path / "run"
    cmd = [BIN / "python", LM, *lm_args({**tiny_lm, "model": other}, out, "--resume_from_checkpoint", lm_checkpoint)]
    refused(cmd, lm_checkpoint.parent, "holds another model")


def test_a_damaged_checkpoint_is_refused_by_name(tiny_lm, lm_checkpoint, tmp_path):
    damaged = tmp_path / "checkpoint-2"
    shutil.copytree(lm_checkpoint, damaged)
    optimizer = damaged / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    cmd = [BIN / "python", LM, *lm_args(tiny_lm, tmp_path / "run", "--resume_from_checkpoint", damaged)]
    line = refused(cmd, tmp_path, "the checkpoint is damaged: optimizer.bin has 100 bytes")
    # given by path into another folder: `latest` would mean that folder's, so the line names what does work
    assert line.endswith("; pass another checkpoint, or drop --resume_from_checkpoint to start a new run"), line


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny_lm, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tmp_path / "model"
    shutil.copytree(tiny_lm["model"], model)
    words = ["<unk>", "<eos>", *NUMBERS, *(f"extra{i}" for i in range(40))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(model)
    refused(
        [BIN / "python", LM, *lm_args({**tiny_lm, "model": model}, tmp_path / "run")],
        tmp_path / "run",
        f"the tokenizer has {len(words)} tokens but the model's vocabulary has "
        f"{AutoConfig.from_pretrained(model).vocab_size}",
    )


# Signals outside the step loop, a diverging loss, and resuming with other settings -------------------


def short_epochs(tmp_path, lm, eval_lines=3000):
    """Training text of 16 blocks of 32 tokens (2 steps an epoch at batch 8) and a validation set of
    750 blocks (23,250 target tokens), which at batch 1 in 2 processes takes seconds to evaluate (4 to 8 s
    measured on 2 busy cores): time for a signal to arrive."""
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    for path, lines in ((train, 64), (validation, eval_lines)):
        with open(path, "w") as f:
            for i in range(lines):  # 7 words and EOS: 4 lines a block
                f.write(json.dumps({"text": " ".join(NUMBERS[(i + j) % 10] for j in range(7))}) + "\n")
    return {**lm, "train": train, "validation": validation}


def test_a_stop_during_evaluation_saves_the_last_step_at_once_and_a_stop_during_the_final_one_lets_it_finish(
    tiny_lm, tmp_path
):
    """Through launch.sh, 2 processes. A signal while a mid-run evaluation runs: every process leaves
    the evaluation at the same batch, the state of the step just trained is saved, exit 75 (a long
    evaluation must not turn a clean preemption into a job killed after the launcher's grace
    period). The resumed run ends the job. A signal during its final evaluation: the run completes its
    outputs instead, and launch.sh exits 0."""
    lm = short_epochs(tmp_path, tiny_lm)
    out = tmp_path / "run"
    args = lm_args(
        lm,
        out,
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "1",
        "--num_train_epochs",
        "2",
        "--checkpointing_steps",
        "2",
    )
    launch = [REPO / "launch.sh", "lm_finetune"]
    proc, _ = interrupt([*launch, *args], user_env(), out, after_step=2)  # epoch 0's last step
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr[-3000:]
    assert f"preempted: stopped by SIGTERM during evaluation after step 2; saved {out / 'checkpoint-2'}" in proc.stderr
    assert "epoch 0:" not in proc.stderr and not (out / "results.json").exists()  # the evaluation did not finish
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"], state["world_size"]) == (0, 2, 2) and state["samples_in_epoch"] > 0

    # The resumed run, stopped once its last step's checkpoint is saved: during the final evaluation
    resumed, _ = interrupt([*launch, *args, "--resume_from_checkpoint", "latest"], user_env(), out, after_step=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "epoch 0: step 2," in resumed.stderr  # the evaluation the stop cut short, done first
    assert "epoch 1: step 4," in resumed.stderr and "preempted" not in resumed.stderr
    assert results(out)["steps"] == 4 and results(out)["eval_tokens"] > 10_000
    assert (out / "model.safetensors").is_file()


def test_a_loss_that_becomes_nan_stops_the_run_with_one_line_and_no_checkpoint_of_it(tiny_lm, tmp_path):
    out = tmp_path / "run"
    cmd = [
        BIN / "python",
        LM,
        *lm_args(
            tiny_lm,
            out,
            "--learning_rate",
            "1e30",
            "--max_grad_norm",
            "0",
            "--max_train_steps",
            "20",
            "--checkpointing_steps",
            "1",
            "--logging_steps",
            "5",
        ),
    ]
    proc = run(cmd, check=False)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "the weights hold NaN or inf by step" in lines[0] or "the training loss became nan by step" in lines[0]
    assert "Traceback" not in proc.stderr and not (out / "results.json").exists()
    assert not (out / "model.safetensors").exists()
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) < 20  # it stopped
    from safetensors.torch import load_file

    for checkpoint in saved:  # every checkpoint that was written holds finite weights
        assert all(torch.isfinite(t).all() for t in load_file(checkpoint / "model.safetensors").values()), checkpoint


def test_a_resume_applies_this_runs_learning_rate_and_refuses_another_seed(tiny_lm, lm_checkpoint, tmp_path):
    """The checkpoint's optimizer state holds the learning rate, weight decay and momentum it was
    written with; this run's command line is what trains from here on, and the log says what changed.
    Another --seed would reorder the data not trained yet: refused."""
    out = tmp_path / "run"
    shutil.copytree(lm_checkpoint, out / lm_checkpoint.name)
    base = ["--max_train_steps", "4", "--lr_scheduler_type", "constant", "--logging_steps", "1"]
    refused(
        [BIN / "python", LM, *lm_args(tiny_lm, out, *base, "--seed", "7", "--resume_from_checkpoint", "latest")],
        out,
        "--seed 42",  # the subject, with the value that resumes
    )
    past = ["--max_train_steps", "1", "--resume_from_checkpoint", "latest"]  # would replace the model with step 2's
    refused(
        [BIN / "python", LM, *lm_args(tiny_lm, out, *past)],
        out,
        "--max_train_steps 1",  # the subject, as given
        "--max_train_steps 3 or more",  # the value that trains
    )
    proc = run(
        [
            BIN / "python",
            LM,
            *lm_args(
                tiny_lm,
                out,
                *base,
                "--learning_rate",
                "1e-3",
                "--weight_decay",
                "0.1",
                "--resume_from_checkpoint",
                "latest",
            ),
        ]
    )
    line = next(line for line in proc.stderr.splitlines() if "with settings that differ from the checkpoint's" in line)
    assert "--learning_rate 0.003 -> 0.001, --lr_scheduler_type cosine -> constant, --weight_decay 0.0 -> 0.1" in line
    res = results(out)
    assert res["learning_rate"] == 1e-3 and [h["lr"] for h in res["log_history"] if h["step"] > 2] == [1e-3, 1e-3]
    assert [h["step"] for h in res["log_history"]] == [2, 3, 4]  # the checkpoint's log, then this run's
