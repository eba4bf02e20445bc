"""Unit tests of common/: batch and LR arithmetic, the schedule, checkpoint resolution, and
augmentation seeded by (seed, epoch, index)."""

import math

import pytest
import torch
from accelerate import Accelerator, PartialState
from conftest import load_recipe
from torch.utils.data import DataLoader, Dataset

import common
from common import RecipeError
from common.args import public_args
from common.checkpoint import resolve_checkpoint, write_json
from common.data import SeededTransform, set_epoch
from common.scaling import effective_batch_size, make_scheduler, plan_training, scale_lr
from common.training import Progress, plan_run


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


def plan(**kw):
    base = dict(
        num_samples=1400,
        per_device_batch_size=32,
        num_processes=2,
        gradient_accumulation_steps=1,
        learning_rate=0.1,
        reference_batch_size=128,
        lr_scaling="linear",
        num_train_epochs=3,
    )
    return plan_training(**{**base, **kw})


def test_plan_counts_optimizer_steps_per_process():
    p = plan()
    assert p.steps_per_epoch == 21  # 43 batches dealt to 2 processes, the odd one dropped
    assert p.max_train_steps == 63 and p.num_epochs == 3
    assert p.effective_batch_size == 64 and p.learning_rate == pytest.approx(0.05)
    # accumulation: 21 batches per process in steps of 4 -> 5 full steps + 1 at the epoch end
    assert plan(gradient_accumulation_steps=4).steps_per_epoch == 6
    assert plan(gradient_accumulation_steps=4).effective_batch_size == 256


def test_plan_max_train_steps_and_warmup():
    p = plan(max_train_steps=50, warmup_ratio=0.1)
    assert p.max_train_steps == 50 and p.num_epochs == math.ceil(50 / 21) and p.warmup_steps == 5
    assert plan(max_train_steps=50, warmup_steps=7, warmup_ratio=0.1).warmup_steps == 7


def test_plan_refuses_a_batch_larger_than_the_data():
    with pytest.raises(RecipeError, match="lower --per_device_train_batch_size"):
        plan(num_samples=63, num_processes=2)
    # 21 batches per process: accumulating 22 would make every step the whole epoch, at a rate scaled for 22
    assert plan(gradient_accumulation_steps=21).steps_per_epoch == 1
    too_many = "fewer than --gradient_accumulation_steps 22, .* lower --gradient_accumulation_steps to 21 or less"
    with pytest.raises(RecipeError, match=too_many):
        plan(gradient_accumulation_steps=22)


def test_schedule_warms_up_then_decays_to_zero():
    p = plan(max_train_steps=100, warmup_steps=10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=p.learning_rate)
    progress = Progress()
    sched = make_scheduler(opt, "cosine", p, progress)
    lrs = []
    for step in range(100):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        progress.samples_seen = p.samples_for_steps(step + 1)
        sched.step()
    assert lrs[0] == 0.0 and lrs[10] == pytest.approx(p.learning_rate)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 0.01 * p.learning_rate


@pytest.fixture
def accelerate_state():
    """common's logger is Accelerate's, which needs the process state recipes always have."""
    return PartialState()


def make_checkpoint(root, step, complete=True):
    path = root / f"checkpoint-{step}"
    path.mkdir()
    if complete:
        write_json(path / common.checkpoint.STATE_FILE, {"step": step})
    return path


def test_a_checkpoint_of_the_earlier_format_resumes_at_its_position_in_samples(tmp_path, accelerate_state):
    """Checkpoints written before positions were kept in samples hold `batches_in_epoch`, rounds of
    their own layout: 2 processes x 32, accumulation 2, 21 rounds (11 steps) an epoch, stopped 2
    steps into epoch 1."""
    parser = common.training_parser("t")
    parser.set_defaults(**load_recipe("cifar").HYPERPARAMETERS)
    args = parser.parse_args(
        ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "2"]
    )
    layout = {"world_size": 2, "per_device_train_batch_size": 32, "gradient_accumulation_steps": 2}
    checkpoint = make_checkpoint(tmp_path, 13)
    write_json(
        checkpoint / common.checkpoint.STATE_FILE,
        {"step": 13, "epoch": 1, "batches_in_epoch": 4, **layout, "args": {"seed": args.seed}},
    )
    plan, progress = plan_run(args, 1400, 2, checkpoint)
    assert plan.steps_per_epoch == 11
    assert progress == Progress(step=13, epoch=1, samples_in_epoch=4 * 64, samples_seen=(21 + 4) * 64)


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
    with pytest.raises(RecipeError, match="not a complete checkpoint"):
        resolve_checkpoint(tmp_path, str(make_checkpoint(tmp_path, 5, complete=False)))


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


def test_seeded_transform_epoch_reaches_persistent_workers():
    ds = SeededTransform(Indexed(), lambda x: x + torch.rand(4), seed=0)
    loader = DataLoader(ds, batch_size=8, num_workers=1, persistent_workers=True)
    for epoch in range(3):
        set_epoch(type("L", (), {"set_epoch": lambda s, e: None, "dataset": ds})(), epoch)
        ((from_worker, _),) = list(loader)
        expected = torch.stack([ds[i][0] for i in range(8)])  # computed here, in this process
        assert torch.equal(from_worker, expected), epoch


def test_more_local_processes_than_gpus_is_refused_before_any_cuda_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with pytest.raises(RecipeError, match="4 processes were started on this node but only 2 GPU"):
        common.process_group_kwargs()


def test_a_recipe_that_leaves_a_shared_hyperparameter_without_a_default_cannot_parse():
    """Each recipe states every shared training default in its HYPERPARAMETERS block: one missing is the
    recipe's mistake, caught before any command line is read."""
    parser = common.training_parser("t")
    parser.set_defaults(**{k: v for k, v in load_recipe("cifar").HYPERPARAMETERS.items() if k != "warmup_ratio"})
    with pytest.raises(TypeError, match="HYPERPARAMETERS has no default for warmup_ratio"):
        parser.parse_args([])


def test_windows_count_the_samples_they_trained_when_an_epoch_ends_mid_accumulation(tmp_path):
    """7 batches an epoch, accumulation 2: the 7th batch is a window of its own, so 2 epochs are 8
    steps but 14 batches, not 8 x 2; the position, the schedule's clock and the rates count samples."""
    parser = common.training_parser("t")
    parser.set_defaults(**load_recipe("cifar").HYPERPARAMETERS)
    args = parser.parse_args(
        [
            "--output_dir",
            str(tmp_path),
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "2",
            "--num_train_epochs",
            "2",
            "--logging_steps",
            "1",
        ],
    )
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = torch.nn.Linear(4, 1)
    data = [torch.ones(4)] * 15  # 7 batches of 2, one sample left over
    train_dl = common.make_dataloader(data, 2, train=True, seed=0, num_workers=0)
    plan, progress = common.plan_run(args, len(data), accelerator.num_processes)
    assert (plan.steps_per_epoch, plan.max_train_steps, plan.total_samples) == (4, 8, 28)
    optimizer = torch.optim.SGD(model.parameters(), lr=plan.learning_rate)
    scheduler = make_scheduler(optimizer, "constant", plan, progress)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    log = common.TrainLog(accelerator, plan, progress, args.logging_steps)
    windows = []
    for epoch in range(plan.num_epochs):
        for window in common.accumulation_windows(train_dl, 2, epoch, progress):
            for i, x in enumerate(window):
                with common.micro_batch(accelerator, model, last=i == len(window) - 1):
                    loss = model(x).pow(2).mean()
                    accelerator.backward(loss)
                log.add(loss * len(x), len(x))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            windows.append(len(window))
            log.step(progress, window, scheduler.get_last_lr()[0])
    summary = log.summary(progress)
    assert windows == [2, 2, 2, 1] * 2 and summary["steps"] == 8
    assert progress.samples_seen == summary["samples_seen"] == 28 and progress.samples_in_epoch == 14
    assert summary["samples_per_second"] * log.train_seconds == pytest.approx(28)
    assert summary["steady_samples_per_second"] > 0 and summary["epochs"] == 2


@pytest.mark.parametrize("first, then", [((2, 8), (1, 16)), ((1, 16), (2, 8)), ((2, 8), (3, 5)), ((4, 3), (1, 7))])
def test_a_run_resumed_in_another_layout_trains_each_sample_once_per_epoch(first, then):
    """The job's samples, in the order Accelerate deals batches to processes (one batch per process a
    round, explicit ranks here), for a run stopped after some rounds in one layout (processes, batch)
    and resumed in another: together they are the epoch's order, each sample once, less a tail too
    short for a round of the second layout."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from common.data import EpochSampler

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
