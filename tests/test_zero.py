"""DeepSpeed ZeRO-2/3 on CPU: 2 processes, DeepSpeed's CPU accelerator and gloo (DESIGN.md)."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import BIN, REPO, accelerate_cpu, error_lines, lm_args, results, run, user_env
from test_lm_finetune import eval_loss

pytest.importorskip("deepspeed")
RECIPE = REPO / "recipes" / "lm_finetune.py"
CURVE = ["--max_train_steps", "8", "--logging_steps", "1"]


def deepspeed(config, nproc, *args, check=True):
    """`accelerate launch --config_file accelerate_configs/<config>.yaml`, fp32 (CPUs lack fast bf16)."""
    env = user_env()
    config_file = config if str(config).endswith(".yaml") else REPO / f"accelerate_configs/{config}.yaml"
    return run([BIN / "accelerate", "launch", "--config_file", config_file, "--num_processes", nproc,
                "--mixed_precision", "no", "--main_process_port", env["MASTER_PORT"], RECIPE, *args], env=env, check=check)


@pytest.fixture(scope="module")
def ddp_curve(tiny_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    cmd, env = accelerate_cpu(2, RECIPE, *lm_args(tiny_lm, out, *CURVE))
    run(cmd, env=env)
    return results(out)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_follows_the_ddp_loss_curve_and_saves_a_loadable_model(tiny_lm, tmp_path, ddp_curve, stage):
    out = tmp_path / stage
    deepspeed(stage, 2, *lm_args(tiny_lm, out, *CURVE))
    res = results(out)
    assert res["world_size"] == 2 and res["distributed_type"] == "DEEPSPEED"
    ddp = [h["train_loss"] for h in ddp_curve["log_history"]]
    zero = [h["train_loss"] for h in res["log_history"]]
    assert len(zero) == len(ddp) == 8
    assert zero == pytest.approx(ddp, rel=1e-4), "ZeRO must train the same model as DDP, only sharded"

    total = res["parameters"]
    assert ddp_curve["parameters_per_process"] == [total, total]
    held = res["parameters_per_process"]
    if stage == "zero3":  # each rank holds its half (plus alignment padding), not a full copy
        assert sum(held) >= total and all(0.45 * total < h < 0.55 * total for h in held), held
    else:
        assert held == [total, total]  # ZeRO-2 shards gradients and optimizer state, not weights

    # The consolidated save is a normal transformers folder and gives the loss the run reported.
    assert eval_loss(out, tiny_lm) == pytest.approx(res["eval_loss"], rel=1e-4)


def test_zero3_resume_mid_run_matches_the_uninterrupted_run(tiny_lm, tmp_path):
    args = ["--gradient_accumulation_steps", "2", "--max_train_steps", "8", "--logging_steps", "1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    deepspeed("zero3", 2, *lm_args(tiny_lm, straight, *args, "--checkpointing_steps", "3"))
    checkpoint = straight / "checkpoint-3"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["world_size"] == 2
    resumed.mkdir()
    shutil.copytree(checkpoint, resumed / checkpoint.name)
    deepspeed("zero3", 2, *lm_args(tiny_lm, resumed, *args, "--resume_from_checkpoint", "latest"))
    a, b = results(straight), results(resumed)
    assert a["effective_batch_size"] == b["effective_batch_size"] == 32  # 2 processes x 8 x 2 accumulated
    assert [h["train_loss"] for h in b["log_history"]] == pytest.approx([h["train_loss"] for h in a["log_history"][3:]], rel=1e-5)
    wa = AutoModelForCausalLM.from_pretrained(straight).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(resumed).state_dict()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)

    # Partitioned state cannot be replayed by another number of processes: say so, change nothing.
    before = sorted(p.name for p in resumed.iterdir())
    proc = deepspeed("zero3", 1, *lm_args(tiny_lm, resumed, *args, "--resume_from_checkpoint", str(checkpoint)), check=False)
    assert proc.returncode != 0
    (line,) = error_lines(proc.stderr)
    assert "written with world_size=2 but this run has 1" in line
    assert sorted(p.name for p in resumed.iterdir()) == before


def test_deepspeed_accumulation_that_contradicts_the_recipe_is_refused(tiny_lm, tmp_path):
    config = tmp_path / "zero2_gas4.yaml"
    config.write_text((REPO / "accelerate_configs/zero2.yaml").read_text().replace(
        "  zero_stage: 2\n", "  zero_stage: 2\n  gradient_accumulation_steps: 4\n"))
    proc = deepspeed(config, 2, *lm_args(tiny_lm, tmp_path / "run", "--max_train_steps", "2"), check=False)
    assert proc.returncode != 0
    (line,) = error_lines(proc.stderr)
    assert "gradient_accumulation_steps=4 but the recipe has 1" in line
