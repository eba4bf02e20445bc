"""HSDP on FSDP2 (accelerate's parallelism_config: dp_replicate x dp_shard), with the guarantees FSDP2 has: real
4-process launches over gloo on CPU, the way users launch (`accelerate launch --config_file
accelerate_configs/hsdp.yaml` with ACCELERATE_USE_CPU=true, and ./launch.sh --config hsdp). The mesh sizing that
launch.sh and the recipes share (common/mesh.py) is tested in-process over every job shape."""

import importlib.metadata
import itertools
import json
import math
import re
import signal
import sys
from types import SimpleNamespace

import pytest
import yaml
from conftest import (
    ACCELERATE_LAUNCH,
    LM_INTERRUPTED_ARGS,
    REPO,
    chat_args,
    cpu_env,
    eval_loss,
    interrupt,
    lm_args,
    load_recipe,
    preempted_at,
    results,
    run,
    samples,
    update_distance,
    user_env,
)
from transformers import AutoModelForCausalLM

from common import mesh, preflight
from common.checkpoint import load_checkpoint
from common.runtime import RecipeError

LM = REPO / "recipes" / "lm_finetune.py"
LAUNCH = REPO / "launch.sh"
HSDP = REPO / "accelerate_configs" / "hsdp.yaml"
MESHES = [  # the config's sizes: FSDP2 alone, HSDP, FSDP x TP and HSDP x TP
    {"dp_replicate": r, "dp_shard": s, "tp": t, "cp": 1} for r, s, t in itertools.product((1, 2, 4), (1, 4), (1, 2))
]


def applied(line: str, sizes: dict, processes: int) -> tuple[dict, int]:
    """The mesh and process count after following a refusal's fix literally (the options it names)."""
    sizes = dict(sizes)
    for option, value in re.findall(r"(--[a-z_]+) (\d+)", line.split(": pass ", 1)[1]):
        if option == "--num_processes":
            processes = int(value)
        else:
            (dim,) = [d for d in mesh.DIMENSIONS if mesh.LAUNCH_OPTION.format(d) == option]
            sizes[dim] = int(value)
    return sizes, processes


def test_the_mesh_launch_sh_picks_covers_every_job_and_every_refusal_names_a_job_that_fits():
    """For every config mesh, node count and processes a node: the mesh launch.sh passes on covers the job exactly,
    keeps tensor parallelism within a node, replicates once a node across nodes and shards HSDP over at least 2;
    where none fits, the processes it names fit. A recipe started by accelerate launch with a mesh that does not cover
    its processes is refused, and the options the line names, followed, cover them."""
    for sizes, nodes, per_node in itertools.product(MESHES, (1, 2, 3, 4), range(1, 10)):
        fit = mesh.fitted(sizes, nodes, per_node)
        if fit.problem is None:
            assert math.prod(fit.mesh.values()) == nodes * per_node and per_node % fit.mesh["tp"] == 0
            assert fit.mesh["tp"] == sizes["tp"] and fit.mesh["cp"] == sizes["cp"]
            if sizes["dp_replicate"] > 1:
                assert fit.mesh["dp_shard"] >= 2
                assert fit.mesh["dp_replicate"] == (nodes if nodes > 1 else sizes["dp_replicate"])
        else:
            assert fit.per_node != per_node and mesh.fitted(sizes, nodes, fit.per_node).problem is None, fit
    for sizes, processes in itertools.product(MESHES, range(1, 17)):
        line = mesh.mismatch(sizes, processes)
        if math.prod(sizes.values()) == processes:
            assert line is None
            continue
        assert "\n" not in line and "./launch.sh" in line
        fixed, count = applied(line, sizes, processes)
        assert mesh.mismatch(fixed, count) is None, line


def test_launch_sh_sizes_the_hsdp_mesh_to_the_job_and_refuses_a_count_that_does_not_split(tmp_path):
    """--dry_run prints the accelerate launch command: 2 x 2 on CPU by default, 2 x 3 with 6 processes, one copy a
    node across 2 nodes; 3 or 2 processes: one line, exit 2, naming the count that splits, which then launches."""
    env = cpu_env()

    def dry(*args, **extra):
        return run([LAUNCH, "lm_finetune", "--config", "hsdp", *args, "--dry_run"], env={**env, **extra}, check=False)

    def sizes(stderr):
        (command,) = [line for line in stderr.splitlines() if line.startswith("+ ")]
        return {d: int(re.search(rf"{mesh.LAUNCH_OPTION.format(d)} (\d+)", command).group(1)) for d in mesh.DIMENSIONS}

    installed, default = importlib.metadata.version("accelerate"), {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "cp": 1}
    torch_refused = preflight.known_bad_torch(4, importlib.metadata.version("torch"), fsdp_on_cpu=True)
    if refused := torch_refused or mesh.untested_accelerate(default, installed):  # the floor's: before anything starts
        proc = dry()
        said = str(torch_refused) if torch_refused else f"hsdp.yaml: {refused}"  # the torch first, as the processes
        assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == f"launch.sh: error: {said}"
        pytest.skip("launch.sh refuses HSDP with the versions installed (checked); sizing its mesh needs tested ones")
    assert sizes(dry().stderr) == {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "cp": 1}
    assert sizes(dry("--num_processes", "6").stderr) == {"dp_replicate": 2, "dp_shard": 3, "tp": 1, "cp": 1}
    two_nodes = dry("--num_processes", "3", NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1").stderr
    assert sizes(two_nodes) == {"dp_replicate": 2, "dp_shard": 3, "tp": 1, "cp": 1}
    assert "a mesh of 2 x 3 (dp_replicate x dp_shard) over 2 node(s) x 3 process(es)" in two_nodes
    for count in ("3", "2"):
        proc = dry("--num_processes", count)
        (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
        assert (
            proc.returncode == 2
            and line.startswith("launch.sh: error: hsdp.yaml: ")
            and line.endswith("pass --num_processes 4")
        ), proc.stderr
        followed = dry("--num_processes", line.rsplit(" ", 1)[1])  # the fix, followed
        assert followed.returncode == 0 and math.prod(sizes(followed.stderr).values()) == 4

    # A size in a config of the user's that is no number: one line naming it, not launch.sh's traceback
    bad = tmp_path / "bad.yaml"
    bad.write_text(HSDP.read_text().replace("dp_shard_size: 4", "dp_shard_size: x"))
    proc = run([LAUNCH, "lm_finetune", "--config", bad, "--dry_run"], env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"launch.sh: error: {bad}: parallelism_config: parallelism_config_dp_shard_size must be a whole number "
        "from 1, got 'x'"
    ], proc.stderr

    # Context parallelism, which no recipe's forward does (each cp process would train whole sequences again): one
    # line naming the size, before anything starts; followed (the size set to 1), the job launches
    cp = tmp_path / "cp.yaml"
    cp.write_text(HSDP.read_text().replace("cp_size: 1", "cp_size: 2"))
    proc = run([LAUNCH, "lm_finetune", "--config", cp, "--dry_run"], env=env, check=False)
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert proc.returncode == 2 and line.startswith(f"launch.sh: error: {cp.name}: "), proc.stderr
    assert "parallelism_config_cp_size is 2" in line and "set it to 1" in line
    cp.write_text(cp.read_text().replace("cp_size: 2", "cp_size: 1"))
    assert run([LAUNCH, "lm_finetune", "--config", cp, "--dry_run"], env=env, check=False).returncode == 0
    assert mesh.not_built(dict(MESHES[0], cp=2)) == line.split(f"{cp.name}: ", 1)[1]  # what make_accelerator says
    assert all(mesh.not_built(m) is None for m in MESHES)


def hsdp(nproc, *args, options=(), check=True):
    env = user_env(ACCELERATE_USE_CPU="true")
    cmd = [ACCELERATE_LAUNCH, "--config_file", HSDP, "--num_processes", nproc, "--mixed_precision", "no"]
    return run([*cmd, *options, "--main_process_port", env["MASTER_PORT"], LM, *args], env=env, check=check)


@pytest.mark.slow
def test_hsdp_2x2_trains_one_big_batch_token_weighted_and_saves_a_loadable_model(tiny_lm, chat_reference, tmp_path):
    """accelerate launch with hsdp.yaml's 2 x 4 mesh and 2 processes: one line naming the options that fit.
    Followed literally, 4 processes on a 2 x 2 mesh x batch 1 in chat mode train the
    update of one process x batch 4, each process holding half the parameters (its shard of a copy), every eval
    token counted once, a gathered save that from_pretrained loads with the eval loss the run reported, and the
    samples one process generates; the run's record launches it again with --config hsdp."""
    out = tmp_path / "hsdp"
    # What a recipe started by `accelerate launch --config_file hsdp.yaml --num_processes 2` meets in make_accelerator,
    # said by one process before any group forms (every job shape: the test above)
    line = mesh.mismatch(mesh.from_config(yaml.safe_load(HSDP.read_text())), 2)
    assert "\n" not in line and line.startswith("the accelerate config's parallelism_config is a mesh of 2 x 4 "), line
    fixed, count = applied(line, mesh.from_config(yaml.safe_load(HSDP.read_text())), 2)
    assert (count, fixed["dp_replicate"], fixed["dp_shard"]) == (4, 2, 2)
    hsdp(count, *chat_args(tiny_lm, out, 1), options=[str(w) for w in mesh.options(fixed)])
    res, reference = results(out), results(chat_reference)
    assert res["distributed_type"] == "FSDP" and res["world_size"] == 4
    assert res["launch"]["strategy"] == "HSDP on FSDP2, mesh 2 x 2 (dp_replicate x dp_shard)"
    assert res["launch"]["command"].startswith("./launch.sh lm_finetune --config hsdp --num_processes 4 ")
    held = res["parameters_per_process"]  # each copy's two shards hold the model once
    assert held[0] + held[1] == held[2] + held[3] == res["parameters"] and max(held) < 0.6 * res["parameters"]
    assert update_distance(out, chat_reference, tiny_lm["model"]) < 1e-5
    assert res["eval_tokens"] == reference["eval_tokens"]
    assert eval_loss(out, tiny_lm, chat=True) == pytest.approx(res["eval_loss"], rel=1e-4)
    assert samples(out) == samples(chat_reference)


@pytest.mark.slow
def test_hsdp_stopped_resumes_on_another_mesh_and_in_one_process_to_the_uninterrupted_weights(
    tiny_lm, lm_uninterrupted, tmp_path
):
    """SIGTERM to every process of a 2 x 2 HSDP run through launch.sh: one checkpoint, exit 75. Resumed on a 1 x 2
    mesh (--config fsdp, the per-device batch doubled) and stopped again, then resumed in one process (batch x4),
    it ends with the weights of the 2-process DDP run that was never stopped. Resumed under DDP, the checkpoint is
    named another strategy's in one line, before anything loads."""
    args = lambda out, *extra: lm_args(tiny_lm, out, *LM_INTERRUPTED_ARGS, *extra)  # noqa: E731
    out = tmp_path / "run"
    per_device = lambda n: ["--per_device_train_batch_size", str(n), "--checkpointing_steps", "3"]  # noqa: E731
    cmd = [LAUNCH, "lm_finetune", "--config", "hsdp", *args(out, *per_device(4))]
    proc, _ = interrupt(cmd, cpu_env(), out, after_step=3, sig=signal.SIGTERM)
    assert proc.returncode == 75 and preempted_at(proc.stderr) is not None, proc.stderr[-3000:]
    first = preempted_at(proc.stderr)
    assert first < 9  # a step of the first epoch's (the second stop lands on the next multiple of 3 before 14)
    state = json.loads((out / f"checkpoint-{first}" / "trainer_state.json").read_text())
    assert state["distributed_type"] == "FSDP" and state["world_size"] == 4

    # Under DDP, whose files are whole: refused by load_checkpoint, which every layout's resume goes through, naming
    # the checkpoint and its layout, before anything loads
    parsed = load_recipe("lm_finetune").parse_args([str(a) for a in args(out, *per_device(8))])
    model = AutoModelForCausalLM.from_pretrained(tiny_lm["model"])
    ddp = SimpleNamespace(
        distributed_type=SimpleNamespace(value="MULTI_CPU"), state=SimpleNamespace(deepspeed_plugin=None)
    )
    checkpoint = out / f"checkpoint-{first}"
    with pytest.raises(RecipeError) as refused:
        load_checkpoint(ddp, checkpoint, model, None, parsed)
    assert refused.value.subject == str(checkpoint) and "\n" not in str(refused.value)
    assert "written under FSDP, this run is DDP" in refused.value.problem and "(FSDP)" in refused.value.fix

    resume = ["--resume_from_checkpoint", "latest"]
    cmd = [LAUNCH, "lm_finetune", "--config", "fsdp", *args(out, *per_device(8), *resume)]
    proc, _ = interrupt(cmd, cpu_env(), out, after_step=(first // 3 + 1) * 3, sig=signal.SIGTERM)
    assert proc.returncode == 75 and preempted_at(proc.stderr) is not None, proc.stderr[-3000:]
    one = [LAUNCH, "lm_finetune", "--config", "fsdp", "--num_processes", "1", *args(out, *per_device(16), *resume)]
    run(one, env=cpu_env())
    assert results(out)["steps"] == results(lm_uninterrupted)["steps"]
    assert update_distance(out, lm_uninterrupted, tiny_lm["model"]) < 1e-5


def test_the_doctor_says_which_mesh_the_nodes_and_processes_give(capsys):
    """./launch.sh doctor's report names the mesh of the job: the config's, or across nodes the one hsdp_multi_node
    would give (one copy a node, sharded over its GPUs), or why none fits and the count that would."""
    sys.path.insert(0, str(REPO / "scripts"))
    from launcher import mesh_line

    assert mesh_line(None, 2, 8) == (
        "2 x 8 (dp_replicate x dp_shard) over 2 node(s) x 8 process(es) under --config hsdp_multi_node"
    )
    assert mesh_line(None, 4, 1) == (
        "none under --config hsdp_multi_node: 4 processes in 4 replicas leave one process a shard, which is plain "
        "data parallelism; --num_processes 2 would give one"
    )
    config = mesh.from_config(yaml.safe_load(HSDP.read_text()))
    assert mesh_line(config, 1, 8) == "2 x 4 (dp_replicate x dp_shard) over 1 node(s) x 8 process(es)"
    import doctor  # scripts/doctor.py, as `python scripts/doctor.py --report` runs it (launch.sh passes --mesh)

    capsys.readouterr()
    doctor.main(["--report", "--mesh", mesh_line(config, 1, 8)])
    assert (
        "\n  mesh:          2 x 4 (dp_replicate x dp_shard) over 1 node(s) x 8 process(es)\n"
        in capsys.readouterr().out
    )


@pytest.mark.slow
def test_hsdp_across_two_nodes_keeps_a_copy_a_node_and_trains_one_big_batch(tiny_lm, chat_reference, tmp_path):
    """Two "nodes" of a Slurm job (two launch.sh on one machine), 2 processes each, under hsdp_multi_node.yaml: the
    mesh is one copy a node (dp_replicate 2), sharded over the node's processes, and the run is the update of one
    process with 4 times the batch; its record launches it again with that config on 2 nodes. The recipe is zero.py,
    the other LM recipe (on this data it trains what lm_finetune.py trains, to the byte, in one process)."""
    from test_multinode import two_nodes

    out = tmp_path / "nodes"
    outs = two_nodes("zero", "--config", "hsdp_multi_node", "--num_processes", "2", *chat_args(tiny_lm, out, 1))
    for node, (_, _, err) in enumerate(outs):
        assert "hsdp_multi_node.yaml: a mesh of 2 x 2 (dp_replicate x dp_shard) over 2 node(s) x 2 process(es)" in err
    res = results(out)
    assert res["world_size"] == 4 and res["launch"]["nodes"] == 2
    assert res["launch"]["command"].startswith("./launch.sh zero --config hsdp_multi_node --num_processes 2 ")
    assert update_distance(out, chat_reference, tiny_lm["model"]) < 1e-5


def test_an_accelerate_older_than_the_tested_one_is_refused_for_a_mesh_in_one_line():
    """HSDP and tensor parallelism need the accelerate they were tested with (1.10's FSDP2 fails on a 2-D mesh after
    the model has loaded, in a traceback): an older one is one line naming the pip command; FSDP2 alone is not."""
    hsdp, tp = dict(MESHES[6], dp_shard=2), {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "cp": 1}
    assert hsdp["dp_replicate"] == 2
    line = mesh.untested_accelerate(hsdp, "1.10.0")
    assert line.endswith("pip install 'accelerate>=1.15', or use --config fsdp") and "\n" not in line
    assert mesh.untested_accelerate(tp, "1.14.2") is not None
    assert mesh.untested_accelerate(hsdp, "1.15.0") is None and mesh.untested_accelerate(hsdp, "2.0.0") is None
    assert mesh.untested_accelerate({"dp_replicate": 1, "dp_shard": 4, "tp": 1, "cp": 1}, "1.10.0") is None
