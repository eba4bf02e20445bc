"""Unit tests of common/: batch and LR arithmetic, the schedule, checkpoint resolution, and
augmentation seeded by (seed, epoch, index)."""

import argparse
import os
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator, PartialState
from conftest import load_recipe
from torch.utils.data import Dataset

import common
from common import RecipeError
from common.args import TRAINING_HYPERPARAMETERS, public_args
from common.checkpoint import resolve_checkpoint, write_json
from common.data import EpochSampler, SeededTransform, epoch_batches, make_dataloader
from common.loop import TrainingLoop
from common.metrics import TrainLog
from common.plan import Position, effective_batch_size, plan_run, plan_training, scale_lr


def test_effective_batch_size():
    assert effective_batch_size(128, 8, 4) == 4096
    assert effective_batch_size(32, 1, 1) == 32


@pytest.mark.parametrize(
    "rule, batch, expected",
    [
        ("linear", 1024, 0.8),
        ("linear", 64, 0.05),
        ("sqrt", 512, 0.2),
        ("sqrt", 32, 0.05),
        ("none", 4096, 0.1),
    ],
)
def test_scale_lr(rule, batch, expected):
    assert scale_lr(0.1, batch, 128, rule) == pytest.approx(expected)


def test_scale_lr_rejects_unknown_rule():
    with pytest.raises(ValueError, match="linear, sqrt, none"):
        scale_lr(0.1, 256, 128, "cube")


def plan(num_samples=1400, num_processes=2, **kw):
    args = dict(
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        learning_rate=0.1,
        reference_batch_size=128,
        lr_scaling="linear",
        num_train_epochs=3,
        max_train_steps=None,
        warmup_steps=None,
        warmup_ratio=0.0,
        lr_scheduler_type="constant",
    )
    return plan_training(argparse.Namespace(**{**args, **kw}), num_samples, num_processes)


def test_plan_counts_optimizer_steps_per_process():
    p = plan()
    assert p.steps_per_epoch == 21  # 43 batches dealt to 2 processes, the odd one dropped
    assert p.max_train_steps == 63
    assert p.effective_batch_size == 64 and p.learning_rate == pytest.approx(0.05)
    # accumulation: 21 batches per process in steps of 4 -> 5 steps; the 21st batch is dropped, as 1 x 4b drops it
    assert plan(gradient_accumulation_steps=4).steps_per_epoch == 5
    assert plan(gradient_accumulation_steps=4).effective_batch_size == 256


def test_plan_max_train_steps_and_warmup():
    p = plan(max_train_steps=50, warmup_ratio=0.1, lr_scheduler_type="linear")
    assert p.max_train_steps == 50 and p.warmup_steps == 5
    assert plan(max_train_steps=50, warmup_steps=7, warmup_ratio=0.1, lr_scheduler_type="linear").warmup_steps == 7


def test_plan_holds_the_schedules_warmup_to_what_the_schedule_has():
    """Constant has no warmup (its log says 0); inverse_sqrt without one (refused when the arguments are parsed:
    tests/test_refusals.py) takes the warmup it is given; what transformers refuses when it builds a schedule
    (polynomial's fixed lr_end above the scaled rate) is one line before training."""
    constant = plan(max_train_steps=50, warmup_steps=5)
    assert constant.warmup_steps == 0 and constant.lr_at(0) == constant.learning_rate
    assert plan(lr_scheduler_type="inverse_sqrt", warmup_steps=5).warmup_steps == 5
    with pytest.raises(RecipeError) as refused:
        plan(lr_scheduler_type="polynomial", learning_rate=1e-7)
    assert refused.value.subject == "--lr_scheduler_type" and "lr_end" in refused.value.problem  # transformers' why


def test_plan_refuses_a_batch_larger_than_the_data():
    with pytest.raises(RecipeError, match="lower --per_device_train_batch_size or the number of processes, or"):
        plan(num_samples=63, num_processes=2)  # batch 1 may not be possible (batch norm), fewer processes is
    with pytest.raises(RecipeError, match="lower --per_device_train_batch_size, or use more data"):
        plan(num_samples=31, num_processes=1)
    with pytest.raises(RecipeError, match="is scaled for; lower the number of processes, or use more data"):
        plan(num_samples=1, num_processes=2, per_device_train_batch_size=1)  # a batch of 1 is not lowered
    # 21 batches per process: accumulating 22 would make every step the whole epoch, at a rate scaled for 22
    assert plan(gradient_accumulation_steps=21).steps_per_epoch == 1
    too_many = "fewer than --gradient_accumulation_steps 22, .* lower --gradient_accumulation_steps to 21 or less"
    with pytest.raises(RecipeError, match=too_many):
        plan(gradient_accumulation_steps=22)


def test_schedule_warms_up_then_decays_to_zero():
    p = plan(max_train_steps=100, warmup_steps=10, lr_scheduler_type="cosine")
    samples = [p.steps_and_samples_from(Position(), steps=step)[1] for step in range(100)]  # before each step
    lrs = [p.lr_at(seen) for seen in samples]  # the rate of each step
    assert lrs[0] == 0.0 and lrs[10] == pytest.approx(p.learning_rate)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 0.01 * p.learning_rate


def test_a_schedule_made_on_the_main_process_gives_each_step_its_rate_and_nothing_else():
    """plan_run sends the other processes the schedule's factors at the steps the run takes (from a resumed position
    too), which then need not import transformers: each step's rate comes from them, bit for bit transformers'; a rate
    asked for elsewhere, or by a plan made from it with another schedule, is transformers' own."""
    from dataclasses import replace

    from common.plan import schedule_factors, with_schedule

    p = plan(max_train_steps=40, warmup_steps=4, lr_scheduler_type="cosine")
    start = Position(step=10, epoch=0, sample=640, seen=640)
    factors = schedule_factors(p, start)
    steps = [start.seen + i * p.effective_batch_size for i in range(31)]  # before each step left, and at the end
    assert list(factors) == steps and steps[-1] == p.total_samples
    shared = with_schedule(p, factors)
    fresh = plan(max_train_steps=40, warmup_steps=4, lr_scheduler_type="cosine")  # its own transformers schedule
    assert [shared.lr_at(s) for s in steps] == [fresh.lr_at(s) for s in steps]
    marked = with_schedule(p, {s: 0.5 for s in steps})  # rates that can only come from the table
    assert [marked.lr_at(s) for s in steps] == [0.5 * p.learning_rate] * len(steps)
    assert marked.lr_at(steps[0] + 1) == fresh.lr_at(steps[0] + 1) != 0.5 * p.learning_rate
    longer = replace(marked, total_samples=2 * p.total_samples)
    assert longer.lr_at(steps[5]) == replace(fresh, total_samples=2 * p.total_samples).lr_at(steps[5])
    assert longer.lr_at(steps[5]) != 0.5 * p.learning_rate


@pytest.fixture
def accelerate_state():
    """common's logger is Accelerate's, which needs the process state recipes always have."""
    return PartialState()


def shared_defaults(parser=None) -> dict:
    """cifar's HYPERPARAMETERS of the options every recipe shares."""
    return {k: v for k, v in load_recipe("cifar").HYPERPARAMETERS.items() if k in TRAINING_HYPERPARAMETERS}


def make_checkpoint(root, step, complete=True):
    path = root / f"checkpoint-{step}"
    path.mkdir()
    if complete:
        write_json(path / common.checkpoint.STATE_FILE, {"step": step})
    return path


def test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line(tmp_path, accelerate_state):
    """Checkpoints written before positions were kept in samples hold `batches_in_epoch` instead."""
    parser = common.training_parser("t", "t")
    parser.set_defaults(**shared_defaults(parser))
    args = parser.parse_args(["--output_dir", str(tmp_path)])
    checkpoint = make_checkpoint(tmp_path, 13)
    write_json(checkpoint / common.checkpoint.STATE_FILE, {"step": 13, "epoch": 1, "batches_in_epoch": 4})
    with pytest.raises(RecipeError) as refused:
        plan_run(args, [0] * 1400, 2, checkpoint)
    assert refused.value.subject == str(checkpoint)


def test_a_checkpoint_past_the_length_asked_is_refused(tmp_path, accelerate_state):
    """Resumed with fewer epochs or steps than it has trained, a checkpoint would only become the run's model; at
    the end of the last epoch asked (a save cut short) it is the run's end: nothing to train."""
    parser = common.training_parser("t", "t")
    parser.set_defaults(**shared_defaults(parser))
    args = parser.parse_args(["--output_dir", str(tmp_path), "--num_train_epochs", "1"])
    plan, _ = plan_run(args, [0] * 1400, 2)  # 5 steps of 256 an epoch
    state = {
        "data_fingerprint": plan.data_fingerprint, "args": public_args(args), "num_samples": 1400, "world_size": 2,
        "per_device_train_batch_size": 128, "gradient_accumulation_steps": 1, "effective_batch_size": 256,
        "learning_rate": plan.learning_rate, "total_samples": 2560, "warmup_samples": 256,
    }  # fmt: skip
    checkpoint = make_checkpoint(tmp_path, 7)
    write_json(checkpoint / "trainer_state.json", {**state, "step": 7, "epoch": 1, "samples_in_epoch": 512,
                                                   "samples_seen": 1792})  # fmt: skip
    with pytest.raises(RecipeError, match=r"at step 7 \(1 epoch\(s\) and 512 samples trained\), past "
                       r"--num_train_epochs 1: there is nothing to train.*; pass --num_train_epochs 2 or more, or an "
                       r"earlier checkpoint"):  # fmt: skip
        plan_run(args, [0] * 1400, 2, checkpoint)
    write_json(checkpoint / "trainer_state.json", {**state, "step": 10, "epoch": 2, "samples_in_epoch": 0,
                                                   "samples_seen": 2560})  # fmt: skip
    with pytest.raises(RecipeError, match=r"\(2 epoch\(s\) trained\), past --num_train_epochs 1: .*; pass "
                       r"--num_train_epochs 3 or more"):  # fmt: skip
        plan_run(args, [0] * 1400, 2, checkpoint)  # 2 would train nothing either
    write_json(checkpoint / "trainer_state.json", {**state, "step": 5, "epoch": 1, "samples_in_epoch": 0,
                                                   "samples_seen": 1280})  # fmt: skip
    assert plan_run(args, [0] * 1400, 2, checkpoint)[0].max_train_steps == 5


def test_a_warmup_as_long_as_the_run_is_refused_and_a_resume_keeps_the_checkpoints_warmup(tmp_path, accelerate_state):
    """Fresh, --warmup_steps as long as the run (in steps or epochs) is refused. Resumed in a larger batch, the run
    keeps the checkpoint's warmup in samples: the same --warmup_steps is not re-counted in the new layout's steps
    (10 warmup steps of batch 4 are 40 samples, 2.5 steps of batch 16 in an epoch of 6)."""
    parser = common.training_parser("t", "t")
    parser.set_defaults(**shared_defaults(parser))
    base = ["--output_dir", str(tmp_path), "--lr_scaling", "none", "--lr_scheduler_type", "linear"]
    parse = lambda *a: parser.parse_args([*base, *a])  # noqa: E731
    with pytest.raises(RecipeError) as refused:
        plan_run(parse("--num_train_epochs", "3", "--per_device_train_batch_size", "32", "--warmup_steps", "70"),
                 [0] * 1400, 2)  # fmt: skip
    assert (
        refused.value.subject == "--warmup_steps" and "the 63 steps of --num_train_epochs 3" in refused.value.problem
    )
    with pytest.raises(RecipeError) as refused:
        plan_run(parse("--max_train_steps", "50", "--warmup_steps", "50"), [0] * 1000, 1)
    assert refused.value.subject == "--warmup_steps" and "the 50 steps of --max_train_steps" in refused.value.problem
    first = parse("--num_train_epochs", "1", "--per_device_train_batch_size", "4", "--warmup_steps", "10")
    plan, _ = plan_run(first, [0] * 98, 1)
    state = {
        "data_fingerprint": plan.data_fingerprint, "args": public_args(first), "num_samples": 98, "world_size": 1,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "effective_batch_size": 4,
        "learning_rate": plan.learning_rate, "total_samples": plan.total_samples, "warmup_samples": 40,
        "step": 6, "epoch": 0, "samples_in_epoch": 24, "samples_seen": 24,
    }  # fmt: skip
    checkpoint = make_checkpoint(tmp_path, 6)
    write_json(checkpoint / "trainer_state.json", state)
    larger = parse("--num_train_epochs", "1", "--per_device_train_batch_size", "16", "--warmup_steps", "10")
    plan, start = plan_run(larger, [0] * 98, 1, checkpoint)
    assert (start.step, plan.max_train_steps, plan.warmup_samples, plan.total_samples) == (6, 10, 40, 88)
    assert plan.lr_at(24) == pytest.approx(plan.learning_rate * 24 / 40)  # warming up where it was
    # a ratio's warmup, kept from a longer run, would outlast a shorter one (a ratio of 1 fills its own run: allowed)
    ratio = parse("--max_train_steps", "20", "--per_device_train_batch_size", "4", "--warmup_ratio", "0.5")
    assert plan_run(ratio, [0] * 98, 1)[0].warmup_samples == 40
    write_json(checkpoint / "trainer_state.json", {**state, "args": public_args(ratio), "total_samples": 80})
    shorter = parse("--max_train_steps", "8", "--per_device_train_batch_size", "4", "--warmup_ratio", "0.5")
    with pytest.raises(RecipeError) as refused:
        plan_run(shorter, [0] * 98, 1, checkpoint)
    assert refused.value.subject == "--warmup_ratio" and "its 40 samples, of the checkpoint's run" in str(
        refused.value
    )
    full = parse("--max_train_steps", "8", "--per_device_train_batch_size", "4", "--warmup_ratio", "1")
    assert plan_run(full, [0] * 98, 1)[0].warmup_samples == 32  # fmt: skip


def test_epochs_count_whole_epochs_and_the_share_of_one_cut_short():
    """An epoch is whole once no step is left in it (whatever layouts trained it); --max_train_steps cutting one
    short leaves its share of the steps, as transformers counts."""
    p = plan(num_samples=1000, num_processes=1)  # 31 steps of 32 an epoch, 8 samples dropped
    assert p.epochs(Position(31, 0, 992, 992)) == 1.0 and p.epochs(Position(31, 1, 0, 992)) == 1.0
    assert p.epochs(Position(0, 1, 980, 1980)) == 2.0  # resumed from another layout's sample 980: none left
    assert p.epochs(Position(10, 2, 320, 2304)) == pytest.approx(2 + 10 / 31)
    assert p.epoch_done(Position(0, 0, 969, 0)) and not p.epoch_done(Position(0, 0, 968, 0))


def test_a_run_resumed_in_a_smaller_batch_resumes_again_to_the_samples_its_max_train_steps_meant(
    tmp_path, accelerate_state
):
    """--max_train_steps 10 at batch 16 means 160 samples; resumed at batch 8 from step 5 it ends at step 15.
    Resumed again from its step 12 with the same --max_train_steps, 3 steps are left, not "past 10"."""
    parser = common.training_parser("t", "t")
    parser.set_defaults(**shared_defaults(parser))
    argv = ["--output_dir", str(tmp_path), "--max_train_steps", "10", "--per_device_train_batch_size", "8"]
    args = parser.parse_args(argv)
    plan, _ = plan_run(args, [0] * 1000, 1)
    state = {
        "data_fingerprint": plan.data_fingerprint, "args": public_args(args), "num_samples": 1000, "world_size": 1,
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "effective_batch_size": 8,
        "learning_rate": plan.learning_rate, "total_samples": 160, "warmup_samples": 16,
        "step": 12, "epoch": 0, "samples_in_epoch": 136, "samples_seen": 136,
    }  # fmt: skip
    checkpoint = make_checkpoint(tmp_path, 12)
    write_json(checkpoint / "trainer_state.json", state)
    plan, start = plan_run(args, [0] * 1000, 1, checkpoint)
    assert (start.step, plan.max_train_steps, plan.total_samples) == (12, 15, 160)


def test_latest_is_the_newest_complete_checkpoint(tmp_path, accelerate_state):
    make_checkpoint(tmp_path, 9)
    newest = make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 200, complete=False)
    (tmp_path / ".tmp-checkpoint-300").mkdir()
    (tmp_path / "checkpoint-final").mkdir()
    assert resolve_checkpoint(tmp_path, "latest") == newest  # 100 > 9 numerically


def test_latest_without_checkpoints_starts_fresh_and_bad_paths_fail(tmp_path, accelerate_state):
    assert resolve_checkpoint(tmp_path, "latest") is None
    assert resolve_checkpoint(tmp_path, None) is None
    with pytest.raises(RecipeError) as refused:
        resolve_checkpoint(tmp_path, str(make_checkpoint(tmp_path, 5, complete=False)))
    assert refused.value.subject == "--resume_from_checkpoint" and "trainer_state.json is unreadable" in str(
        refused.value
    )
    write_json(tmp_path / "checkpoint-5" / "trainer_state.json", {"step": 5, "files": {"model.safetensors": 9}})
    with pytest.raises(RecipeError) as refused:
        resolve_checkpoint(tmp_path, "latest")  # starting at step 0 would write over them
    assert refused.value.subject == "--resume_from_checkpoint" and "--overwrite_output_dir" in refused.value.fix
    assert "(the newest, checkpoint-5: model.safetensors is missing)" in refused.value.problem


class Indexed(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(4), i


def test_seeded_transform_depends_on_seed_epoch_and_index_only():
    noise = lambda x: x + torch.rand(4)  # noqa: E731
    ds = SeededTransform(Indexed(), noise, seed=1)
    first = [ds[i][0] for i in range(8)]
    torch.rand(100)  # the global RNG moving on changes nothing
    assert all(torch.equal(ds[i][0], first[i]) for i in reversed(range(8)))
    assert not torch.equal(first[0], first[1])
    ds.set_epoch(1)
    assert not torch.equal(ds[0][0], first[0])
    assert not torch.equal(SeededTransform(Indexed(), noise, seed=2)[0][0], first[0])


@pytest.mark.parametrize("wrap", ["none", "subset", "concat"])
def test_seeded_transform_epoch_reaches_persistent_workers(wrap):
    """Also where a user wrapped the recipe's training set (a Subset, a ConcatDataset): every epoch augments anew."""
    ds = SeededTransform(Indexed(), lambda x: x + torch.rand(4), seed=0)
    data = {"none": ds, "subset": torch.utils.data.Subset(ds, range(8))}.get(wrap) or torch.utils.data.ConcatDataset(
        [torch.utils.data.Subset(ds, range(4)), torch.utils.data.Subset(ds, range(4, 8))]
    )
    loader = Accelerator(cpu=True).prepare(make_dataloader(data, 8, train=True, seed=0, num_workers=1))
    assert loader.persistent_workers
    for epoch in range(3):
        ((from_worker, index),) = list(epoch_batches(loader, epoch))
        assert index.tolist() == EpochSampler(8, seed=0).order(epoch).tolist()  # the epoch reached our sampler
        ds.set_epoch(epoch)
        expected = torch.stack([ds[int(i)][0] for i in index])  # computed here, in this process, for this epoch
        assert torch.equal(from_worker, expected), epoch


def test_the_data_fingerprint_reads_samples_of_any_dtype_and_the_bytes_it_always_read():
    """A user's dataset of bfloat16 tensors (numpy has no such dtype) has a fingerprint; float32's is the one earlier
    checkpoints recorded (the same bytes)."""
    from common.data import _bytes, fingerprint

    half = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2).bfloat16(), torch.arange(4))
    assert fingerprint(half) != fingerprint(torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2)))
    single = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    assert _bytes(single) == single.numpy().tobytes() and _bytes(torch.tensor(3)) == torch.tensor(3).numpy().tobytes()


def test_the_recipe_takes_a_copys_own_handlers_and_its_metrics_as_tensors_are_numbers(tmp_path):
    """make_accelerator(args, kwargs_handlers=[...]) adds a copy's handlers to the recipe's; a metric a copy returns as
    a tensor or a numpy number is a number in results.json."""
    import json

    import numpy as np
    from accelerate.utils import DistributedDataParallelKwargs

    from common.metrics import write_results

    args = argparse.Namespace(ddp_timeout=60, gradient_accumulation_steps=1, report_to="none", output_dir=tmp_path)
    handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = common.make_accelerator(args, kwargs_handlers=[handler])
    assert accelerator.ddp_handler is handler
    args.recipe = "t"
    path = write_results(accelerator, args, plan(64, 1), eval_error=1 - torch.tensor(0.25), eval_np=np.float32(0.5))
    record = json.loads(path.read_text())
    assert record["eval_error"] == 0.75 and record["eval_np"] == 0.5


def test_more_local_processes_than_gpus_is_refused_before_any_cuda_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with pytest.raises(RecipeError, match="4 processes requested on this node but only 2 GPU"):
        common.make_accelerator(None)


def test_relations_between_options_are_declared_and_checked_by_one_checker(capsys):
    """requires and excludes: an option in effect ("--flag": set and not 0 or False; "--flag value": that value;
    None: any run) refused in one line, naming the option (or the subject given), when what it needs does not hold
    or what it excludes is in effect; the texts may be functions of the arguments; declared order is checked order."""
    from common.args import ArgumentParser

    p = ArgumentParser()
    p.add_argument("--kind", choices=["a", "b"], default="a")
    p.add_argument("--path")
    p.add_argument("--size", type="positive_int", default=32)
    p.add_argument("--fast", action="store_true")
    p.add_argument("--rate", type="non_negative_float", default=0.5)
    p.requires("--kind b", lambda a: a.path, "--kind b needs --path")
    p.requires("--size", lambda a: a.size <= 64, lambda a: f"--size {a.size} is above 64", "pass 64 or less")
    p.requires("--fast", lambda a: a.rate > 0, "--fast needs --rate above 0", subject="--rate")
    p.excludes("--fast", "--kind b", "--fast is --kind a's")
    for argv in ([], ["--kind", "b", "--path", "x"], ["--size", "64", "--rate", "0"], ["--fast"]):
        p.parse_args(argv)  # nothing in effect that needs more
    for argv, subject, line in (
        (["--kind", "b"], "--kind", "--kind b needs --path"),
        (["--size", "65"], "--size", "--size 65 is above 64; pass 64 or less"),
        (["--fast", "--rate", "0"], "--rate", "--fast needs --rate above 0"),
        (["--fast", "--kind", "b", "--path", "x"], "--fast", "--fast is --kind a's"),
        (["--kind", "b", "--size", "99"], "--kind", "--kind b needs --path"),  # the first declared
    ):
        with pytest.raises(SystemExit) as refused:
            p.parse_args(argv)
        assert refused.value.code == 2 and refused.value.__cause__.subject == subject
        assert capsys.readouterr().err == f"error: {line}\n"


def test_a_deepspeed_configs_optimizer_and_scheduler_are_the_plans_or_one_line():
    """zero.py's rule, in this process (tests/test_zero.py launches it): a value the config's optimizer or scheduler
    sets is the plan's, or refused naming the option to pass; "auto" and a key the scheduler takes left out are
    filled with the plan's (warmup at least 1: DeepSpeed refuses 0); a scheduler's resume at another batch refused."""
    from common.runtime import agree_deepspeed_optimizer

    args, start = SimpleNamespace(weight_decay=0.0), SimpleNamespace(seen=0, step=0)
    plan = SimpleNamespace(learning_rate=0.003, warmup_steps=0, max_train_steps=7, effective_batch_size=16)
    config = {"optimizer": {"params": {"lr": "auto", "weight_decay": 0.0}}, "scheduler": {"type": "WarmupDecayLR"}}
    agree_deepspeed_optimizer(config, args, plan, start)
    assert config["scheduler"]["params"] == {"warmup_max_lr": 0.003, "warmup_num_steps": 1, "total_num_steps": 7}
    for config, subject, line in (
        ({"optimizer": {"params": {"lr": 1e-3}}}, "--lr_scaling", "the DeepSpeed config sets the optimizer's lr=0.001 "
         "but the recipe's --learning_rate (scaled to the batch) is 0.003, which it trains with; set it to \"auto\" "
         "in the config, or pass --lr_scaling none --learning_rate 0.001"),
        ({"optimizer": {"params": {"weight_decay": 0.1}}}, "--weight_decay", "the DeepSpeed config sets the "
         "optimizer's weight_decay=0.1 but the recipe's --weight_decay is 0"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}, "--warmup_steps", "the DeepSpeed "
         "config sets the scheduler's warmup_num_steps=100 but the recipe's warmup steps"),
    ):  # fmt: skip
        with pytest.raises(RecipeError) as refused:
            agree_deepspeed_optimizer(config, args, plan, start)
        assert refused.value.subject == subject and str(refused.value).startswith(line)
    with pytest.raises(RecipeError, match="^the DeepSpeed config's scheduler counts optimizer steps"):
        agree_deepspeed_optimizer({"scheduler": {}}, args, plan, SimpleNamespace(seen=48, step=2))


def test_a_recipe_is_described_by_its_docstrings_first_line_or_its_name():
    assert common.training_parser("t", "\nFirst line.\n\nMore.").description == "First line."
    assert common.training_parser("t", None).description == "t"  # a copy without a docstring (or python -OO)


def test_a_recipe_that_leaves_a_shared_hyperparameter_without_a_default_cannot_parse():
    """Each recipe states every shared training default in its HYPERPARAMETERS block: one missing is the
    recipe's mistake, caught before any command line is read."""
    parser = common.training_parser("t", "t")
    parser.set_defaults(**{k: v for k, v in shared_defaults(parser).items() if k != "warmup_ratio"})
    with pytest.raises(TypeError, match="HYPERPARAMETERS has no default for warmup_ratio"):
        parser.parse_args([])


@pytest.mark.parametrize("recipe", ["cifar", "lm_finetune"])
@pytest.mark.parametrize(
    "edit, said",
    [  # HYPERPARAMETERS edited in a copy: each value checked as the same value typed on the command line is
        ({"optimizer": "adam"}, "argument --optimizer: invalid choice: 'adam'"),
        ({"hflip": 1.5}, "argument --hflip: 1.5 is out of range"),
        ({"learning_rate": -0.1}, "argument --learning_rate: -0.1 is out of range"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "argument --lr_scheduler_type: invalid choice"),
        ({"gradient_accumulation_steps": 0}, "argument --gradient_accumulation_steps: 0 is out of range"),
        ({"lora_r": -8}, "argument --lora_r: -8 is out of range"),
        (
            {"learnin_rate": 0.1},
            "the recipe's HYPERPARAMETERS has learnin_rate, which is no option of it (did you mean",
        ),
    ],
)
def test_a_default_edited_into_hyperparameters_is_checked_as_if_typed(capsys, monkeypatch, recipe, edit, said):
    module = load_recipe(recipe)
    if not set(edit) <= {*module.HYPERPARAMETERS, "learning_rate", "learnin_rate", "lr_scheduler_type"}:
        pytest.skip(f"{recipe} has no {', '.join(edit)}")
    monkeypatch.setattr(module, "HYPERPARAMETERS", {**module.HYPERPARAMETERS, **edit})
    data = (
        ["--dataset", "imagefolder", "--train_dir", "t", "--val_dir", "v"]
        if recipe == "cifar"
        else ["--train_file", "t.jsonl"]
    )
    with pytest.raises(SystemExit, match="2"):
        module.parse_args(["--model_name_or_path", "m", *data] if recipe != "cifar" else data)
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err
    assert "learnin_rate" in edit or err.endswith(
        "it is the recipe's default: correct it in HYPERPARAMETERS, or pass the option\n"
    )


def test_a_string_default_of_an_option_of_several_values_is_one_value():
    """lora_target_modules="q_proj" in HYPERPARAMETERS: one module's name, as --lora_target_modules q_proj is."""
    parser = common.training_parser("t", "t")
    parser.add_argument("--names", nargs="+")
    parser.set_defaults(**shared_defaults(parser), names="q_proj")
    assert parser.parse_args([]).names == ["q_proj"] and parser.parse_args(["--names", "a", "b"]).names == ["a", "b"]


def test_an_epoch_that_ends_mid_accumulation_drops_its_remainder_and_the_counts_are_samples(tmp_path):
    """7 batches an epoch, accumulation 2: the 7th batch, too few for a step, is dropped, as a batch of 4 would drop
    its samples (every step trains the effective batch); 2 epochs are 6 steps of 4 samples."""
    parser = common.training_parser("t", "t")
    parser.set_defaults(**shared_defaults(parser))
    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    args = parser.parse_args([*argv, "--num_train_epochs", "2", "--logging_steps", "1", "--hang_timeout", "0"])
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    data = [torch.ones(4)] * 15  # 7 batches of 2, one sample left over
    train_dl = accelerator.prepare(common.make_dataloader(data, 2, train=True, seed=0, num_workers=0))
    plan, position = common.plan_run(args, data, accelerator.num_processes)
    assert (plan.steps_per_epoch, plan.max_train_steps, plan.total_samples) == (3, 6, 24)
    out, evaluated = SimpleNamespace(resume_from=None), []
    loop = TrainingLoop(accelerator, args, plan, position, out, torch.nn.Linear(1, 1),
                        lambda stop: evaluated.append(position.step) or {})  # fmt: skip
    windows = []
    for step in loop.steps(train_dl):  # the recipes' loop, less the model
        for x in step.micro_batches():
            step.backward(x.sum(1).mean().requires_grad_(), len(x))  # each sample's loss 4
        windows.append(len(step.batches))
    summary = loop.summary()
    assert windows == [2, 2, 2] * 2 and summary["steps"] == 6 and summary["samples_seen"] == 24
    assert summary["samples_per_second"] * loop.log.train_seconds == pytest.approx(24)
    assert summary["steady_samples_per_second"] > 0 and summary["epochs"] == 2
    assert loop.log.train_loss == 4.0 and [h["samples_seen"] for h in loop.log.history] == [4, 8, 12, 16, 20, 24]
    assert evaluated == [3, 6]  # each epoch's end


@pytest.mark.parametrize("eval_steps, points", [(None, [3, 6]), (2, [2, 4, 6]), (3, [3, 6]), (4, [4, 6]), (9, [6])])
def test_evaluation_points_are_each_epochs_end_or_every_eval_steps_and_the_runs_end_once(tmp_path, eval_steps, points):
    """--eval_steps N evaluates after every N-th optimizer step instead of at each epoch's end, and the run's last
    step is evaluated once whatever N; the metrics are in the log's eval_history at their step, the last returned."""
    parser = common.training_parser("t", "t")
    parser.set_defaults(**shared_defaults(parser))
    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "2", "--num_train_epochs", "2"]
    argv += ["--hang_timeout", "0"]  # no watchdog thread left in the test process
    args = parser.parse_args(argv + (["--eval_steps", str(eval_steps)] if eval_steps else []))
    accelerator = Accelerator(cpu=True)
    data = [torch.ones(4)] * 6  # 3 steps an epoch
    train_dl = accelerator.prepare(common.make_dataloader(data, 2, train=True, seed=0, num_workers=0))
    plan, position = common.plan_run(args, data, accelerator.num_processes)
    loop = TrainingLoop(accelerator, args, plan, position, SimpleNamespace(resume_from=None), torch.nn.Linear(1, 1),
                        lambda stop: {"eval_loss": float(position.step)})  # fmt: skip
    for step in loop.steps(train_dl):
        for x in step.micro_batches():
            step.backward(x.sum().requires_grad_(), len(x))
    assert [e["step"] for e in loop.log.eval_history] == points
    assert [e["eval_loss"] for e in loop.log.eval_history] == [float(p) for p in points]
    assert loop.finish() == {"eval_loss": 6.0} and loop.summary()["eval_history"] == loop.log.eval_history


def test_a_resumed_log_goes_on_with_the_checkpoints_history_and_window(tmp_path):
    """Stopped at step 3 of a 4-step log window and resumed: results.json's history and loss are those of a run never
    stopped (as transformers' Trainer keeps log_history in its trainer_state.json), and its train_seconds count the
    stopped attempt's steps since its last log."""
    import time

    accelerator, model = Accelerator(cpu=True), torch.nn.Linear(2, 2)
    plan = SimpleNamespace(max_train_steps=8, lr_at=lambda seen: 0.1, steps_per_epoch=8, effective_batch_size=1)

    def train(log, steps, losses, pause=0.0):
        for step in steps:
            time.sleep(pause)
            log.add(torch.tensor(losses[step - 1]), 1)
            log.step(step, step)
        return log

    losses = [float(i) for i in range(1, 9)]
    straight = train(TrainLog(accelerator, plan, Position(), 4), range(1, 9), losses)
    stopped = train(TrainLog(accelerator, plan, Position(), 4), range(1, 4), losses, pause=0.1)
    stopped.check_finite(3, model)  # as save_checkpoint does, before it records the log
    (tmp_path / "checkpoint-3").mkdir()
    write_json(
        tmp_path / "checkpoint-3" / "trainer_state.json",
        {"log_history": stopped.history, "log_window": stopped.window, "train_seconds": stopped.seconds},
    )
    resumed = train(
        TrainLog(accelerator, plan, Position(3, 0, 3, 3), 4, tmp_path / "checkpoint-3"), range(4, 9), losses
    )
    assert [h["step"] for h in resumed.history] == [h["step"] for h in straight.history] == [4, 8]
    assert [h["train_loss"] for h in resumed.history] == [h["train_loss"] for h in straight.history] == [2.5, 6.5]
    assert resumed.history[0]["train_seconds"] >= stopped.seconds >= 0.3  # steps 1-3, never logged, are counted
    straight.check_finite(8, model)  # saved at the end: resumed with nothing left, its loss is the last logged
    (tmp_path / "checkpoint-8").mkdir()
    write_json(
        tmp_path / "checkpoint-8" / "trainer_state.json",
        {"log_history": straight.history, "log_window": straight.window},
    )
    assert TrainLog(accelerator, plan, Position(8, 1, 0, 8), 4, tmp_path / "checkpoint-8").train_loss == 6.5


def test_a_log_is_the_weighted_mean_of_the_micro_batch_losses_since_the_last_one_numbers_or_device_counts():
    """The loss at a logging step is sum(loss x weight) / sum(items) over the micro-batches since the last log: a
    batch's samples as numbers, an LM's target tokens as tensors (its loss a share of the step's mean over `per`)."""
    accelerator = Accelerator(cpu=True)
    plan = SimpleNamespace(max_train_steps=4, lr_at=lambda seen: 0.1, epochs=lambda at: 1.0)
    log = TrainLog(accelerator, plan, Position(), 2)
    log.add(torch.tensor(1.0), 2), log.add(torch.tensor(4.0), 1)
    log.step(1, 3)
    log.add(torch.tensor(0.5), torch.tensor(3), per=torch.tensor(6)), log.add(torch.tensor(0.25), 3, per=6)
    log.step(2, 9)
    log.add(torch.tensor(2.0, dtype=torch.bfloat16), 4)
    log.step(3, 13)
    log.add(torch.tensor(3.0), torch.tensor(4))
    log.step(4, 17)
    assert [h["train_loss"] for h in log.history] == [pytest.approx(10.5 / 9), pytest.approx(2.5)]


def test_the_loop_times_each_steps_wait_for_its_data_beats_the_watchdog_and_stops_on_a_signal(tmp_path):
    """One process: the seconds each step waited for its batches are the log's data seconds; each step's end is a
    beat the watchdog reads (its steps' durations set its patience); a signal received during step 3 stops the run
    after it, with a checkpoint."""
    import signal
    import time

    from common import preemption

    class Slow(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.ones(2)

    parser = common.training_parser("t", "t")
    parser.set_defaults(**shared_defaults(parser))
    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    args = parser.parse_args([*argv, "--logging_steps", "1", "--hang_timeout", "3000", "--ddp_timeout", "6000"])
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    train_dl = accelerator.prepare(common.make_dataloader(Slow(), 2, train=True, seed=0, num_workers=0))
    plan, position = common.plan_run(args, Slow(), accelerator.num_processes)
    saved = []
    out = SimpleNamespace(resume_from=None, save_checkpoint=lambda model, plan, at, log, opt: saved.append(at.step))
    handlers = {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS}
    try:
        preemption.install_stop_handlers()
        loop = TrainingLoop(accelerator, args, plan, position, out, torch.nn.Linear(1, 1), lambda stop: {})
        with pytest.raises(preemption.Preempted) as stopped:
            for step in loop.steps(train_dl):
                for x in step.micro_batches():
                    step.backward(x.sum(1).mean().requires_grad_(), len(x))
                if position.step == 2:  # the body of step 3
                    signal.raise_signal(signal.SIGUSR1)
    finally:
        preemption._received.clear()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert stopped.value.step == 3 and saved == [3] and position.step == 3
    assert 3 * 4 * 0.01 <= loop.log.data_seconds < loop.log.train_seconds  # 4 samples of 10 ms each step
    beats = list(loop.stop.watchdog.beats)
    assert [step for step, _ in beats] == [None, 1, 2, 3]
    assert loop.stop.watchdog._looked() == (beats[-1][1], 3000)  # steps of milliseconds: --hang_timeout stands
    assert loop.stop.watchdog.step == 3


@pytest.mark.parametrize("waits, said", [(0.03, True), (0.002, False)])
def test_steps_that_wait_for_their_data_are_said_once_with_the_fixes_this_run_has(caplog, waits, said):
    """A step that spends more than a fifth of its time waiting for its batch (every rank: the loader is too slow
    for the model) is one warning at the second log (the first holds the loader workers' start), with the share and
    the fixes that apply to the run's arguments; results.json records the share either way."""
    import time

    from common.loop import loader_fixes

    accelerator = Accelerator(cpu=True)
    plan = SimpleNamespace(max_train_steps=12, lr_at=lambda seen: 0.1, epochs=lambda at: 1.0)
    args = SimpleNamespace(dataloader_num_workers=2, data_on_device=False, dataset="imagefolder")
    log = TrainLog(accelerator, plan, Position(), 3, loader_fixes=loader_fixes(args))
    with caplog.at_level("WARNING", logger="recipes"):
        for step in range(1, 13):
            time.sleep(0.04)  # the step: waiting for the batch, then computing
            log.add(torch.tensor(1.0), 1)
            log.step(step, step, waited=waits)
    lines = [r.getMessage() for r in caplog.records if "wait for their data" in r.getMessage()]
    share = log.summary(SimpleNamespace(step=12, seen=12))["data_wait_share"]
    assert (share > 0.2) == said and 0 < share < 1
    assert len(lines) == int(said), lines
    if said:
        assert "the steps wait for their data: " in lines[0] and "s, the median rank) is spent waiting" in lines[0]
        for fix in ("--dataloader_num_workers, now 2", "--data_on_device", "a faster filesystem"):
            assert fix in lines[0], lines[0]
    assert loader_fixes(SimpleNamespace(dataloader_num_workers=None)) == (
        "give the loader more workers (--dataloader_num_workers, default: by CPUs)"
    )  # an LM run: no --data_on_device, no image folder


@pytest.mark.parametrize("first, then", [((2, 8), (1, 16)), ((1, 16), (2, 8)), ((2, 8), (3, 5)), ((4, 3), (1, 7))])
def test_a_run_resumed_in_another_layout_trains_each_sample_once_per_epoch(first, then):
    """The job's samples, in the order Accelerate deals batches to processes (one batch per process a
    round, explicit ranks here), for a run stopped after some rounds in one layout (processes, batch)
    and resumed in another: together they are the epoch's order, each sample once, less a tail too
    short for a round of the second layout."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    def job_order(layout, sampler):
        world, batch = layout
        shards = [
            BatchSamplerShard(BatchSampler(sampler, batch, drop_last=True), world, rank, even_batches=True)
            for rank in range(world)
        ]
        rounds = zip(*(iter(shard) for shard in shards))  # round r: every process's r-th batch
        return [sample for batches in rounds for batch in batches for sample in batch]

    n, epoch = 101, 3
    sampler = EpochSampler(n, seed=7)
    sampler.set_epoch(epoch)
    order = sampler.order(epoch).tolist()
    assert sorted(order) == list(range(n)) and order != sorted(order)
    assert job_order(first, sampler) == order[: len(job_order(first, sampler))]  # the job trains a prefix

    stop = 4 * first[0] * first[1]  # after 4 rounds
    sampler.resume_at(epoch, stop)
    resumed = job_order(then, sampler)
    trained = order[:stop] + resumed
    assert trained == order[: len(trained)] and len(set(trained)) == len(trained)
    assert n - len(trained) < then[0] * then[1]  # only a tail shorter than a round is left
    sampler.set_epoch(epoch + 1)  # the next epoch starts at its beginning
    assert job_order(then, sampler) == sampler.order(epoch + 1).tolist()[: len(job_order(then, sampler))]


def test_the_samplers_order_is_torchs_int64_permutation_in_half_the_memory():
    """EpochSampler draws its order as int32 (4 bytes a sample), which is the order checkpoints of earlier versions
    resume by only while torch draws the same permutation in either dtype: if a torch release changes that, this
    fails, and resumed runs would train other samples."""
    for n in (7, 65_537, 3_000_001):
        for seed, epoch in ((42, 0), (7, 3)):
            order = EpochSampler(n, seed=seed).order(epoch)
            generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
            assert order.dtype == torch.int32 and torch.equal(order.long(), torch.randperm(n, generator=generator))


# Secrets ------------------------------------------------------------------------------------------


def test_public_args_masks_credentials():
    import argparse

    args = argparse.Namespace(
        hub_token="hf_" + "a" * 30,
        api_key="k",
        learning_rate=0.1,
        push_to_hub=True,
        dataset_name="https://user:pass@example.com/data",
        model_name_or_path="hf_" + "b" * 34,
        resume_from_checkpoint=None,
        tokenizer_name="gpt2",
        max_tokens=512,
        wandb_api_key="w",
        HF_TOKEN="t",
        client_secret="s",
    )
    shown = public_args(args)
    assert shown == {
        "hub_token": "***",
        "api_key": "***",
        "learning_rate": 0.1,
        "push_to_hub": True,
        "dataset_name": "https://***@example.com/data",
        "model_name_or_path": "***",
        "tokenizer_name": "gpt2",
        "max_tokens": 512,  # named like, but not, credentials
        "wandb_api_key": "***",
        "HF_TOKEN": "***",
        "client_secret": "***",
    }


def test_the_line_a_run_ends_with_masks_a_password_a_library_quoted(capsys, monkeypatch):
    """A library's message may quote the URL it was given (transformers' repo-id error, datasets' resolved path,
    where a URL's // became /): the error line masks its password, as every line and file of a run does."""
    from common import runtime

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    message = "--model_name_or_path https://alice:pw3SECRET@example.com/m: OSError: Repo id 'https://alice:pw3SECRET@"
    runtime._say(2, None, f"error: {message}ex' or /w/https:/bob:pw4SECRET@host/ds", everyone=True)
    err = capsys.readouterr().err
    assert "SECRET" not in err and err.count("***@") == 3, err


# The library uses that have no public API ------------------------------------------------------


def test_deepspeed_reads_the_universal_switch_universal_load_if_resharded_sets():
    """common.checkpoint.universal_load_if_resharded sets DeepSpeed's `checkpoint.load_universal` in the config the
    engine is built from. If DeepSpeed stops reading it, a ZeRO resume on another process count would load the wrong
    layout: fail here first."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig({"train_batch_size": 1}).load_universal_checkpoint is False
    config = DeepSpeedConfig({"train_batch_size": 1, "checkpoint": {"load_universal": True}})
    assert config.load_universal_checkpoint is True


def test_an_optional_package_that_is_not_installed_costs_accelerate_nothing_per_step(tmp_path, monkeypatch):
    """Accelerate's prepared optimizer asks importlib for lomo_optim at every step; the Accelerator the
    recipes build records its absence once (sys.modules[name] = None), and an installed one stays
    importable."""
    import importlib
    import importlib.util
    import sys

    from accelerate.utils import is_lomo_available

    from common.runtime import _cache_missing_optional_packages

    monkeypatch.delitem(sys.modules, "lomo_optim", raising=False)
    calls = []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: calls.append(name) or real(name, *a))
    _cache_missing_optional_packages()
    assert sys.modules["lomo_optim"] is None
    calls.clear()
    assert not any(is_lomo_available() for _ in range(10)) and calls.count("lomo_optim") == 10  # answered at once
    with pytest.raises(ImportError):
        importlib.import_module("lomo_optim")

    monkeypatch.delitem(sys.modules, "lomo_optim")
    (tmp_path / "lomo_optim").mkdir()
    (tmp_path / "lomo_optim" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    _cache_missing_optional_packages()
    assert "lomo_optim" not in sys.modules and real("lomo_optim") is not None  # installed: left alone


def test_a_known_bad_library_version_is_refused_before_anything_runs(monkeypatch):
    """A release that would hang or train wrong, installed despite pyproject's floors (pip --no-deps,
    an existing environment): one line naming the package and the version to install."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.7.1" if name == "torch" else real(name))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"^torch 2.7.1 is installed, and with it a job of several processes hangs"):
        common.make_accelerator(None)
    # one process: no process group to hang in; torch 2.8 under FSDP2 on CPU: gloo's reduce-scatter sums where FSDP2
    # asks it to average (tests/test_fsdp.py runs the launch); under DDP, or with one process, there is no
    # reduce-scatter. Each case of common.preflight's rules: tests/test_launcher.py
    from common.preflight import known_bad_torch

    assert known_bad_torch(1, "2.7.1", fsdp_on_cpu=False) is None
    assert known_bad_torch(2, "2.8.0", fsdp_on_cpu=False) is None
    refusal = known_bad_torch(2, "2.8.0", fsdp_on_cpu=True)
    assert str(refusal).startswith("torch 2.8.0 is installed, and with it FSDP2 on CPU trains on the sum ")
    assert known_bad_torch(1, "2.8.0", fsdp_on_cpu=True) is None and known_bad_torch(2, "2.9.0", True) is None


def test_only_torchs_wait_for_other_processes_is_a_stuck_collective(capsys):
    """Exit 124 and the collective's line for gloo's, NCCL's or the store's timeout; a timeout the user's own code
    meets (a tracking server, a dataset read over the network) is its traceback and exit 1, even under a name with
    "timeout" in it."""

    class ReadTimeout(OSError):  # as requests', httpx's and botocore's are named
        pass

    from common.runtime import _how_it_ended

    gloo = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600000ms for recv"
    )
    store = torch.distributed.DistStoreError("wait timeout after 30000ms, keys: /default_pg/0//cpu//0")
    for err in (gloo, store):
        assert _how_it_ended(err)[:2] == (124, "error")
    for err in (
        TimeoutError("tracking server at 10.0.0.5:8080 did not answer"),
        ReadTimeout("The read operation timed out"),
    ):
        assert _how_it_ended(err)[:3] == (1, None, None)
        assert capsys.readouterr().err.endswith(f"{type(err).__name__}: {err}\n")  # its traceback, printed


def test_an_exit_without_teardown_runs_the_exit_handlers_and_keeps_the_code(tmp_path):
    """common.runtime.exit_without_teardown relies on atexit._run_exitfuncs: the handlers run (a tracker's flush, a
    line written at exit), then the process ends with the code given."""
    import atexit
    import subprocess
    import sys

    assert callable(atexit._run_exitfuncs), "atexit changed: common.runtime.exit_without_teardown must change"
    marker = tmp_path / "flushed"
    script = (
        "import atexit, pathlib, sys\n"
        f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('yes'))\n"
        "from common.runtime import exit_without_teardown\n"
        "print('last line', end='')\n"
        "exit_without_teardown(2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "last line" and marker.read_text() == "yes", proc.stderr


def test_a_process_of_several_ends_a_finished_run_without_the_interpreters_teardown(tmp_path):
    """A run that finished, in a process of several (WORLD_SIZE 2), ends through exit_without_teardown: exit 0, its
    exit handlers run and its status said, and none of the interpreter's teardown (freeing every imported module's
    objects: about 1.3 CPU-seconds a process). A single process tears down as Python does: the same script, forked
    with WORLD_SIZE 1, shows the teardown the other skips."""
    import subprocess
    import sys

    script = (
        "import atexit, os, pathlib, sys\n"
        "from common.runtime import exit_codes\n"
        "class Teardown:  # a module's global: freed by the interpreter's teardown alone\n"
        "    def __del__(self, open=open):  # the builtins are gone by then\n"
        "        open(self.path, 'w').close()\n"
        "for world in ('1', '2'):\n"
        "    if os.fork() == 0:\n"
        "        os.environ['WORLD_SIZE'] = world\n"
        "        kept = Teardown()\n"
        "        kept.path = os.path.join(os.environ['MARKS'], 'teardown-' + world)\n"
        "        os.environ['RECIPE_STATUS_FILE'] = os.path.join(os.environ['MARKS'], 'status-' + world)\n"
        "        atexit.register(lambda: pathlib.Path(os.environ['MARKS'], 'atexit-' + world).touch())\n"
        "        with exit_codes():\n"
        "            print('trained', world)\n"
        "        sys.exit(0)\n"
        "    print('exit', os.waitstatus_to_exitcode(os.wait()[1]), flush=True)\n"
        "os._exit(0)\n"
    )
    env = {**os.environ, "MARKS": str(tmp_path), "RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.split("\n") == ["trained 1", "exit 0", "trained 2", "exit 0", ""], proc.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"status-1", "status-2", "atexit-1", "atexit-2", "teardown-1"}
    assert (tmp_path / "status-2").read_text() == "finished\n"


def test_one_line_of_an_error_is_a_whole_sentence():
    """An error whose first line only announces (huggingface_hub's validation errors end it with ':') keeps what it
    announces; any other keeps its first line."""
    from common.runtime import one_line

    validation = ValueError(
        "Validation error for field 'hidden_size':\n    TypeError: Field 'hidden_size' expected int"
    )
    assert (
        one_line(validation) == "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int"
    )
    assert one_line(OSError("disk is full.\nmore detail")) == "disk is full"
    assert one_line(KeyError()) == "KeyError"


@pytest.mark.parametrize(
    "config, processes, message",
    [
        ({"train_micro_batch_size_per_gpu": 4}, 1, "the DeepSpeed config sets train_micro_batch_size_per_gpu=4 but "
         "the recipe's --per_device_train_batch_size is 8; remove it from the config or set it to \"auto\" (the "
         "recipe's value is then used), or pass --per_device_train_batch_size 4"),
        ({"train_batch_size": 16}, 1, "train_batch_size=16 but the recipe's batch (8 per device x 1 processes x 1 "
         "accumulation) is 8; remove it from the config or set it to \"auto\" (the recipe's value is then used), or "
         "pass flags that make it"),
        ({"train_batch_size": 16}, 3, "train_batch_size=16 but the recipe's batch (8 per device x 3 processes x 1 "
         "accumulation) is 24"),
        ({"gradient_clipping": 0.01}, 1, "gradient_clipping=0.01 but the recipe's --max_grad_norm is 1.0"),
        ({"gradient_accumulation_steps": 4}, 1, "gradient_accumulation_steps=4 but the recipe's "
         "--gradient_accumulation_steps is 1; remove it from the config"),
        ({"zero_optimization": {"stage": 3}}, 1, "under ZeRO-3 the final save gathers the weights only with "
         "zero3_save_16bit_model: true"),
    ],
)  # fmt: skip
def test_a_deepspeed_config_at_odds_with_the_recipes_flags_is_refused_naming_both(config, processes, message):
    """The config's batch, accumulation and clipping are the flags' or refused (DeepSpeed's own win over Accelerate's:
    one trained what the other reported); ZeRO-3 without the 16-bit gather would fail at the final save: a rule of
    common.preflight (the config as accelerate launch passes it on: tests/test_launcher.py). Launched in 2 DeepSpeed
    processes through launch.sh, its fix followed: tests/test_fixes.py."""
    from common.preflight import deepspeed_against_arguments

    args = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_grad_norm=1.0)
    assert message in str(deepspeed_against_arguments(config, args, processes))


def test_a_deepspeed_config_s_auto_values_become_the_recipes():
    from common.runtime import fill_deepspeed_config

    config = {"train_batch_size": "auto", "gradient_clipping": 0.5, "zero_optimization": {"stage": 2}}
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5)
    fill_deepspeed_config(config, args, 3)
    assert config == {
        "train_batch_size": 24, "gradient_clipping": 0.5, "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
    }  # fmt: skip


def test_a_plain_optimizer_step_calls_code_of_the_loop_and_the_log_alone(tmp_path):
    """benchmarks/step_cost.py's loop, one process: a step that neither logs, checkpoints, evaluates nor stops calls
    functions of common/loop.py and common/metrics.py only (with the recipe's body, three files): its data, rate,
    position, stop flags and watchdog beat are read as data, not through data.py, plan.py, preemption.py or
    watchdog.py (what benchmarks/README.md states)."""
    import importlib.util
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))  # step_cost imports benchlib
    try:
        spec = importlib.util.spec_from_file_location("step_cost", REPO / "benchmarks" / "step_cost.py")
        spec.loader.exec_module(step_cost := importlib.util.module_from_spec(spec))
        files = step_cost.files_a_plain_step_runs(Accelerator(cpu=True), tmp_path / "run")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert files == ["common/loop.py", "common/metrics.py"]
