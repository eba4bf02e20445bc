"""Tensor parallelism through accelerate_configs/tp.yaml: real launches over gloo, the way users launch on a host
without GPUs (`./launch.sh lm_finetune --config tp`, which runs `accelerate launch --config_file
accelerate_configs/tp.yaml`), in 2 processes (pure TP) and in 4 (the 2-D case: FSDP2 across 2 TP groups of 2), against
the one-process run of the same batch; the refusals in-process, as a launch under tp.yaml meets them."""

import importlib.metadata
import importlib.util
import json
import re
import signal
from types import SimpleNamespace

import pytest
import yaml
from conftest import (
    LM_INTERRUPTED_ARGS,
    REPO,
    card,
    chat_args,
    cpu_env,
    eval_loss,
    interrupt,
    lm_args,
    preempted_at,
    results,
    run,
    samples,
    update_distance,
)

from common import mesh
from common.runtime import RecipeError

LAUNCH = REPO / "launch.sh"


def trained_what_one_process_trains(out, res, tiny_lm, chat_reference):
    """The run in `out` (its results `res`) against one process at the data-parallel batch: the weights to 2e-5 of
    the update, every held-out token counted once (not once per process of a TP group), the same eval loss, a save
    from_pretrained loads in one process with the eval loss the run reported, and the same greedy samples."""
    reference = results(chat_reference)
    assert update_distance(out, chat_reference, tiny_lm["model"]) < 2e-5
    assert res["eval_tokens"] == reference["eval_tokens"]
    assert res["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    assert eval_loss(out, tiny_lm, chat=True) == pytest.approx(res["eval_loss"], rel=1e-6)
    assert samples(out) == samples(chat_reference)


@pytest.mark.slow
def test_tp_in_two_processes_trains_what_one_process_trains_and_saves_a_loadable_model(
    tiny_lm, chat_reference, tmp_path, monkeypatch
):
    """A degree the model's heads do not divide: one line, and its fix followed. Then both processes hold half of each
    split layer and see the same batch of 4 (a TP group is one data-parallel rank): every step's loss is the one
    process's, and so are the weights, the eval loss over the same tokens and the greedy samples; the save is whole
    (gathered from the split weights), from_pretrained loads it in one process and it gives the eval loss the run
    reported. Measured: losses equal to 2.4e-7, weights 6.9e-6 apart relative to the update (AdamW divides by the
    root of tiny second moments, which magnifies the split sums' rounding)."""
    out, config = tmp_path / "tp", tmp_path / "my_tp.yaml"
    # A copy of tp.yaml at degree 4, which the tiny model's 2 key-value heads cannot split: refused before the model
    # loads, in one line (load_kwargs, which load_causal_lm asks first: in this process, as the launch under it meets
    # it), and its fix followed literally (the degree and the processes it names) is the run compared below.
    from transformers import AutoConfig

    from common.tensor_parallel import load_kwargs

    with monkeypatch.context() as env:
        under_tp(env, 4)
        with pytest.raises(RecipeError) as refused:
            load_kwargs(AutoConfig.from_pretrained(tiny_lm["model"]), tiny_lm["model"])
    assert str(refused.value).startswith("--model_name_or_path ") and "\n" not in str(refused.value)  # names it
    fix = re.search(r"set (parallelism_config_tp_size) and (--num_processes) to (\d+)", str(refused.value))
    text = (REPO / "accelerate_configs" / "tp.yaml").read_text()
    config.write_text(text.replace("parallelism_config_tp_size: 2", f"{fix[1]}: {fix[3]}"))
    cmd = [REPO / "launch.sh", "lm_finetune", "--config", config, *chat_args(tiny_lm, out, 4)]
    run([*cmd[:4], fix[2], fix[3], *cmd[4:]], env=cpu_env())
    res, reference = results(out), results(chat_reference)
    assert "./launch.sh lm_finetune --config tp --num_processes 2 " in card(out)[1]  # how to run it again
    assert res["world_size"] == 2 and res["effective_batch_size"] == reference["effective_batch_size"] == 4
    losses = [row["train_loss"] for row in res["log_history"]]
    assert losses == pytest.approx([row["train_loss"] for row in reference["log_history"]], rel=1e-6)
    assert len(losses) == 6
    assert max(res["parameters_per_process"]) < 0.55 * res["parameters"]  # each layer split, not copied
    trained_what_one_process_trains(out, res, tiny_lm, chat_reference)


def stopped_in_turn(out, runs) -> list[int]:
    """Each (command, (layout, processes)) of `runs` started on `out` in turn and stopped by SIGTERM once it has
    passed its next checkpoint (every 3 steps): each exits 75 leaving a checkpoint of that layout. The steps they
    stopped at, the last still short of the run's 14."""
    stops = []
    for cmd, layout in runs:
        after = (stops[-1] // 3 + 1) * 3 if stops else 3  # the next checkpoint the run writes
        proc, _ = interrupt(cmd, cpu_env(), out, after_step=after, sig=signal.SIGTERM)
        assert proc.returncode == 75 and preempted_at(proc.stderr) is not None, proc.stderr[-3000:]
        stops.append(preempted_at(proc.stderr))
        state = json.loads((out / f"checkpoint-{stops[-1]}" / "trainer_state.json").read_text())
        assert (state["layout"], state["world_size"]) == layout
    assert stops[-1] < 14
    return stops


@pytest.mark.slow
def test_tp_within_pairs_and_fsdp2_across_them_trains_what_one_process_trains(tiny_lm, chat_reference, tmp_path):
    """The 2-D case, 4 processes: tp.yaml's mesh (tp 2 alone) launched by accelerate launch in 4 processes is refused
    in one line naming the option that fits, nothing written; ./launch.sh sizes it to 2 x 2 (dp_shard x tp), says so,
    and passes the sizes on. Each pair splits every layer and sees one batch of 2; FSDP2 shards the split model across
    the pairs, so a process holds about a quarter of the weights, and a step trains what one process trains on the
    batch of 4: every loss, the weights, the eval loss over every held-out token once, the greedy samples. The save is
    whole, and from_pretrained in one process gives the eval loss the run reported. Measured: losses 1.3e-7 apart
    (relative), weights 6.9e-6 apart relative to the update (AdamW magnifies the split sums' rounding, as in 1-D)."""
    out = tmp_path / "twod"
    args = chat_args(tiny_lm, out, 2)  # 2 pairs x 2: the reference's batch of 4
    # What a recipe started by `accelerate launch --config_file tp.yaml --num_processes 4` meets in make_accelerator,
    # before any group forms (every job shape: tests/test_hsdp.py): the line names the options that fit.
    line = mesh.mismatch(mesh.from_config(yaml.safe_load((REPO / "accelerate_configs" / "tp.yaml").read_text())), 4)
    named = re.findall(r"(--parallelism_config_\w+_size) (\d+)", line)
    assert "\n" not in line and ("--parallelism_config_dp_shard_size", "2") in named, line
    proc = run([LAUNCH, "lm_finetune", "--config", "tp", "--num_processes", "4", *args], env=cpu_env())
    assert "launch.sh: tp.yaml: a mesh of 2 x 2 (dp_shard x tp) over 1 node(s) x 4 process(es)" in proc.stderr
    (command,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("+ ")]
    assert all(f"{option} {size} " in command for option, size in named), command  # the fix it names, passed on
    res, reference = results(out), results(chat_reference)
    assert res["world_size"] == 4 and res["effective_batch_size"] == reference["effective_batch_size"] == 4
    assert res["launch"]["command"].startswith("./launch.sh lm_finetune --config tp --num_processes 4 ")
    assert res["launch"]["strategy"] == (
        "tensor parallelism, each layer split over 2 processes, sharded with FSDP2 across 2 such groups "
        "(mesh 2 x 2 (dp_shard x tp))"
    )
    losses = [row["train_loss"] for row in res["log_history"]]
    assert losses == pytest.approx([row["train_loss"] for row in reference["log_history"]], rel=1e-6)
    assert len(losses) == 6
    assert max(res["parameters_per_process"]) < 0.27 * res["parameters"]  # split in pairs, sharded across them
    trained_what_one_process_trains(out, res, tiny_lm, chat_reference)


@pytest.mark.slow
def test_the_zero_recipe_under_tp_in_2d_trains_what_one_process_trains(tiny_lm, chat_reference, tmp_path):
    """recipes/zero.py (pretraining, ZeRO by default) under the 2-D mesh, through the same common/ code as
    lm_finetune: ./launch.sh zero --config tp --num_processes 4, each pair splitting every layer and seeing one batch
    of 2, FSDP2 across the pairs. A step trains what one process trains at batch 4 (zero.py in one process writes the
    very bytes lm_finetune's chat_reference writes: measured), every held-out token is counted once, DeepSpeed's
    memory estimate counts the whole model (not a process's quarter), and the gathered save loads in one process with
    the eval loss the run reported. Measured: losses 1.3e-7 apart (relative), weights 6.9e-6 apart relative to the
    update, as lm_finetune's."""
    out = tmp_path / "zero"
    run([LAUNCH, "zero", "--config", "tp", "--num_processes", "4", *chat_args(tiny_lm, out, 2)], env=cpu_env())
    res, reference = results(out), results(chat_reference)
    assert res["world_size"] == 4 and res["effective_batch_size"] == reference["effective_batch_size"] == 4
    assert res["launch"]["command"].startswith("./launch.sh zero --config tp --num_processes 4 ")
    assert res["launch"]["strategy"].endswith("sharded with FSDP2 across 2 such groups (mesh 2 x 2 (dp_shard x tp))")
    losses = [row["train_loss"] for row in res["log_history"]]
    assert losses == pytest.approx([row["train_loss"] for row in reference["log_history"]], rel=1e-6)
    assert len(losses) == 6
    assert max(res["parameters_per_process"]) < 0.27 * res["parameters"]
    assert res["parameters"] == reference["parameters"]
    if importlib.util.find_spec("deepspeed"):  # else zero.py logs that it has no estimate (tests/test_zero.py)
        assert res["memory_estimate"]["parameters"] == res["parameters"]  # the whole model's, not a quarter's
    trained_what_one_process_trains(out, res, tiny_lm, chat_reference)


@pytest.mark.slow
def test_tp_stopped_on_2d_resumes_on_1x2_in_one_process_and_back_on_2d_to_the_uninterrupted_weights(
    tiny_lm, lm_uninterrupted, tmp_path
):
    """SIGTERM to the 4 processes of a 2 x 2 run through launch.sh: one checkpoint in torch's distributed checkpoint
    (a file a process: its quarter of each weight and of Adam's moments), exit 75. Resumed on 1 x 2 (pure TP, the
    per-device batch doubled) and stopped again (each process's halves of the model and optimizer, the RNG states as
    every layout writes them), resumed in one process (--config cpu, batch 16 x 2 accumulation: the halves made
    whole) and stopped again, then resumed on the 2-D mesh from that one-process checkpoint (its whole tensors cut
    into quarters as they load), it ends with the weights of the 2-process DDP run that was never stopped (the
    effective batch 32 throughout: DDP's 2 x 8 x 2, one process's or a TP pair's 16 x 2, 2 pairs' 8 x 2). (A TP
    checkpoint resumed under TP: ./launch.sh selftest --config tp's exact resume, tests/test_selftest.py.)"""
    out, resume = tmp_path / "run", ["--resume_from_checkpoint", "latest"]
    args = lambda batch: [  # noqa: E731
        *lm_args(tiny_lm, out, *LM_INTERRUPTED_ARGS), "--per_device_train_batch_size", str(batch),
        "--checkpointing_steps", "3",
    ]  # fmt: skip
    twod = [LAUNCH, "lm_finetune", "--config", "tp", "--num_processes", "4", *args(8)]
    pair = [LAUNCH, "lm_finetune", "--config", "tp", *args(16), *resume]
    one = [LAUNCH, "lm_finetune", "--config", "cpu", "--num_processes", "1", *args(16), *resume]
    stops = stopped_in_turn(out, [(twod, ("TP", 4)), (pair, ("TP", 2)), (one, ("DDP", 1))])
    state = json.loads((out / f"checkpoint-{stops[0]}" / "trainer_state.json").read_text())
    assert {f"model_and_optimizer/__{rank}_0.distcp" for rank in range(4)} <= set(state["files"])
    state = json.loads((out / f"checkpoint-{stops[1]}" / "trainer_state.json").read_text())
    assert {"random_states_0.pkl", "random_states_1.pkl", "model_and_optimizer/.metadata"} <= set(state["files"])
    assert {"model_and_optimizer/__0_0.distcp", "model_and_optimizer/__1_0.distcp"} <= set(state["files"])
    assert not {"model.safetensors", "optimizer.bin"} & set(state["files"])
    run([*twod, *resume], env=cpu_env())
    assert results(out)["steps"] == results(lm_uninterrupted)["steps"]
    assert update_distance(out, lm_uninterrupted, tiny_lm["model"]) < 1e-5


def under_tp(monkeypatch, degree):
    """The variables accelerate launch sets from tp.yaml's parallelism_config."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", str(degree))


@pytest.mark.parametrize(
    "degree, named",
    [(3, "its 4 attention heads (num_attention_heads) do not divide into tensor-parallel degree 3; set "
          "parallelism_config_tp_size and --num_processes to 2"),
     (4, "its 2 key value heads (num_key_value_heads) do not divide into tensor-parallel degree 4; set "
         "parallelism_config_tp_size and --num_processes to 2")],
)  # fmt: skip
def test_a_degree_that_does_not_divide_the_heads_is_refused_before_the_model_loads(
    tiny_lm, monkeypatch, degree, named
):
    """The tiny Llama has 4 attention heads and 2 key-value heads: 3 splits neither, 4 the first only. The line
    names the model, the count and the degrees that fit (load_causal_lm asks before from_pretrained)."""
    from transformers import AutoConfig

    from common.runtime import RecipeError
    from common.tensor_parallel import load_kwargs

    under_tp(monkeypatch, degree)
    with pytest.raises(RecipeError) as refused:
        load_kwargs(AutoConfig.from_pretrained(tiny_lm["model"]), tiny_lm["model"])
    assert str(refused.value) == f"--model_name_or_path {tiny_lm['model']}: {named}, or use fsdp.yaml"


def test_a_model_without_a_tp_plan_is_refused(monkeypatch):
    from transformers import GPT2Config

    from common.runtime import RecipeError
    from common.tensor_parallel import load_kwargs

    assert load_kwargs(GPT2Config(), "gpt2") == {}  # without tp.yaml nothing changes
    under_tp(monkeypatch, 2)
    with pytest.raises(RecipeError, match=r"^--model_name_or_path gpt2: GPT2Config has no tensor-parallel plan "):
        load_kwargs(GPT2Config(), "gpt2")


def test_what_tp_cannot_do_here_is_refused_in_one_line(monkeypatch):
    """A mesh with replicas or context parallelism besides TP, an FSDP config (Accelerate's own 2-D path fails), a
    new model from a config (nothing to split as it loads), a LoRA adapter (peft's layers fail on the split shapes), a
    degree that is no number: refused by common.preflight before the group forms, naming the config's key or the
    option. The 2-D mesh dp_shard x tp and checkpoints are not refused."""
    from common import mesh, preflight, tensor_parallel

    plain = SimpleNamespace(checkpointing_steps=3, resume_from_checkpoint="latest", model_name_or_path="m")
    # versions no rule refuses (the floor's are refused first: tests/test_hsdp.py, test_launcher.py)
    versions = {"torch": "2.9.0", "accelerate": "%d.%d" % mesh.TESTED_ACCELERATE}
    job = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "LOCAL_WORLD_SIZE": "2"}
    tp = {**job, "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    assert preflight.refusals(job, 0, versions, plain) == []  # no TP: nothing to refuse
    assert preflight.refusals(tp, 0, versions, plain) == []
    under_tp(monkeypatch, 2)
    assert tensor_parallel.data_parallel_size(SimpleNamespace(num_processes=2)) == 1
    two_d = {**tp, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}
    assert preflight.refusals(two_d, 0, versions, plain) == []  # 2 x 2: trains (test_tp_within_pairs_...)
    but = lambda **change: SimpleNamespace(**{**vars(plain), **change})  # noqa: E731
    cases = [
        ({**two_d, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"}, plain,
         "parallelism_config_dp_replicate_size", r"mesh is 2 x 2 x 2 \(dp_replicate x dp_shard x tp\)"),
        ({**tp, "ACCELERATE_USE_FSDP": "true"}, plain, "parallelism_config_tp_size",
         "^an FSDP accelerate config with parallelism_config_tp_size: "),
        (tp, but(model_name_or_path=None, config_name="c"), "--config_name", "--config_name under tensor parallelism"),
        (tp, but(lora_r=16), "--lora_r", "--lora_r under tensor parallelism"),
        ({**tp, "PARALLELISM_CONFIG_CP_SIZE": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, plain,
         "parallelism_config_cp_size", "parallelism_config_cp_size is 2"),  # for any mesh, TP's too
        ({**tp, "PARALLELISM_CONFIG_TP_SIZE": "two"}, plain, "parallelism_config_tp_size",
         "parallelism_config_tp_size is 'two': its sizes must be whole numbers"),
    ]  # fmt: skip
    for environ, args, subject, named in cases:
        (refusal,) = preflight.refusals(environ, 0, versions, args)
        assert re.search(named, str(refusal)) and refusal.subject == subject and "\n" not in str(refusal), refusal
    assert "parallelism_config_cp_size is 2" in mesh.not_built({**mesh.from_environment(), "cp": 2})
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(RecipeError, match="parallelism_config_tp_size is 'two': its sizes must be whole numbers"):
        tensor_parallel.degree()


def test_a_checkpoint_of_sharded_files_is_named_under_tp_and_a_whole_one_is_not(monkeypatch, tmp_path):
    """Under TP a checkpoint is recorded as layout TP; one of DDP's whole files or TP's split ones loads in either,
    and FSDP's or ZeRO's shards are refused in one line naming both layouts, before anything loads."""
    import torch

    from common import checkpoint, tensor_parallel
    from common.runtime import RecipeError

    model = torch.nn.Linear(2, 2)
    accelerator = SimpleNamespace(
        distributed_type=SimpleNamespace(value="MULTI_CPU"), state=SimpleNamespace(deepspeed_plugin=None)
    )
    assert checkpoint._layout(accelerator) == "DDP"
    under_tp(monkeypatch, 2)
    assert checkpoint._layout(accelerator) == tensor_parallel.LAYOUT == "TP"
    assert tensor_parallel.loads("DDP", "TP") and tensor_parallel.loads("TP", "DDP")
    for layout in ("FSDP", "DEEPSPEED ZeRO-3"):
        assert not tensor_parallel.loads(layout, "TP") and not tensor_parallel.loads("TP", layout)
        path = tmp_path / "checkpoint-3"
        path.mkdir(exist_ok=True)
        state = {"step": 3, "layout": layout, "args": {}, **checkpoint.model_signature(model)}
        (path / "trainer_state.json").write_text(json.dumps(state))
        args = SimpleNamespace(output_dir=str(tmp_path))
        with pytest.raises(RecipeError) as refused:
            checkpoint.load_checkpoint(accelerator, path, model, None, args)
        assert str(refused.value).startswith(f"checkpoint {path} was written under {layout}, this run is TP, ")
        assert "\n" not in str(refused.value)
