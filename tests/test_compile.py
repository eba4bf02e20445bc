"""torch.compile on CPU (inductor, gcc): the recipe's --torch_compile and accelerate launch's --dynamo_backend both
train what the eager model trains and save weights that load with their plain names. Slow: compiling takes tens of
seconds (a ResNet-18 about a minute, cold)."""

import pytest
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    FAST_MODEL,
    REPO,
    digits_args,
    eval_loss,
    lm_args,
    results,
    run,
    samples,
    user_env,
)
from safetensors.torch import load_file

LM = REPO / "recipes" / "lm_finetune.py"
pytestmark = pytest.mark.slow
SHORT = ("--max_train_steps", "6", "--logging_steps", "1")


def losses(out):
    return [h["train_loss"] for h in results(out)["log_history"]]


def test_a_compiled_lm_trains_as_the_eager_one_and_saves_loadable_weights_either_way(tiny_lm, tmp_path):
    """--torch_compile (in place: the state dict keeps its names) and accelerate's --dynamo_backend inductor (which
    wraps the model: names start with _orig_mod., which the save strips), in 2 processes x 8 each: the losses and
    eval loss of the eager model trained on the same 16 samples a step in one process (its python, forked warm: 2 x 8
    and 1 x 16 follow one loss curve, tests/test_lm_finetune.py), and a model.safetensors that from_pretrained loads
    and that gives the reported loss. The samples at each evaluation are generated eagerly (common.samples: a model
    compiled for training's shapes would compile again for each length generation feeds it), the eager run's own."""
    env = user_env(ACCELERATE_USE_CPU="true")
    base = [
        ACCELERATE_LAUNCH,
        "--config_file",
        REPO / "accelerate_configs/cpu.yaml",
        "--num_processes",
        "2",
    ]
    eager, flag, dynamo = tmp_path / "eager", tmp_path / "flag", tmp_path / "dynamo"
    run([BIN / "python", LM, *lm_args(tiny_lm, eager, *SHORT, "--per_device_train_batch_size", "16")])
    for out, launch_extra, recipe_extra in (
        (flag, [], ["--torch_compile"]),
        (dynamo, ["--dynamo_backend", "inductor"], []),
    ):
        cmd = [*base, *launch_extra, "--main_process_port", env["MASTER_PORT"], LM]
        run([*cmd, *lm_args(tiny_lm, out, *SHORT, *recipe_extra)], env=env, timeout=600)
    assert results(eager)["effective_batch_size"] == results(flag)["effective_batch_size"] == 16
    assert results(flag)["world_size"] == results(dynamo)["world_size"] == 2
    for out in (flag, dynamo):
        assert losses(out) == pytest.approx(losses(eager), rel=1e-5)
        assert results(out)["eval_loss"] == pytest.approx(results(eager)["eval_loss"], rel=1e-5)
        assert not any("_orig_mod" in name for name in load_file(out / "model.safetensors")), out
        assert eval_loss(out, tiny_lm) == pytest.approx(results(out)["eval_loss"], rel=1e-4)
        assert samples(out) == samples(eager) != []  # generated eagerly from the same weights: the same greedy tokens


def test_a_compiled_resnet_trains_as_the_eager_one_and_its_weights_load(digits, tmp_path):
    """cifar.py --torch_compile on the digits: the eager run's losses to a tolerance (inductor fuses BatchNorm and
    convolutions in another order), and the saved weights are the model's own names."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--torch_compile"])):
        out = tmp_path / name
        args = digits_args(digits, out, *FAST_MODEL, *SHORT, "--hflip", "0", "--dataloader_num_workers", "0", *extra)
        run([BIN / "python", REPO / "recipes" / "cifar.py", *args], timeout=600)
        runs[name] = out
    compiled, eager = losses(runs["compiled"]), losses(runs["eager"])
    assert compiled[0] == pytest.approx(eager[0], rel=1e-3)  # the same model on the same first batch
    assert compiled == pytest.approx(eager, rel=0.1)  # then float sums in another order, amplified by training
    assert set(load_file(runs["compiled"] / "model.safetensors")) == set(
        load_file(runs["eager"] / "model.safetensors")
    )
