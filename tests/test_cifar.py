"""The CIFAR/ImageFolder recipe, launched as users launch it, in 1 and 2 CPU processes."""

import importlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torchvision
from accelerate import PartialState
from accelerate.utils import set_seed
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    FAST_MODEL,
    NO_NETWORK,
    REPO,
    accelerate_cpu,
    card,
    digits_args,
    error_lines,
    free_port,
    interrupt,
    is_png,
    load_recipe,
    results,
    run,
    snapshot,
    started_by_accelerate_launch,
    uploaded,
    user_env,
)
from safetensors.torch import load_file, save_file

from common import vision
from common.data import seeded_uniform
from common.preemption import PREEMPTED_EXIT_CODE
from common.runtime import RecipeError

RECIPE = REPO / "recipes" / "cifar.py"
predict = importlib.import_module("predict")  # scripts/predict.py (conftest puts scripts/ on the path)


def reevaluate(digits, output_dir):
    """Load the saved safetensors into a fresh model, evaluate in this process, no Accelerate."""
    cifar = load_recipe()
    args = cifar.parse_args([str(a) for a in digits_args(digits, output_dir)])
    _, evals, num_classes = cifar.build_datasets(args, vision.load_images(args))
    model = vision.new_model("resnet18", num_classes)
    model.load_state_dict(load_file(output_dir / "model.safetensors"))
    model.eval()
    loader = torch.utils.data.DataLoader(evals, batch_size=128)
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images)
            loss_sum += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
    return correct, loss_sum / len(evals)


# The README quick start's settings: 5 epochs of the recipe's defaults (its seed, its input path, pad-and-crop, SGD,
# the scaled rate and its warmup and cosine decay) but no mirroring, which turns digits into other shapes.
LEARNING = ["--model", "resnet18", "--num_train_epochs", "5", "--hflip", "0"]
PER_EPOCH_64 = 1400 // 64  # steps an epoch at an effective batch of 64


@pytest.fixture(scope="module")
def one_process_64(digits, tmp_path_factory):
    """`./launch.sh cifar --num_processes 1` at batch 64 with LEARNING and a checkpoint each epoch: (its folder, the
    finished process). The one-process side of the learning comparison, and the run whose saved weights, card,
    pictures, predictions and epoch resumes the one-process test reads (a checkpoint changes no weight)."""
    out = tmp_path_factory.mktemp("one_process_64") / "run"
    args = [*LEARNING, "--per_device_train_batch_size", "64", "--checkpointing_steps", "epoch"]
    return out, run([REPO / "launch.sh", "cifar", "--num_processes", "1", *digits_args(digits, out, *args)])


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two 5-epoch trainings when this worker makes the quick start's too
def test_two_processes_learn_as_well_as_one(digits, tmp_path, quick_start, one_process_64):
    """The property data parallelism promises, measured as quality rather than equality: 2 processes x 32 (the
    README's quick start, run as written: conftest's quick_start) reach the accuracy of 1 process x 64 (the same
    effective batch, learning rate and steps). Both with LEARNING: the recipe's defaults (its seed, its input path,
    pad-and-crop, SGD, the scaled rate and its warmup and cosine decay, BatchNorm per process) but no mirroring, which
    turns digits into other shapes. Measured with the images held in memory (the default for the digits) over seeds
    42, 0, 1: 0.962, 0.980, 0.967 in 2 processes; 0.975, 0.980, 0.980 in 1. After 3 epochs the same runs scatter from
    0.89 to 0.96 with the seed and with the threads a busy machine gives each process (which change the order of float
    sums), too widely to compare layouts with one seed. BatchNorm's statistics are each process's own, so the runs
    are not equal, only equally good. The 1-process run's final weights, evaluated again by 2 processes, give its
    per-class counts exactly: the gathered evaluation counts each sample once, in its class."""
    steps, accuracy = 5 * PER_EPOCH_64, {}
    for processes, out in ((2, quick_start / "outputs/digits"), (1, one_process_64[0])):
        res = results(out)
        assert res["world_size"] == processes and res["effective_batch_size"] == 64, res
        assert res["eval_samples"] == digits["n_val"] and res["steps"] == steps, res
        assert res["args"]["seed"] == 42, res["args"]  # the default
        settings = {k: res["args"][k] for k in ("model", "num_train_epochs", "hflip", "lr_scaling")}
        assert settings == {"model": "resnet18", "num_train_epochs": 5, "hflip": 0, "lr_scaling": "linear"}, settings
        accuracy[processes] = res["eval_accuracy"]
    assert min(accuracy.values()) > 0.93, accuracy  # chance is 0.1
    assert accuracy[2] > accuracy[1] - 0.03, accuracy
    # The 1-process run's weights evaluated by 2 processes (its last checkpoint resumed: nothing left to train, the
    # run evaluates): the same per-class counts, exactly, as its one process counted
    again = tmp_path / "evaluated_by_2"
    resume = ["--resume_from_checkpoint", one_process_64[0] / f"checkpoint-{steps}", "--per_device_train_batch_size"]
    run(*accelerate_cpu(2, RECIPE, *digits_args(digits, again, *LEARNING, *resume, "32")))
    one, two = results(one_process_64[0]), results(again)
    assert one["world_size"] == 1 and two["world_size"] == 2 and one["steps"] == two["steps"] == steps
    for key in ("eval_accuracy", "eval_samples", "eval_per_class_accuracy", "eval_per_class_samples"):
        assert one[key] == two[key], key
    assert one["eval_confusion_matrix"] == two["eval_confusion_matrix"]


@pytest.mark.slow
def test_one_process_learns_saves_weights_that_reproduce_its_accuracy_and_resumes_at_epoch_boundaries(
    digits, tmp_path, capsys, one_process_64
):
    """By default the digits (small images that fit) train from memory, cropped (and flipped, when --hflip is on)
    there, as --data_on_device does, which one info line says: the weights it saves reproduce its accuracy through
    the ImageFolder evaluation path, and a resume takes the checkpoint's input path. Its per-class accuracy, model
    card, pictures and upload set; scripts/predict.py on it. The run: launch.sh's one process of the learning test
    above (5 epochs x 21 steps of 64, an epoch checkpoint each)."""
    out, proc = one_process_64
    args = [*LEARNING, "--per_device_train_batch_size", "64", "--checkpointing_steps", "epoch"]
    epochs, per_epoch = 5, PER_EPOCH_64
    n = digits["n_train"] + digits["n_val"]
    assert f"input: the {n:,} images (5.3 MB as uint8) are held on cpu and cropped and flipped there" in proc.stderr
    res = results(out)
    assert res["args"]["data_on_device"] is True
    assert res["world_size"] == 1 and res["num_processes"] == 1 and res["distributed_type"] == "NO"
    assert res["eval_samples"] == digits["n_val"]
    assert res["eval_accuracy"] > 0.7, res  # chance is 0.1
    assert res["steps"] == epochs * per_epoch
    assert res["effective_batch_size"] == 64 and res["learning_rate"] == pytest.approx(0.1 * 64 / 128)

    correct, loss = reevaluate(digits, out)
    assert abs(correct - round(res["eval_accuracy"] * digits["n_val"])) <= 1
    assert loss == pytest.approx(res["eval_loss"], rel=1e-3)

    # Per class, by the dataset's class names: the held-out images of each folder, and an accuracy that the overall
    # one is the sample-weighted mean of; the confusion matrix's rows are the classes, its diagonal the correct ones
    classes, samples, per_class = res["class_names"], res["eval_per_class_samples"], res["eval_per_class_accuracy"]
    assert classes == [str(d) for d in range(10)]
    assert samples == {c: len(list((digits["val"] / c).glob("*.png"))) for c in classes}
    assert sum(per_class[c] * samples[c] for c in classes) / digits["n_val"] == pytest.approx(res["eval_accuracy"])
    matrix = res["eval_confusion_matrix"]
    assert [sum(row) for row in matrix] == [samples[c] for c in classes]
    assert sum(matrix[i][i] for i in range(10)) == round(res["eval_accuracy"] * digits["n_val"])
    assert all(set(e) == {"step", "samples_seen", "epoch", "eval_loss", "eval_accuracy", "eval_samples"}
               for e in res["eval_history"])  # fmt: skip
    meta, text = card(out)
    assert meta["library_name"] == "pytorch" and "image-classification" in meta["tags"]
    assert "metrics" in meta and "base_model" not in meta and "datasets" not in meta
    assert (
        "![confusion matrix over the held-out set](confusion_matrix.png)" in text and "(training_curves.png)" in text
    )
    assert is_png(out / "confusion_matrix.png") and is_png(out / "training_curves.png")
    assert f"| 3 | {samples['3']} | {per_class['3']:.6g} |" in text
    assert res["launch"]["command"] in text and res["launch"]["strategy"] == "one CPU process"
    # `hf upload` with the card's command sends the model, its card, pictures and record: no checkpoint, no hidden file
    assert uploaded(out, text) == {
        "README.md", "confusion_matrix.png", "training_curves.png", "model.safetensors", "results.json"
    }  # fmt: skip
    assert list(out.glob("checkpoint-*/model.safetensors")) and (out / ".model-files.json").is_file()

    # scripts/predict.py labels the held-out images as the run's own evaluation did, image for image (its main here,
    # what it prints read back; its command line, exit code and error line: launched just below)
    images = sorted(digits["val"].glob("*/*.png"))
    capsys.readouterr()
    predict.main([str(a) for a in (out, "--json", "--top_k", "2", *images)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["image"] for line in lines] == [str(p) for p in images]
    predicted = [[0] * 10 for _ in classes]
    for line, path in zip(lines, images):
        assert len(line["labels"]) == 2 and line["labels"][0]["probability"] >= line["labels"][1]["probability"]
        predicted[classes.index(path.parent.name)][classes.index(line["labels"][0]["label"])] += 1
    assert predicted == matrix
    proc = run([BIN / "python", REPO / "scripts" / "predict.py", digits["val"], images[0]], check=False)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        f"error: {digits['val']}: not a finished image-recipe run (no results.json); pass the --output_dir of a "
        "finished recipes/cifar.py run"
    ]
    PartialState()
    cut = tmp_path / "cut"  # a copy of the run whose weights were cut short, and one without them
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("checkpoint-*"))
    (cut / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:1000])
    gone = tmp_path / "gone"
    shutil.copytree(cut, gone)
    (gone / "model.safetensors").unlink()
    for folder, image, message in (
        (tmp_path / "nowhere", images[0], "no such folder"),
        (out, tmp_path / "missing.png", "no such image file"),
        (out, out / "results.json", "unreadable image"),
        (out, digits["val"], "a folder, not an image file: pass the images in it"),
        (cut, images[0], "model.safetensors does not load into the model its results.json describes"),
        (gone, images[0], "model.safetensors: no such file, and the run's results.json says it finished"),
    ):
        with pytest.raises(RecipeError, match=message):
            predict.main([str(folder), str(image)])

    # Epoch checkpoints resume at the start of the next epoch...
    state = json.loads((out / f"checkpoint-{(epochs - 1) * per_epoch}" / "trainer_state.json").read_text())
    assert (state["epoch"], state["samples_in_epoch"], state["samples_seen"]) == (
        epochs - 1,
        0,
        (epochs - 1) * per_epoch * 64,
    )
    assert state["effective_batch_size"] == 64 and "torch" in state["versions"] and state["args"]["seed"] == 42
    final = load_file(out / "model.safetensors")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / f"checkpoint-{(epochs - 1) * per_epoch}", resumed / f"checkpoint-{(epochs - 1) * per_epoch}")
    # the resumes in this process's python (forked warm): one process, launch.sh's quick start is the run above
    run([BIN / "python", RECIPE, *digits_args(digits, resumed, *args, "--resume_from_checkpoint", "latest")])
    assert results(resumed)["steps"] == epochs * per_epoch
    weights = load_file(resumed / "model.safetensors")
    for name in final:
        torch.testing.assert_close(weights[name], final[name], rtol=1e-5, atol=1e-6, msg=name)
    assert results(resumed)["eval_accuracy"] == pytest.approx(res["eval_accuracy"], abs=1e-9)
    # ...and `latest` on the finished run (a requeued job that had finished) ends at once, exit 0,
    # saying so, and changes nothing: no step trained again, its weights and results.json kept.
    before = snapshot(out)
    proc = run([BIN / "python", RECIPE, *digits_args(digits, out, *args, "--resume_from_checkpoint", "latest")])
    (done,) = [line for line in proc.stderr.splitlines() if line.startswith("done:")]
    assert done.startswith(
        f"done: {out} holds a finished run (results.json, {epochs * per_epoch} steps): nothing left to train"
    )
    assert not error_lines(proc.stderr) and "resumed from" not in proc.stderr
    assert snapshot(out) == before


@pytest.fixture(scope="module")
def shard_probes(digits, tmp_path_factory):
    """One 2-process launch of tests/probes/shard_probe.py through the recipe's loaders, both input paths: the
    decoding DataLoader (no workers), then --data_on_device. Its record: world size and, per path, the samples each
    process trained each epoch and the ones the gathered evaluation counted."""
    out = tmp_path_factory.mktemp("shard_probe") / "probe.json"
    args = digits_args(digits, out.parent / "unused", "--per_device_train_batch_size", "32")
    cmd, env = accelerate_cpu(
        2, REPO / "tests/probes/shard_probe.py", out, *args, "--dataloader_num_workers", "0", "---", "--data_on_device"
    )
    run(cmd, env=env)
    return json.loads(out.read_text())


@pytest.mark.floor
@pytest.mark.slow
def test_two_processes_see_disjoint_halves_and_eval_gathers_each_sample_once(digits, shard_probes):
    assert shard_probes["world_size"] == 2
    probe = shard_probes["probes"][0]
    assert probe["on_device"] is False  # the decoding DataLoader
    per_process_batches = (digits["n_train"] // 32) // 2
    orders = []
    for epoch in probe["train"]:
        rank0, rank1 = epoch
        assert len(rank0) == len(rank1) == per_process_batches * 32
        assert not set(rank0) & set(rank1), "the two processes trained on the same samples"
        assert len(set(rank0)) == len(rank0) and len(set(rank1)) == len(rank1)
        orders.append(rank0)
    assert orders[0] != orders[1], "the shuffle did not change between epochs"
    assert sorted(probe["eval"]) == list(range(digits["n_val"])), "eval missed or double-counted samples"


@pytest.mark.slow
def test_launch_without_cpu_setting_refuses_instead_of_training_copies(digits, tmp_path):
    """accelerate_configs/cpu.yaml without ACCELERATE_USE_CPU: 2 processes that form no group, each training its own
    copy, refused in one line. (`--multi_gpu --num_processes 2` starts the very same processes, and `--num_processes
    2` alone one process: the two tests below.)"""
    out = tmp_path / "run"
    env = user_env()
    launch = ["--config_file", REPO / "accelerate_configs/cpu.yaml", "--main_process_port", env["MASTER_PORT"]]
    proc = run([ACCELERATE_LAUNCH, *launch, RECIPE, *digits_args(digits, out, *FAST_MODEL)], env=env,
               check=False)  # fmt: skip
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(
        "error: the launcher started 2 processes but they formed no group (distributed type NO): each process would "
        "train its own copy of the model; on a host without GPUs use ./launch.sh, or export ACCELERATE_USE_CPU=true "
        "before accelerate launch"
    ), lines[0]
    assert not out.exists(), "a refused run must not write output"


def test_multi_gpu_without_cpu_setting_starts_the_processes_the_refused_cpu_config_starts(monkeypatch):
    """`accelerate launch --multi_gpu --num_processes 2` starts its 2 processes with the environment and torchrun
    arguments of cpu.yaml without ACCELERATE_USE_CPU, byte for byte: the refusal launched above is theirs. (Should
    accelerate ever pass the config's use_cpu on, this fails: then the flag needs a launch of its own.)"""
    port = free_port()  # accelerate refuses one in use
    flag = started_by_accelerate_launch(monkeypatch, port, "--multi_gpu", "--num_processes", "2")
    config = started_by_accelerate_launch(monkeypatch, port, "--config_file", REPO / "accelerate_configs/cpu.yaml")
    assert flag == config
    assert flag[1]["nproc_per_node"] == "2" and "ACCELERATE_USE_CPU" not in flag[0]


@pytest.mark.parametrize("launcher", ["accelerate launch", "accelerate-launch"])
def test_num_processes_alone_is_refused_by_the_one_process_accelerate_starts(launcher, digits, tmp_path, monkeypatch):
    """`accelerate launch --num_processes 2` without --multi_gpu starts one process (accelerate says nothing): the
    process reads its parent's command line (/proc) and refuses; so does one under `accelerate-launch`, accelerate's
    entry point for the same command. Here the parent is a process with that very command line, and the recipe's
    check runs with the environment accelerate's one-process launcher gives. (The refusal through a real launch:
    tests/test_launch_sh.py's refusals of a cpu launch.)"""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    from common import runtime

    out = tmp_path / "run"
    port = free_port()
    argv = [str(a) for a in ["--num_processes", "2", "--main_process_port", port, RECIPE, *digits_args(digits, out)]]
    launched, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    for name in [name for name in os.environ if name.startswith("ACCELERATE_")]:  # as user_env()
        monkeypatch.delenv(name)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in prepare_simple_launcher_cmd_env(launched)[1].items():
        monkeypatch.setenv(name, value)
    script = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"
    if launcher == "accelerate launch":  # python runs ./launch, under the command line [accelerate, launch, ...]
        (tmp_path / "launch").write_text(script)
        cmd = [str(BIN / "accelerate"), "launch", *argv]
    else:  # as its shebang runs it: [python, .../accelerate-launch, ...]
        (tmp_path / "accelerate-launch").write_text(script)
        cmd = [sys.executable, str(tmp_path / "accelerate-launch"), *argv]
    parent = subprocess.Popen(cmd, executable=sys.executable, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "started\n"  # its command line is in /proc (empty while it starts)
        monkeypatch.setattr(runtime, "_PARENT", parent.pid)
        with pytest.raises(RecipeError) as refused:
            runtime.make_accelerator(None)  # refused before it reads its arguments
    finally:
        parent.kill()
        parent.communicate()
    assert str(refused.value) == (
        "accelerate launch --num_processes 2 started one process: it starts several only with --multi_gpu, a "
        "multi-process --config_file or more than one GPU; on a host without GPUs pass --multi_gpu with "
        "ACCELERATE_USE_CPU=true exported (it starts the processes on the CPU), or use ./launch.sh"
    )


def initial_weights(*model_args, seed=42):
    """The weights a run starts from: the recipe seeds every process before it builds the model."""
    set_seed(seed)
    model = vision.set_norm_layer(vision.new_model(*model_args), "group")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def update_apart(a_dir, b_dir, start) -> float:
    """|weights(a) - weights(b)| / |weights(a) - start|: how far apart two runs ended, in units of
    how far training moved the weights."""
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    apart = sum(((a[k] - b[k]).double() ** 2).sum() for k in a)
    moved = sum(((a[k] - start[k]).double() ** 2).sum() for k in a)
    return float((apart / moved).sqrt())


def stop_step(proc) -> int:
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("preempted:")]
    return int(line.split("after step ")[1].split(";")[0])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["loader workers", "the default, on the device"])
def test_a_stop_mid_epoch_resumed_on_another_number_of_processes_ends_with_the_uninterrupted_weights(
    digits, tmp_path, path
):
    """The position is saved in samples of the epoch's order, so a run stopped in 2 processes x 32
    continues in 1 process x 64 (and back) on the very samples it had left, with the same effective
    batch, learning rate and schedule, and ends with the uninterrupted run's weights. GroupNorm:
    BatchNorm's statistics depend on how a step's samples are split into processes.

    launch.sh, 2 processes, accumulation 2, loader workers or the images held in memory. SIGUSR1 reaches rank 1
    only, mid epoch 0: both stop after the same step, save one checkpoint there, launch.sh exits 75. Resumed in 1
    process with `latest` past a damaged and an incomplete newer checkpoint, it crosses into epoch 1.
    (Resumed on more processes than it stopped on: the LM runs of tests/test_prepared.py, 2 -> 3, whose
    positions are the same common.data.EpochSampler's.)
    It is compared with the uninterrupted run of its first layout, a few steps after the resume:
    another split sums gradients in another order, and ReLU and max-pool ties on these upscaled
    digits grow that tenfold a step (measured: 2e-6 of the update after 1 step, 6% after 10). A
    replayed or skipped batch would be a whole step apart, about 8% of the update here."""
    common_args = [
        "--model",
        "resnet18",
        "--image_size",
        "24",
        "--norm_layer",
        "group",
        "--gradient_accumulation_steps",
        "2",
        *(["--dataloader_num_workers", "1"] if path == "loader workers" else []),
        "--max_train_steps",
        "13",
        "--learning_rate",
        "0.01",
    ]
    two, one = ["--per_device_train_batch_size", "32"], ["--per_device_train_batch_size", "64"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cmd, env = accelerate_cpu(2, RECIPE, *digits_args(digits, straight, *common_args, *two))
    run(cmd, env=env)
    start = initial_weights("resnet18", 10)

    launch = [
        REPO / "launch.sh",
        "cifar",
        *digits_args(digits, resumed, *common_args, *two, "--checkpointing_steps", "4", "--save_total_limit", "2"),
    ]
    proc, _ = interrupt(launch, user_env(), resumed, after_step=8, sig=signal.SIGUSR1, rank=1)
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr[-3000:]
    stop = stop_step(proc)
    assert stop in (9, 10) and f"checkpoint-{stop}. Continue with --resume_from_checkpoint latest" in proc.stderr
    assert sorted(int(p.name.split("-")[1]) for p in resumed.glob("checkpoint-*")) == [8, stop]  # --save_total_limit 2
    state = json.loads((resumed / f"checkpoint-{stop}" / "trainer_state.json").read_text())
    assert state["step"] == stop and state["epoch"] == 0 and state["world_size"] == 2
    assert state["samples_in_epoch"] == state["samples_seen"] == stop * 128  # mid epoch 0 (1280), in samples
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(state["files"])  # both processes saved this step
    assert not (resumed / "results.json").exists()

    # Newer debris that `latest` must pass over: a copy cut short, and a folder without its marker.
    shutil.copytree(resumed / f"checkpoint-{stop}", resumed / "checkpoint-40")
    weights = resumed / "checkpoint-40" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    shutil.copytree(resumed / f"checkpoint-{stop}", resumed / "checkpoint-50")
    (resumed / "checkpoint-50" / "trainer_state.json").unlink()
    proc = run(
        [
            BIN / "python",
            RECIPE,
            *digits_args(digits, resumed, *common_args, *one, "--resume_from_checkpoint", "latest"),
        ]
    )
    assert f"checkpoint-{stop} at step {stop}" in proc.stderr
    assert "ignoring damaged checkpoint" in proc.stderr and "model.safetensors has 1000 bytes" in proc.stderr
    assert "ignoring incomplete checkpoint" in proc.stderr
    assert (
        "processes x per-device batch x accumulation 2 x 32 x 2 -> 1 x 64 x 2, effective batch 128 -> 128"
        in proc.stderr
    )
    assert update_apart(resumed, straight, start) < 1e-4
    for res in (results(resumed), results(straight)):  # epoch 0: 21 rounds of 64, the last too few for a step
        assert res["steps"] == 13 and res["samples_seen"] == 13 * 128 and res["epochs"] > 1
        assert res["args"]["data_on_device"] is (path != "loader workers")


@pytest.mark.slow
def test_a_model_with_dropout_resumed_on_its_layout_ends_with_the_uninterrupted_weights_exactly(digits, tmp_path):
    """Dropout draws from each process's random stream, which a checkpoint saves and a resume restores; nothing else
    may draw from it in between (a DataLoader's iterator seeds its workers from a generator of its own), so the
    resumed run draws the uninterrupted run's masks. 2 processes, loader workers, MobileNetV3's dropout."""
    args = ["--model", "mobilenet_v3_small", "--per_device_train_batch_size", "8", "--dataloader_num_workers", "1"]
    args += ["--max_train_steps", "6", "--checkpointing_steps", "3", "--hflip", "0"]
    out = tmp_path / "run"
    run(*accelerate_cpu(2, RECIPE, *digits_args(digits, out, *args)))
    straight = load_file(out / "model.safetensors")
    resume = ["--resume_from_checkpoint", out / "checkpoint-3"]  # mid epoch 0
    run(*accelerate_cpu(2, RECIPE, *digits_args(digits, out, *args, *resume)))
    resumed = load_file(out / "model.safetensors")
    assert max((straight[k].float() - resumed[k].float()).abs().max().item() for k in straight) == 0.0


DIGITS = ["--dataset", "imagefolder", "--train_dir", "{train}", "--val_dir", "{val}"]  # formatted per test


@pytest.mark.parametrize(
    "args, subject",
    [
        (["--dataset", "cifar10", "--data_dir", "{tmp}/no_such_dir"], "--data_dir"),
        (["--dataset", "imagefolder", "--train_dir", "{tmp}/missing", "--val_dir", "{tmp}/missing"], "--train_dir"),
        (["--resume_from_checkpoint", "{tmp}"], "--resume_from_checkpoint"),
        (["--model", "no_such_net", *DIGITS], "--model"),
        # 1,400 digits: 21 batches of 64 an epoch, so no step could hold 30 of them; a batch larger than the set
        # has no step at all, and the fix is the batch
        (["--per_device_train_batch_size", "4096", *DIGITS], "--gradient_accumulation_steps"),
        (["--per_device_train_batch_size", "64", "--gradient_accumulation_steps", "30", *DIGITS],
         "--gradient_accumulation_steps"),
    ],
)  # fmt: skip
def test_bad_input_gets_one_error_line_and_no_output(digits, tmp_path, args, subject):
    """The recipe's own process (python recipes/cifar.py, forked warm: input validation needs no launcher; a
    recipe's error through launch.sh: tests/test_launch_sh.py): exit 2, one error line naming the option, no output
    folder. The rule for every refusal, read from its fields: tests/test_refusals.py."""
    out = tmp_path / "run"
    args = [a.format(tmp=tmp_path, train=digits["train"], val=digits["val"]) for a in args]
    proc = run([BIN / "python", RECIPE, "--output_dir", out, *args], check=False, timeout=180)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and subject in lines[0], proc.stderr[-3000:]
    if "4096" in args:
        assert "lower --per_device_train_batch_size" in lines[0]  # the fix: the batch, not the accumulation
    assert not out.exists()


def test_data_on_device_augments_each_sample_by_seed_epoch_and_index_alone(digits):
    """The property resume and other process counts rely on: a sample's crop and flip do not
    depend on the batch that fetches it, and change with the epoch."""
    cifar = load_recipe()
    args = cifar.parse_args([str(a) for a in digits_args(digits, "unused", "--data_on_device")])
    train, evals, _ = cifar.build_device_datasets(args, vision.load_images(args), torch.device("cpu"))
    images, labels = train.__getitems__([3, 5, 7])
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64
    torch.testing.assert_close(train.__getitems__([5])[0][0], images[1], rtol=0, atol=0)
    train.set_epoch(1)
    assert not torch.equal(train.__getitems__([3, 5, 7])[0], images)

    # Each image is the 32x32 window at the drawn offset of the zero-padded original, mirrored when drawn.
    index = torch.arange(64)
    crops = train.__getitems__(index.tolist())[0]
    u = seeded_uniform(args.seed, 1, index, 3)
    mean = torch.tensor(vision.IMAGENET_MEAN).view(3, 1, 1) * 255
    std = torch.tensor(vision.IMAGENET_STD).view(3, 1, 1) * 255
    flips = 0
    for i in index.tolist():
        padded = torch.nn.functional.pad(train.tensors[0][i].permute(2, 0, 1).float(), (4, 4, 4, 4))
        dy, dx = int(u[i, 0] * 9), int(u[i, 1] * 9)
        window = padded[:, dy : dy + 32, dx : dx + 32]
        if u[i, 2] < 0.5:
            window, flips = window.flip(-1), flips + 1
        torch.testing.assert_close(crops[i], (window - mean) / std)
    assert 16 < flips < 48


@pytest.mark.floor
@pytest.mark.slow
def test_data_on_device_gives_two_processes_disjoint_halves_and_exact_eval(digits, shard_probes):
    """--data_on_device on CPU (it learns and resumes: the first test of this file runs with it); the same 2-process
    launch as the DataLoader path's test above, its second probe."""
    assert shard_probes["world_size"] == 2
    probe = shard_probes["probes"][1]
    assert probe["on_device"] is True
    for rank0, rank1 in probe["train"]:
        assert len(rank0) == len(rank1) == (digits["n_train"] // 32) // 2 * 32
        assert not set(rank0) & set(rank1) and len(set(rank0)) == len(rank0)
    assert probe["train"][0][0] != probe["train"][1][0], "the shuffle did not change between epochs"
    assert sorted(probe["eval"]) == list(range(digits["n_val"])), "eval missed or double-counted samples"


# --- fine-tuning: pretrained weights, a frozen backbone, the head's learning rate; augmentation switches ---

TORCHVISION_RESNET18 = "hub/checkpoints/resnet18-f37072fd.pth"  # the file torchvision's ResNet18_Weights.DEFAULT names


def imagenet_resnet18(seed=0):
    """A state dict of torchvision's ResNet-18 with ImageNet's 1000 classes: seeded random weights, standing in
    for the published ones (whose download the tests cannot make)."""
    torch.manual_seed(seed)
    return torchvision.models.resnet18().state_dict()


def test_pretrained_reads_torchvisions_cache_safely_and_offline_without_it_says_where_the_file_goes(
    monkeypatch, tmp_path
):
    cifar = load_recipe()
    PartialState()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for key, value in NO_NETWORK.items():
        monkeypatch.setenv(key, value)
    args = cifar.parse_args(["--model", "resnet18", "--pretrained"])
    cached = tmp_path / TORCHVISION_RESNET18
    with pytest.raises(RecipeError) as err:
        vision.build_model(args, 10, on_gpu=False)
    assert str(err.value).startswith(
        "--pretrained: torchvision's weights for --model resnet18 "
        "(ResNet18_Weights.IMAGENET1K_V1) are not in the cache and could not be downloaded"
    )
    assert (
        f"download https://download.pytorch.org/models/resnet18-f37072fd.pth where there is network and put it at "
        f"{cached} (TORCH_HOME sets the folder)" in str(err.value)
    )
    assert not list(tmp_path.rglob("*.pth*")), "a failed download left a file behind"

    weights = imagenet_resnet18()
    torch.save(weights, cached)
    model = vision.build_model(args, 10, on_gpu=False)
    loaded = model.state_dict()
    for name, tensor in weights.items():
        if not name.startswith("fc."):
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    assert model.fc.out_features == 10 and all(p.requires_grad for p in model.parameters())  # a new head, all trained

    weights["layer3.0.conv1.weight"][0, 0, 0, 0] = float("nan")  # the cached file damaged since its download
    torch.save(weights, cached)
    with pytest.raises(RecipeError, match=r"cannot be loaded \(1 tensor\(s\) hold NaN or inf, such as layer3.0.conv1"):
        vision.build_model(args, 10, on_gpu=False)  # else a loss of NaN at the first step, blamed on the rate

    class Code:  # a cached file that would run code when unpickled
        def __reduce__(self):
            return (cached.with_name("ran").write_text, ("code ran",))

    torch.save({"conv1.weight": Code()}, cached)
    with pytest.raises(
        RecipeError, match=r"\(ResNet18_Weights.IMAGENET1K_V1\) cannot be loaded \(not plain weights\)"
    ):
        vision.build_model(args, 10, on_gpu=False)
    assert not cached.with_name("ran").exists()


def fake_hub_cache(root, repo, state_dict):
    """A Hugging Face hub cache holding `repo`'s model.safetensors, as hf_hub_download leaves it."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    save_file(
        {k: v.contiguous() for k, v in state_dict.items()}, folder / "snapshots" / ("0" * 40) / "model.safetensors"
    )


def test_timm_models_by_name_from_scratch_from_the_hub_cache_and_normalized_as_their_weights(
    digits, monkeypatch, tmp_path
):
    timm = pytest.importorskip("timm")
    import huggingface_hub.constants

    cifar = load_recipe()
    PartialState()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    scratch = vision.build_model(cifar.parse_args(["--model", "timm/resnet18"]), 10, on_gpu=False)
    assert isinstance(scratch, timm.models.ResNet) and vision.head_names(scratch) == ["fc"]
    assert scratch(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    # timm's BatchNormAct2d normalizes and activates: GroupNorm in its place keeps the activation
    activations = lambda model: sum(isinstance(m, torch.nn.SiLU) for m in model.modules())  # noqa: E731
    efficientnet = vision.new_model("timm/efficientnet_b0", 10)
    grouped = vision.set_norm_layer(vision.new_model("timm/efficientnet_b0", 10), "group")
    assert activations(grouped) == activations(efficientnet) > 40 and not any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in grouped.modules()
    )

    args = cifar.parse_args(["--model", "timm/resnet18.a1_in1k", "--pretrained", "--freeze_backbone"])
    with pytest.raises(RecipeError) as err:
        vision.build_model(args, 10, on_gpu=False)
    assert str(err.value).startswith(
        "--pretrained: timm's weights for --model timm/resnet18.a1_in1k could not be loaded ("
    ) and "fetch timm/resnet18.a1_in1k into the Hugging Face cache" in str(err.value)
    torch.manual_seed(0)
    weights = timm.create_model("resnet18").state_dict()
    fake_hub_cache(tmp_path, "timm/resnet18.a1_in1k", weights)
    model = vision.build_model(args, 10, on_gpu=False)
    loaded = model.state_dict()
    assert loaded["fc.weight"].shape == (10, 512)
    for name, tensor in weights.items():
        if not name.startswith("fc.") and "num_batches_tracked" not in name:
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]

    # The inputs are normalized as the weights were trained: this one on [-1, 1], not with ImageNet's statistics.
    args = cifar.parse_args(
        [
            str(a)
            for a in digits_args(
                digits, "unused", "--model", "timm/efficientnet_b0.ra4_e3600_r224_in1k", "--pretrained"
            )
        ]
    )
    _, evals, _ = cifar.build_datasets(args, vision.load_images(args))
    (normalize,) = [t for t in evals.transform.transforms if isinstance(t, torchvision.transforms.Normalize)]
    assert tuple(normalize.mean) == tuple(normalize.std) == (0.5, 0.5, 0.5)


SECRETS = {"HF_TOKEN": "hf_" + "S3cr3t" * 6, "WANDB_API_KEY": "0123456789abcdef" * 2}


@pytest.fixture(scope="module")
def frozen_head_runs(digits, tmp_path_factory):
    """--pretrained_path from a file written here and --freeze_backbone, 4 steps: one process x 32 straight through
    (its checkpoint-2 kept), and the README's copy flow resuming that checkpoint-2 in 2 processes x 16 (DDP) for
    steps 3 and 4: train.py and common/ in a project of their own, launched by launch.sh from its folder, with
    TensorBoard tracking and credentials in its environment. Returns the folders and the copy's finished launch."""
    root = tmp_path_factory.mktemp("frozen_head")
    weights = imagenet_resnet18()
    file = root / "resnet18.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, file)
    args = ["--model", "resnet18", "--pretrained_path", file, "--freeze_backbone", "--hflip", "0"]
    args += ["--max_train_steps", "4", "--learning_rate", "0.4", "--dataloader_num_workers", "0"]
    args += ["--checkpointing_steps", "2"]
    original, copy = root / "original", root / "copy"
    run([BIN / "python", RECIPE, *digits_args(digits, original, *args, "--per_device_train_batch_size", "32")])
    project = root / "myproject"
    project.mkdir()
    shutil.copy(RECIPE, project / "train.py")
    shutil.copytree(REPO / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    with open(project / "common" / "__init__.py", "a") as f:
        f.write("\nimport sys\n\nprint('the copy of common', file=sys.stderr)\n")
    resume = ["--per_device_train_batch_size", "16", "--resume_from_checkpoint", original / "checkpoint-2"]
    copied = digits_args(digits, copy, *args, *resume, "--report_to", "tensorboard", "--logging_steps", "1")
    proc = run([REPO / "launch.sh", "./train.py", "--num_processes", "2", *copied], cwd=project,
               env=user_env(**SECRETS))  # fmt: skip
    return {"weights": weights, "original": original, "copy": copy, "proc": proc}


@pytest.mark.slow
def test_a_frozen_backbone_trains_only_the_head_in_two_processes_as_in_one(frozen_head_runs):
    """--freeze_backbone, 2 processes (DDP) from a one-process checkpoint: every backbone tensor, BatchNorm
    statistics included, is the file's at the end; the optimizer holds the head alone. The 2 x 16 steps end with the
    head of the 1 x 32 run: with a frozen backbone the step's gradient is the mean over its 32 samples only if DDP
    averaged the head's gradients."""
    weights, proc = frozen_head_runs["weights"], frozen_head_runs["proc"]
    out, straight = frozen_head_runs["copy"], frozen_head_runs["original"]
    assert "--freeze_backbone: training fc only, 5,130 of 11,181,642 parameters" in proc.stderr
    assert "fc.bias, fc.weight new: the file's head has other classes" in proc.stderr
    assert results(out)["world_size"] == 2 and results(straight)["world_size"] == 1
    final = load_file(out / "model.safetensors")
    for name, tensor in weights.items():
        if name.startswith("fc."):
            assert final[name].shape[0] == 10
        elif "num_batches_tracked" not in name:
            torch.testing.assert_close(final[name], tensor, rtol=0, atol=0, msg=name)
    resumed_from = load_file(straight / "checkpoint-2" / "model.safetensors")
    assert not torch.equal(final["fc.weight"], resumed_from["fc.weight"])  # the 2 processes trained the head
    optimizer = torch.load(out / "checkpoint-4" / "optimizer.bin", weights_only=True)
    assert sum(len(group["params"]) for group in optimizer["param_groups"]) == 2  # fc.weight and fc.bias
    assert sorted(tuple(s["momentum_buffer"].shape) for s in optimizer["state"].values()) == [(10,), (10, 512)]
    one = load_file(straight / "model.safetensors")
    assert one.keys() == final.keys()
    for name in final:
        torch.testing.assert_close(final[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_copy_renamed_to_train_py_runs_from_its_own_folder_and_resumes_the_originals_checkpoint(frozen_head_runs):
    """The README's copy flow: a checkpoint names the recipe by its RECIPE constant, not its file name, so the copy
    continues a run of recipes/cifar.py: launch.sh runs the copy from its folder, with the copy's common/ (a line of
    its own marks it), in 2 processes x 16, and it resumes the original's 1 x 32 checkpoint."""
    proc, original, out = frozen_head_runs["proc"], frozen_head_runs["original"], frozen_head_runs["copy"]
    assert f"resumed from {original / 'checkpoint-2'} at step 2" in proc.stderr
    assert "the copy of common" in proc.stderr and results(out)["world_size"] == 2
    assert results(out)["steps"] == 4 and (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_tensorboard_tracking_writes_events_and_no_secret_reaches_a_log_or_a_file(frozen_head_runs):
    """The copy's 2-process run, tracked by TensorBoard with HF_TOKEN and WANDB_API_KEY in its environment."""
    proc, out = frozen_head_runs["proc"], frozen_head_runs["copy"]
    assert list((out / "cifar").rglob("events.out.tfevents.*"))
    written = [proc.stdout, proc.stderr] + [p.read_bytes().decode("latin-1") for p in out.rglob("*") if p.is_file()]
    for secret in SECRETS.values():
        assert not any(secret in text for text in written)


@pytest.mark.slow
def test_pretrained_with_a_faster_head_on_device_without_flip_or_crop(digits, tmp_path):
    """--pretrained from a TORCH_HOME cache written here, --head_lr_scale 10, --data_on_device with both
    augmentations off, launched: every parameter trains, the head's groups at 10 times the rate."""
    (tmp_path / TORCHVISION_RESNET18).parent.mkdir(parents=True)
    torch.save(imagenet_resnet18(), tmp_path / TORCHVISION_RESNET18)
    out = tmp_path / "run"
    run(
        [
            BIN / "python",
            RECIPE,
            *digits_args(
                digits,
                out,
                "--model",
                "resnet18",
                "--pretrained",
                "--head_lr_scale",
                "10",
                "--data_on_device",
                "--hflip",
                "0",
                "--no-random_crop",
                "--max_train_steps",
                "2",
                "--checkpointing_steps",
                "1",
                "--per_device_train_batch_size",
                "32",
            ),
        ],
        env=user_env(TORCH_HOME=str(tmp_path), **NO_NETWORK),
    )
    # the rates of step 2 (step 1 is the warmup's first, at 0)
    optimizer = torch.load(out / "checkpoint-2" / "optimizer.bin", weights_only=True)
    groups = [
        (group["lr"], [tuple(optimizer["state"][i]["momentum_buffer"].shape) for i in group["params"]])
        for group in optimizer["param_groups"]
    ]
    assert sum(len(shapes) for _, shapes in groups) == len(list(torchvision.models.resnet18().parameters()))
    (backbone_lr, _), (no_decay_lr, _), (head_lr, head), (bias_lr, bias) = groups  # backbone, then the head
    assert head == [(10, 512)] and bias == [(10,)] and backbone_lr == no_decay_lr > 0
    assert head_lr == bias_lr == pytest.approx(10 * backbone_lr)
    assert results(out)["steps"] == 2


def test_the_input_path_by_default_holds_a_set_that_fits_on_the_device_and_says_why_in_one_line(
    digits, tmp_path, monkeypatch, caplog
):
    """Without --data_on_device or --no-data_on_device: images of 64 px or less that fit (the smaller of 1 GiB and a
    tenth of the memory a process has) are held on the device; larger images, more bytes, or loader workers asked
    for take the decoding DataLoader; a resume takes its checkpoint's path, and the other one asked for is refused
    naming both. One info line says which path and why, whatever decided it; --dataloader_num_workers on the device
    path is said to do nothing."""
    from types import SimpleNamespace

    cifar = load_recipe()
    PartialState()
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True)

    def chosen(*extra, resume_from=None):
        args = cifar.parse_args([str(a) for a in digits_args(digits, "unused", *extra)])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="recipes"):
            on_device = vision.held_on_device(args, vision.load_images(args), accelerator, resume_from)
        # accelerate 1.11 and later prefix "[RANK 0] "; the floor, 1.10, does not
        said = [re.sub(r"^\[RANK \d+\] ", "", r.getMessage()) for r in caplog.records if r.name == "recipes"]
        return on_device, said

    n = digits["n_train"] + digits["n_val"]
    these = f"the {n:,} images ({n * 32 * 32 * 3 / 2**20:.1f} MB as uint8)"
    held = f"input: {these} are held on cpu and cropped and flipped there (--data_on_device): nothing is decoded"
    assert chosen() == (True, [f"{held} after the start; --no-data_on_device decodes them in the DataLoader instead"])
    assert chosen("--data_on_device") == (True, [f"{held} after the start, as --data_on_device asks"])
    on_device, (line,) = chosen("--no-data_on_device")
    assert not on_device and line.startswith("input: ") and line.endswith("each image, as --no-data_on_device asks")
    on_device, (line,) = chosen("--image_size", "96")
    assert not on_device and line.endswith("images above 64 px are cropped by PIL (scale-and-crop)"), line
    on_device, (line,) = chosen("--dataloader_num_workers", "2")
    assert not on_device and line == (
        "input: 2 DataLoader worker(s) a process decode, crop and flip each image, as --dataloader_num_workers asks "
        f"(--data_on_device would hold {these} on cpu)"
    )
    on_device, (line,) = chosen("--dataloader_num_workers", "0")
    assert not on_device and line.startswith("input: the training process decodes, crops and flips each image (no")
    assert chosen("--data_on_device", "--dataloader_num_workers", "2")[1] == [
        f"{held} after the start, as --data_on_device asks",
        "--dataloader_num_workers 2 does nothing: no image is decoded",
    ]
    monkeypatch.setattr(vision, "DEVICE_DATA_BYTES", 2**20)
    on_device, (line,) = chosen()
    assert not on_device and f"{these} take more than the 1 MB a process may hold on cpu" in line, line
    for saved in (True, False):  # a resume replays its checkpoint's augmentation, whatever fits now
        checkpoint = tmp_path / f"checkpoint-{int(saved)}"
        checkpoint.mkdir()
        (checkpoint / "trainer_state.json").write_text(json.dumps({"args": {"data_on_device": saved}}))
        on_device, (line,) = chosen(resume_from=checkpoint)
        assert on_device is saved and line.endswith(f"as checkpoint checkpoint-{int(saved)} was trained"), line
    with pytest.raises(RecipeError) as refused:
        chosen("--no-data_on_device", resume_from=tmp_path / "checkpoint-1")
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'checkpoint-1'} was trained with --data_on_device, whose crops and flips "
        "--no-data_on_device would draw otherwise; resume without --no-data_on_device (or with --data_on_device)"
    )
    assert chosen("--data_on_device", resume_from=tmp_path / "checkpoint-1")[0] is True


@pytest.mark.parametrize("size", [32, 96])
def test_flip_and_crop_switches_change_what_the_model_sees(digits, size):
    """In both input paths (the image loaders; --data_on_device at 32 px), in-process. With --hflip 0 and
    --no-random_crop a training sample is its image's evaluation view; with the crop on it is not; --hflip 1
    mirrors each crop; the default mirrors about half of them."""
    cifar = load_recipe()
    index = list(range(24))

    def views(*extra):
        args = cifar.parse_args([str(a) for a in digits_args(digits, "unused", "--image_size", size, *extra)])
        if args.data_on_device:
            train, _, _ = cifar.build_device_datasets(args, vision.load_images(args), torch.device("cpu"))
            mean, std = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (vision.IMAGENET_MEAN, vision.IMAGENET_STD))
            return train.__getitems__(index)[0], (train.tensors[0][index].permute(0, 3, 1, 2).float() - mean) / std
        train, evals, _ = cifar.build_datasets(args, vision.load_images(args))
        return (
            torch.stack([train[i][0] for i in index]),
            torch.stack([evals.transform(train.dataset[i][0]) for i in index]),
        )

    for device in (["--no-data_on_device"], ["--data_on_device"]) if size == 32 else ([],):
        plain, evaluated = views("--hflip", "0", "--no-random_crop", *device)
        torch.testing.assert_close(plain, evaluated, rtol=0, atol=0)
        cropped, _ = views("--hflip", "0", *device)
        assert sum(torch.equal(a, b) for a, b in zip(cropped, plain)) < 6
        mirrored, _ = views("--hflip", "1", *device)
        torch.testing.assert_close(mirrored, cropped.flip(-1), rtol=0, atol=0)
        default, _ = views(*device)
        flipped = [not torch.equal(a, b) for a, b in zip(default, cropped)]
        assert all(torch.equal(a, b.flip(-1)) for a, b, f in zip(default, cropped, flipped) if f)
        assert 4 <= sum(flipped) <= 20, sum(flipped)
