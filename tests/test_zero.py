"""DeepSpeed ZeRO-2/3 on CPU: 2 processes, DeepSpeed's CPU accelerator and gloo (the Accelerator gets an explicit gloo
backend on hosts without GPUs; see common.runtime.make_accelerator)."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    REPO,
    chat_args,
    cpu_env,
    error_lines,
    eval_loss,
    free_port,
    lm_args,
    load_recipe,
    results,
    run,
    samples,
    snapshot,
    started_by_accelerate_launch,
    update_distance,
    user_env,
)
from transformers import AutoModelForCausalLM

from common.checkpoint import load_checkpoint
from common.errors import RecipeError

pytest.importorskip("deepspeed")
RECIPE = REPO / "recipes" / "lm_finetune.py"
CURVE = ["--max_train_steps", "8", "--logging_steps", "1"]


def deepspeed(config, nproc, *args, recipe=RECIPE, check=True, command=False):
    """`accelerate launch --config_file accelerate_configs/<config>.yaml` (or a YAML path, or a DeepSpeed
    JSON config), fp32 (CPUs lack fast bf16)."""
    env = user_env()
    if str(config).endswith(".json"):
        config_args = ["--use_deepspeed", "--deepspeed_config_file", config]
    else:
        config_args = [
            "--config_file",
            config if str(config).endswith(".yaml") else REPO / f"accelerate_configs/{config}.yaml",
        ]
    cmd = [
        ACCELERATE_LAUNCH,
        *config_args,
        "--num_processes",
        nproc,
        "--mixed_precision",
        "no",
        "--main_process_port",
        env["MASTER_PORT"],
        recipe,
        *args,
    ]
    return (cmd, env) if command else run(cmd, env=env, check=check)


@pytest.fixture(scope="module")
def zero2_run(tiny_lm, tmp_path_factory):
    """`./launch.sh lm_finetune --config zero2` as a laptop user would try it on a host without GPUs, on the chats at
    2 processes x batch 2, with a checkpoint every 2 steps: (its folder, the finished process). The ZeRO-2 case of
    the equivalence test and the mixed-precision resume read the same run (a save changes no weight)."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    launch = [REPO / "launch.sh", "lm_finetune", "--config", "zero2", *chat_args(tiny_lm, out, 2)]
    return out, run([*launch, "--checkpointing_steps", "2"], env=cpu_env())


@pytest.fixture(scope="module")
def zero3_run(tiny_lm, tmp_path_factory):
    """2 ZeRO-3 processes x batch 2 on the chats, fp32, with a checkpoint every 2 steps (45 steps an epoch: each is
    mid-epoch): its folder. The ZeRO-3 case of the equivalence test and the resume in one process read the same run
    (a save changes no weight)."""
    out = tmp_path_factory.mktemp("zero3") / "run"
    deepspeed("zero3", 2, *chat_args(tiny_lm, out, 2, "--checkpointing_steps", "2"))
    return out


@pytest.mark.slow
@pytest.mark.floor
@pytest.mark.parametrize("stage", ["zero2", "zero3", "zero3_offload"])
def test_zero_trains_the_model_one_process_trains_and_saves_it_loadable(
    tiny_lm, tmp_path, chat_reference, stage, request
):
    """2 processes x batch 2 under ZeRO make the same updates as 1 process x batch 4 (the step's loss
    weighted by target tokens, on chats whose blocks hold few or many), only sharded. zero3_offload
    also swaps AdamW for DeepSpeed's CPU Adam. Measured: within 7e-7 of the update. ZeRO-2 is launched
    as a laptop user would try it, `./launch.sh lm_finetune --config zero2` on a host without GPUs:
    DeepSpeed on CPU, 2 processes, fp32, as the others are launched by hand."""
    out = tmp_path / stage
    if stage == "zero2":
        out, proc = request.getfixturevalue("zero2_run")
        assert "launch.sh: no GPU visible: DeepSpeed runs on CPU, 2 process(es) on this node, fp32" in proc.stderr
        (command,) = [line for line in proc.stderr.splitlines() if line.startswith("+ ")]
        assert "accelerate_configs/zero2.yaml --mixed_precision no --num_processes 2 " in command
    elif stage == "zero3":
        out = request.getfixturevalue("zero3_run")
    else:
        deepspeed(stage, 2, *chat_args(tiny_lm, out, 2))
    res, reference = results(out), results(chat_reference)
    assert res["world_size"] == 2 and res["distributed_type"] == "DEEPSPEED" and res["effective_batch_size"] == 4
    assert res["mixed_precision"] == "no"
    assert update_distance(out, chat_reference, tiny_lm["model"]) < 1e-5
    zero = [h["train_loss"] for h in res["log_history"]]
    assert len(zero) == 6 and zero == pytest.approx([h["train_loss"] for h in reference["log_history"]], rel=1e-5)

    total = res["parameters"]
    held = res["parameters_per_process"]
    if stage.startswith("zero3"):  # each rank holds its half (plus alignment padding), not a full copy
        assert sum(held) >= total and all(0.45 * total < h < 0.55 * total for h in held), held
    else:
        assert held == [total, total]  # ZeRO-2 shards gradients and optimizer state, not weights

    # The consolidated save is a normal transformers folder and gives the loss the run reported.
    assert eval_loss(out, tiny_lm, chat=True) == pytest.approx(res["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_a_zero_checkpoint_resumes_in_another_mixed_precision(tiny_lm, tmp_path, zero2_run):
    """ZeRO names its optimizer files by their precision (bf16_zero_pp_rank_...): a checkpoint resumed with another
    --mixed_precision is converted as one of another process count, and the run goes on (it failed on a file
    that is not there, with a fix that could not work). The checkpoint: step 4 of the 6 of the ZeRO-2 run in fp32,
    continued in another folder; the stopped run's folder is an input, left as it was."""
    stopped, out = zero2_run[0], tmp_path / "run"
    before = snapshot(stopped)
    launch = [REPO / "launch.sh", "lm_finetune", "--config", "zero2", "--mixed_precision", "bf16"]
    resume = ["--resume_from_checkpoint", stopped / "checkpoint-4"]
    proc = run([*launch, *chat_args(tiny_lm, out, 2, *resume)], env=cpu_env())
    assert "checkpoint-4 was written by 2 processes in no, this run has 2 in bf16: converting" in proc.stderr
    res = results(out)
    assert (res["steps"], res["mixed_precision"], res["world_size"]) == (6, "bf16", 2)
    assert not list(out.glob(".universal-*"))
    assert snapshot(stopped) == before


@pytest.mark.slow
@pytest.mark.floor
def test_a_zero3_checkpoint_of_two_processes_resumes_in_one_and_matches_the_run_that_went_on(
    tiny_lm, tmp_path, zero3_run
):
    """ZeRO-3 partitions the weights and the optimizer state by process, and DeepSpeed refuses another
    count: the recipe converts the checkpoint with DeepSpeed's ds_to_universal and loads it with
    `load_universal`, which repartitions it. The 2-process ZeRO-3 run's checkpoint of step 4 (of 6, mid-epoch),
    continued in 1 process in another folder with the per-device batch doubled, continues the loss curve and ends
    with the weights of the run that went on; the 2-process run's folder is left as it was (the conversion goes into
    the new one's). (A 2-process ZeRO-3 run stopped by SIGTERM, resumed in one process: tests/test_fsdp.py's bf16
    test under zero3.)"""
    checkpoint = zero3_run / "checkpoint-4"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["world_size"] == 2
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(state["files"])
    # Continued in another folder: the first run's is an input, which nothing is written into, even for a while
    before, written = snapshot(zero3_run), zero3_run.stat().st_mtime_ns
    continued, resume = tmp_path / "continued", ["--resume_from_checkpoint", checkpoint]
    proc = deepspeed("zero3", 1, *chat_args(tiny_lm, continued, 4, *resume))
    assert (
        f"{checkpoint.name} was written by 2 processes in no, this run has 1 in no: converting its ZeRO" in proc.stderr
    )
    assert snapshot(zero3_run) == before and zero3_run.stat().st_mtime_ns == written
    assert not list(continued.glob(".universal-*"))
    a, b = results(zero3_run), results(continued)
    assert a["effective_batch_size"] == b["effective_batch_size"] == 4 and b["world_size"] == 1
    assert len(b["log_history"]) == 6 and [h["train_loss"] for h in b["log_history"]] == pytest.approx(
        [h["train_loss"] for h in a["log_history"]], rel=1e-5
    )  # the checkpoint's log, then the same curve
    assert update_distance(continued, zero3_run, tiny_lm["model"]) < 1e-5
    rows = samples(continued)  # its evaluation after the checkpoint; under ZeRO-3 every process generates
    assert rows and rows[-1]["step"] == 6 and rows == [r for r in samples(zero3_run) if r["step"] == 6]
    # The ZeRO checkpoint under DDP (a user's `python recipes/lm_finetune.py`): exit 2, one line naming it, nothing
    # written.
    ddp = tmp_path / "ddp"
    proc = run([BIN / "python", RECIPE, *chat_args(tiny_lm, ddp, 4, *resume)], check=False)
    (line,) = error_lines(proc.stderr)
    assert proc.returncode == 2 and str(checkpoint) in line and snapshot(ddp) == {}, proc.stderr[-3000:]
    # Under DDP and under ZeRO-2, whose files are not ZeRO-3's either: the layouts named (not DeepSpeed's
    # AssertionError), by load_checkpoint, which every layout's resume goes through, before anything loads.
    args = load_recipe("lm_finetune").parse_args([str(a) for a in chat_args(tiny_lm, ddp, 4, *resume)])
    model = AutoModelForCausalLM.from_pretrained(tiny_lm["model"])
    for kind, plugin, layout in (("MULTI_CPU", None, "DDP"), ("DEEPSPEED", SimpleNamespace(zero_stage=2), "ZeRO-2")):
        accelerator = SimpleNamespace(
            distributed_type=SimpleNamespace(value=kind), state=SimpleNamespace(deepspeed_plugin=plugin)
        )
        with pytest.raises(RecipeError) as refused:
            load_checkpoint(accelerator, checkpoint, model, None, args)
        assert refused.value.subject == str(checkpoint)
        assert refused.value.problem.endswith(
            f"was written under DEEPSPEED ZeRO-3, this run is {'DEEPSPEED ' * (kind == 'DEEPSPEED')}{layout}, and "
            "each keeps the model and optimizer state in files of its own layout"
        )
        assert "DEEPSPEED ZeRO-3" in refused.value.fix  # resume with a config of the checkpoint's kind


ZERO_RECIPE = REPO / "recipes" / "zero.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, config, message",
    [
        ("lm_finetune", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 3}}},
         "defines an optimizer or scheduler, and this recipe trains with its own AdamW and schedule; remove them"),
        ("zero", {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "torch_adam": True}}},
         'the DeepSpeed config sets optimizer.params.betas to "auto", which nothing here fills; set its value'),
    ],
)  # fmt: skip
def test_a_deepspeed_file_at_odds_with_the_recipe_is_one_line_before_training(tiny_lm, tmp_path, recipe, config,
                                                                              message, monkeypatch):  # fmt: skip
    """A value a user's DeepSpeed file sets is the recipe's flag's, or refused: "auto" where nothing fills it (said
    once DeepSpeed has read the file, in the engine's set-up); a scheduler lm_finetune would leave unused (said of the
    config DeepSpeed's plugin holds). zero.py's rate and warmup against the config's optimizer and scheduler: in this
    process below, by the function that owns the rule. The batch, accumulation and clipping
    (common.preflight.deepspeed_against_arguments) and ZeRO-3 without the 16-bit gather: every case in one process in
    tests/test_common.py, and launched, in 2 DeepSpeed processes through launch.sh, each refused in one line with
    nothing written and its fix followed, in tests/test_fixes.py."""
    ds = tmp_path / "ds.json"
    auto = dict.fromkeys(["train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"], "auto")
    ds.write_text(json.dumps({**auto, "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, **config}))
    out = tmp_path / "run"
    # The one process `accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 1` starts:
    # accelerate's own launcher, run in this process up to torchrun's start, gives its ACCELERATE_* settings; torchrun
    # adds a one-process world. Run as `python recipes/<recipe>.py` in that environment (conftest.run's warm fork).
    port = free_port()
    launched, _ = started_by_accelerate_launch(monkeypatch, port, "--use_deepspeed", "--deepspeed_config_file", ds,
                                               "--num_processes", "1", "--mixed_precision", "no")  # fmt: skip
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)}  # fmt: skip
    env = user_env(**{k: v for k, v in launched.items() if k.startswith("ACCELERATE_")}, **world)
    recipe_args = lm_args(tiny_lm, out, "--max_train_steps", "2")
    proc = run([BIN / "python", REPO / f"recipes/{recipe}.py", *recipe_args], env=env, check=False)
    assert proc.returncode != 0
    (line,) = error_lines(proc.stderr)
    assert message in line, line  # the explanation is the point: which part of the file, and why
    assert snapshot(out) == {}


def deepspeed_plugin_holding(config: dict):
    """An accelerator as zero.py's build_optimizer reads it: the DeepSpeed config its plugin holds."""
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))


@pytest.mark.parametrize(
    "config, key, value, fix",
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}, "optimizer's lr", "0.001",
         "--lr_scaling none --learning_rate 0.001"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3}}}, "scheduler's warmup_max_lr",
         "0.001", "--lr_scaling none --learning_rate 0.001"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}, "scheduler's warmup_num_steps",
         "100", "--warmup_steps 100"),
    ],
)  # fmt: skip
def test_zero_py_refuses_a_deepspeed_rate_or_warmup_other_than_its_plan(tiny_lm, tmp_path, config, key, value, fix):
    """zero.py's build_optimizer, which meets the DeepSpeed config before the engine is built: a rate or warmup the
    config sets other than the plan's (what results.json reports) is one line naming the config's key and value and
    the recipe's flag that would agree with it; "auto", or the same value, trains."""
    zero = load_recipe("zero")
    args = zero.parse_args([str(a) for a in ["--model_name_or_path", tiny_lm["model"], *zero_args(tiny_lm, tmp_path)]])
    plan = SimpleNamespace(learning_rate=3e-3, warmup_steps=0, max_train_steps=6, effective_batch_size=8)
    start = SimpleNamespace(step=0, seen=0)
    with pytest.raises(RecipeError) as refused:
        zero.build_optimizer(args, deepspeed_plugin_holding(json.loads(json.dumps(config))), torch.nn.Linear(2, 2),
                             plan, start)  # fmt: skip
    line = str(refused.value)
    assert "\n" not in line and f"{key}={value} but" in line and line.endswith(f"or pass {fix}"), line
    agreed = json.loads(json.dumps(config).replace(f'": {value}', '": "auto"'))  # filled in with the plan's
    zero.build_optimizer(args, deepspeed_plugin_holding(agreed), torch.nn.Linear(2, 2), plan, start)


def zero_recipe(config, nproc, *args, check=True):
    return deepspeed(config, nproc, *args, recipe=ZERO_RECIPE, check=check)


def zero_args(lm, output_dir, *extra):
    """lm_args less the pretrained model: zero.py takes --config_name or --model_name_or_path."""
    return lm_args(lm, output_dir, "--max_train_steps", "6", "--logging_steps", "1", *extra)[2:]


@pytest.mark.slow
@pytest.mark.floor
def test_zero3_builds_partitioned_from_a_config_estimates_memory_and_saves_16_and_32_bit(tiny_lm, tmp_path):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from transformers import AutoConfig

    out = tmp_path / "run"
    overrides = "num_hidden_layers=3,hidden_size=96,intermediate_size=192"
    zero_recipe(
        REPO / "accelerate_configs/zero3.yaml",
        2,
        "--config_name",
        tiny_lm["model"],
        "--config_overrides",
        overrides,
        "--save_fp32",
        *zero_args(tiny_lm, out),
    )
    res = results(out)
    assert res["world_size"] == 2 and res["distributed_type"] == "DEEPSPEED" and res["steps"] == 6

    # The estimate is DeepSpeed's, for the full (unpartitioned) model and 2 GPUs on 1 node.
    config = AutoConfig.from_pretrained(tiny_lm["model"])
    config.update_from_string(overrides)
    twin = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in twin.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in twin.modules())
    estimate = res["memory_estimate"]
    assert res["parameters"] == estimate["parameters"] == total and estimate["largest_layer_parameters"] == largest
    assert (estimate["num_gpus_per_node"], estimate["num_nodes"]) == (2, 1)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, 2, 1, cpu_offload=False)
    assert estimate["zero3"] == {"gpu_gb": gpu / 2**30, "cpu_gb": cpu / 2**30}
    cpu, gpu = estimate_zero2_model_states_mem_needs(total, 2, 1, cpu_offload=True)
    assert estimate["zero2_offload_optimizer"] == {"gpu_gb": gpu / 2**30, "cpu_gb": cpu / 2**30}
    assert all(0.45 * total < h < 0.55 * total for h in res["parameters_per_process"])
    assert len(res["peak_memory_gb_per_process"]) == 2

    gathered = AutoModelForCausalLM.from_pretrained(out)
    fp32 = AutoModelForCausalLM.from_pretrained(out / "fp32")
    assert gathered.config.num_hidden_layers == 3 and sum(p.numel() for p in gathered.parameters()) == total
    assert eval_loss(out, tiny_lm) == pytest.approx(res["eval_loss"], rel=1e-4)
    for (name, a), (_, b) in zip(gathered.state_dict().items(), fp32.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)  # trained in fp32 here, so both exports are the same weights


@pytest.mark.slow
def test_a_deepspeed_config_with_its_own_optimizer_and_scheduler_drives_training(tiny_lm, tmp_path):
    """The config's scheduler runs over the run's steps ("auto": the plan's 6, which Accelerate would have divided
    by the 2 processes, decaying to 0 halfway) at the plan's rate (warmup_max_lr left out: DeepSpeed's 0.001). Its
    steps are steps of one effective batch: a resume at another is refused, one at the same batch in another layout
    continues it exactly. torch_adam: DeepSpeed's own CPU Adam is a C++ op it builds on first use (a minute in CI);
    this test is about who drives training, not which kernel does the update."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {
                        "warmup_min_lr": 0,
                        "warmup_num_steps": 3,
                        "warmup_type": "linear",
                        "total_num_steps": "auto",
                    },  # fmt: skip
                },
            }
        )
    )
    out = tmp_path / "run"
    args = ["--model_name_or_path", tiny_lm["model"], *zero_args(tiny_lm, out), "--warmup_steps", "3"]
    args += ["--checkpointing_steps", "3"]
    zero_recipe(config, 2, *args)
    res = results(out)
    lrs = [h["lr"] for h in res["log_history"]]
    assert res["world_size"] == 2 and len(lrs) == 6
    assert res["parameters_per_process"] == [res["parameters"]] * 2  # ZeRO-2 replicates the weights
    schedule = WarmupDecayLR(torch.optim.SGD([torch.zeros(1)], lr=1), 6, 0, 3e-3, 3, warmup_type="linear")
    expected = [(schedule.step(), schedule.get_last_lr()[0])[1] for _ in range(6)]  # after each step, as logged
    assert lrs == pytest.approx(expected) and lrs[-2] > 0  # DeepSpeed's schedule, not the recipe's cosine
    assert res["eval_loss"] < 0.8 * eval_loss(tiny_lm["model"], tiny_lm)

    # Its steps are steps of one effective batch: zero.py's build_optimizer, before the engine is built, refuses the
    # checkpoint at another (1 x 8: half its batch of 2 x 8) in one line; a resume at the same continues it exactly.
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    position = SimpleNamespace(step=state["step"], seen=state["samples_seen"])
    assert (position.step, position.seen) == (3, 48)
    half = SimpleNamespace(learning_rate=3e-3, warmup_steps=3, max_train_steps=6, effective_batch_size=8)
    zero_py, plugin = load_recipe("zero"), deepspeed_plugin_holding(json.loads(config.read_text()))
    with pytest.raises(RecipeError) as refused:
        zero_py.build_optimizer(zero_py.parse_args([str(a) for a in args]), plugin, torch.nn.Linear(2, 2), half,
                                position)  # fmt: skip
    line = str(refused.value)
    assert (
        "\n" not in line and "checkpoint's 3 steps trained 48 samples, not 3 x this run's effective batch of 8" in line
    )
    resumed = tmp_path / "resumed"
    again = [*args, "--output_dir", resumed, "--resume_from_checkpoint", out / "checkpoint-3"]
    zero_recipe(config, 1, *again, "--gradient_accumulation_steps", "2")
    assert [h["lr"] for h in results(resumed)["log_history"]] == pytest.approx(lrs)
    assert update_distance(resumed, out, tiny_lm["model"]) < 1e-5


@pytest.mark.slow
def test_zero_recipe_bad_input(tiny_lm, tmp_path):
    """zero.py refuses an override the config lacks before any model is built, whatever the launch: a user's
    `python recipes/zero.py` (conftest.run's warm fork), one process."""
    args = ["--config_name", tiny_lm["model"], "--config_overrides", "num_hiden_layers=3"]
    proc = run([BIN / "python", ZERO_RECIPE, *args, *zero_args(tiny_lm, tmp_path / "run")], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert "num_hiden_layers" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_without_deepspeed_zero_trains_under_ddp_and_a_deepspeed_config_is_one_line(tiny_lm, tmp_path):
    """As if DeepSpeed were not installed (a sitecustomize hides it from every process): zero.py trains under
    --config cpu with one info line for its memory estimate (it could not even import: Accelerate has DummyOptim
    only with DeepSpeed), and a DeepSpeed config is refused by launch.sh in one line naming the install, before any
    process starts (accelerate launch's traceback ended it)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\n\nsys.modules['deepspeed'] = None  # as if not installed\n")
    env = user_env(PYTHONPATH=str(hide))
    out = tmp_path / "ddp"
    cmd = [REPO / "launch.sh", "zero", "--config", "cpu", "--num_processes", "1"]
    proc = run([*cmd, *lm_args(tiny_lm, out, "--max_train_steps", "2")], env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no memory estimate: DeepSpeed is not installed (pip install -e '.[deepspeed]' adds it)" in proc.stderr
    assert results(out)["steps"] == 2
    out = tmp_path / "zero2"
    proc = run([REPO / "launch.sh", "lm_finetune", "--config", "zero2", *lm_args(tiny_lm, out)], env=env, check=False)
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and lines == [
        "launch.sh: error: zero2.yaml runs DeepSpeed, which is not installed here: pip install -e '.[deepspeed]', or "
        "pass another --config (fsdp trains sharded without it)"
    ], proc.stderr
    assert not out.exists()
