"""FSDP2 on CPU, through fsdp.yaml, with the guarantees DDP and ZeRO have, and bf16 mixed precision on CPU: real
2-process launches over gloo, the way users launch (`accelerate launch --config_file accelerate_configs/fsdp.yaml`
with ACCELERATE_USE_CPU=true, and ./launch.sh --config fsdp)."""

import importlib.metadata
import inspect
import json
import shutil
import signal

import pytest
import torch
from conftest import (
    BIN,
    LM_INTERRUPTED_ARGS,
    REPO,
    chat_args,
    cpu_env,
    error_lines,
    eval_loss,
    interrupt,
    lm_args,
    preempted_at,
    results,
    run,
    samples,
    update_distance,
    user_env,
)
from packaging.version import Version
from safetensors.torch import load_file

LM = REPO / "recipes" / "lm_finetune.py"
LAUNCH = REPO / "launch.sh"


def test_accelerate_still_leaves_the_cpu_out_of_its_fsdp_branch():
    """common.runtime.fsdp_on_cpu presents a CPU group as MULTI_GPU because AcceleratorState takes the FSDP branch
    only for GPU-like distributed types. If Accelerate lists MULTI_CPU there, or renames what is presented, the
    workaround should go: this fails first."""
    from accelerate.state import AcceleratorState

    source = inspect.getsource(AcceleratorState.__init__)
    branch = source[: source.index("self.distributed_type = DistributedType.FSDP")]
    listed = branch[branch.rindex("elif self.distributed_type in [") :]
    assert "DistributedType.MULTI_GPU" in listed and "DistributedType.MULTI_CPU" not in listed


def fsdp(nproc, *args, mixed_precision="no", check=True):
    env = user_env(ACCELERATE_USE_CPU="true")
    cmd = [BIN / "accelerate", "launch", "--config_file", REPO / "accelerate_configs/fsdp.yaml"]
    cmd += ["--num_processes", nproc, "--mixed_precision", mixed_precision, "--main_process_port", env["MASTER_PORT"]]
    return run([*cmd, LM, *args], env=env, check=check)


# gloo's reduce-scatter sums where FSDP2 asks it to average before torch 2.9: refused (common.runtime)
TORCH = importlib.metadata.version("torch")
GLOO_SUMS_AVG = Version(TORCH).release < (2, 9)


@pytest.mark.slow
@pytest.mark.floor
def test_fsdp_on_cpu_shards_trains_one_big_batch_token_weighted_and_saves_a_loadable_model(
    tiny_lm, chat_reference, tmp_path
):
    """2 processes x batch 2 in chat mode, each block's target tokens from a few to most of it: the update of 1
    process x batch 4, every eval token counted once, half the parameters a process, and a gathered save that
    from_pretrained loads and that gives the eval loss the run reported. Every process takes part in each forward of
    the samples' generation (the weights are sharded): samples.jsonl holds the one process run's completions.
    With torch 2.8 (the floor stage's) ./launch.sh --config fsdp is refused in one line, exit 2: its FSDP2 trained
    on twice the mean gradient on CPU, 5.5e-4 of the update away under AdamW."""
    out = tmp_path / "fsdp"
    if GLOO_SUMS_AVG:
        proc = run(
            [LAUNCH, "lm_finetune", "--config", "fsdp", *chat_args(tiny_lm, out, 2)], env=cpu_env(), check=False
        )
        assert proc.returncode == 2 and not out.exists(), proc.stderr[-3000:]
        assert error_lines(proc.stderr) == [
            f"error: torch {TORCH} is installed, and with it FSDP2 on CPU trains on the sum "
            "of the processes' gradients, not their mean (gloo's reduce-scatter ignores ReduceOp.AVG before torch "
            "2.9); pip install 'torch>=2.9', or shard with DeepSpeed instead: ./launch.sh --config zero3"
        ]
        return
    fsdp(2, *chat_args(tiny_lm, out, 2))
    res, reference = results(out), results(chat_reference)
    assert res["distributed_type"] == "FSDP" and res["world_size"] == 2
    assert (
        sum(res["parameters_per_process"]) == res["parameters"]
        and max(res["parameters_per_process"]) < 0.6 * res["parameters"]
    )
    assert update_distance(out, chat_reference, tiny_lm["model"]) < 1e-5
    assert res["eval_tokens"] == reference["eval_tokens"]
    assert eval_loss(out, tiny_lm, chat=True) == pytest.approx(res["eval_loss"], rel=1e-4)
    rows = samples(out)
    assert rows == samples(chat_reference) and [r["step"] for r in rows] == [6] * 4
    assert all(r["prompt"].endswith("<|assistant|> ") for r in rows)  # the template's generation prompt


@pytest.mark.slow
def test_fsdp_stopped_mid_epoch_resumes_in_two_processes_and_in_one_to_the_uninterrupted_weights(tiny_lm, tmp_path):
    """SIGTERM to every process of a 2-process FSDP run through launch.sh: one sharded checkpoint, exit 75. Resumed in
    2 processes, and in 1 with the per-device batch doubled (the checkpoint resharded by torch's distributed
    checkpoint), it ends with the weights of the run that was never stopped."""
    args = lambda out, *extra: lm_args(tiny_lm, out, *LM_INTERRUPTED_ARGS, *extra)  # noqa: E731
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run([LAUNCH, "lm_finetune", "--config", "fsdp", *args(straight)], env=cpu_env())
    cmd = [LAUNCH, "lm_finetune", "--config", "fsdp", *args(stopped, "--checkpointing_steps", "3")]
    proc, _ = interrupt(cmd, cpu_env(), stopped, after_step=3, sig=signal.SIGTERM)
    assert proc.returncode == 75 and preempted_at(proc.stderr) is not None, proc.stderr[-3000:]
    step = preempted_at(proc.stderr)
    assert (
        json.loads((stopped / f"checkpoint-{step}" / "trainer_state.json").read_text())["distributed_type"] == "FSDP"
    )
    one = tmp_path / "one"
    shutil.copytree(stopped, one)
    run(
        [LAUNCH, "lm_finetune", "--config", "fsdp", *args(stopped, "--resume_from_checkpoint", "latest")],
        env=cpu_env(),
    )
    batch16 = ["--per_device_train_batch_size", "16", "--resume_from_checkpoint", "latest"]
    run([LAUNCH, "lm_finetune", "--config", "fsdp", "--num_processes", "1", *args(one, *batch16)], env=cpu_env())
    for out in (stopped, one):
        assert results(out)["steps"] == results(straight)["steps"]
        assert update_distance(out, straight, tiny_lm["model"]) < 1e-5, out


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu", "zero2", "zero3", "fsdp"])
def test_bf16_trains_on_cpu_and_resumes_on_another_process_count(tiny_lm, tmp_path, config):
    """--mixed_precision bf16 through launch.sh on CPU, under DDP, ZeRO-2/3 and FSDP2: the run records bf16 and
    learns; stopped by SIGTERM in 2 processes and resumed in 1 with the per-device batch doubled, it ends with the
    uninterrupted run's weights to bf16's precision."""
    args = lambda out, *extra: lm_args(tiny_lm, out, *LM_INTERRUPTED_ARGS, *extra)  # noqa: E731
    bf16 = [LAUNCH, "lm_finetune", "--config", config, "--mixed_precision", "bf16"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = run([*bf16, *args(straight)], env=cpu_env())
    res = results(straight)
    assert res["mixed_precision"] == "bf16" and "--mixed_precision bf16" in proc.stderr and res["world_size"] == 2
    losses = [h["train_loss"] for h in res["log_history"]]
    assert losses[-1] < 0.8 * losses[0] and res["eval_loss"] < losses[0]

    proc, _ = interrupt([*bf16, *args(stopped, "--checkpointing_steps", "3")], cpu_env(), stopped, after_step=3)
    assert proc.returncode == 75 and preempted_at(proc.stderr) is not None, proc.stderr[-3000:]
    one = ["--per_device_train_batch_size", "16", "--resume_from_checkpoint", "latest"]
    run([*bf16, "--num_processes", "1", *args(stopped, *one)], env=cpu_env())
    assert results(stopped)["steps"] == res["steps"] and results(stopped)["mixed_precision"] == "bf16"
    # measured: 2e-4 (DDP) to 1.6e-3 (ZeRO-3) of the update, bf16 rounding where the layouts differ
    assert update_distance(stopped, straight, tiny_lm["model"]) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero3", "fsdp"])
def test_a_lora_run_on_sharded_weights_saves_its_merged_model(tiny_lm, tmp_path, config):
    """LoRA under ZeRO-3 and FSDP2, 2 processes: each holds half the weights; the main process gathers them, merges
    the adapter on CPU, and merged/ loads without peft and gives the eval loss the run reported."""
    out = tmp_path / "run"
    run([LAUNCH, "lm_finetune", "--config", config, *lm_args(tiny_lm, out, "--lora_r", "8", "--max_train_steps", "4")],
        env=cpu_env())  # fmt: skip
    res = results(out)
    assert res["distributed_type"] == {"zero3": "DEEPSPEED", "fsdp": "FSDP"}[config] and res["world_size"] == 2
    assert max(res["parameters_per_process"]) < 0.6 * res["parameters"]
    assert not (out / "merged" / "adapter_config.json").exists() and (out / "adapter_config.json").is_file()
    assert eval_loss(out / "merged", tiny_lm) == pytest.approx(res["eval_loss"], rel=1e-5)
    weights, initial = (
        load_file(out / "merged" / "model.safetensors"),
        load_file(tiny_lm["model"] / "model.safetensors"),
    )
    assert weights.keys() == initial.keys()
    assert sum(not torch.equal(weights[k], initial[k]) for k in weights) == 14  # the 7 linear layers of 2 blocks


@pytest.mark.slow
def test_fsdp_trains_the_zero_recipe_too_and_the_image_recipe_is_refused_in_one_line(tiny_lm, digits, tmp_path):
    """./launch.sh zero --config fsdp on CPU: FSDP2, half the parameters a process, a save from_pretrained loads.
    The image recipe has no transformer layers to shard, nor is it right under ZeRO: one line, exit 2, nothing
    written."""
    out = tmp_path / "zero"
    run([LAUNCH, "zero", "--config", "fsdp", *lm_args(tiny_lm, out, "--max_train_steps", "4")], env=cpu_env())
    res = results(out)
    assert res["distributed_type"] == "FSDP" and max(res["parameters_per_process"]) < 0.6 * res["parameters"]
    assert eval_loss(out, tiny_lm) == pytest.approx(res["eval_loss"], rel=1e-4)
    assert [(r["step"], r["samples_seen"]) for r in samples(out)] == [(4, 64)] * 4  # the final evaluation's
    images = tmp_path / "cifar"
    data = ["--dataset", "imagefolder", "--train_dir", digits["train"], "--val_dir", digits["val"]]
    for config in ("fsdp", "zero2"):  # ZeRO: BatchNorm statistics per process, a bf16 model fed fp32 images
        cmd = [LAUNCH, "cifar", "--config", config, *data, "--output_dir", images]
        proc = run(cmd, env=cpu_env(), check=False)
        assert proc.returncode == 2 and not images.exists(), proc.stderr[-2000:]
        assert error_lines(proc.stderr) == [
            "error: this recipe trains under DDP (accelerate_configs/cpu.yaml, 1gpu..8gpu.yaml): FSDP shards a model "
            "by its transformer layers, which an image model does not have, and DeepSpeed ZeRO keeps BatchNorm's "
            "statistics apart on each process and casts the model alone to bf16"
        ]
