"""launch.sh under Slurm, and the sbatch templates in slurm/, on a machine without Slurm: the
job's variables are set by hand, and a fake srun (tests/conftest.py) runs each task of a step in turn with the
variables the real one gives it (SLURM_NODEID, SLURM_PROCID, SLURM_STEP_*)."""

import os
import re
import signal
import subprocess
import time

import launcher
import pytest
from conftest import JOB_ID, PORT, REPO, commands, directives, executable, launcher_says, run, sbatch, slurm_env

TEMPLATES = sorted((REPO / "slurm").glob("*.sbatch"))


def step_env(env, node, nodes) -> dict:
    """`env` as the srun task on node `node` of a one-task-per-node step sees it."""
    return {
        **env,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(nodes),
        "SLURM_STEP_NODELIST": env["SLURM_JOB_NODELIST"],
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
    }


@pytest.fixture
def says(capfd):
    """says(env, *argv) -> (exit code, stdout, stderr) of `./launch.sh argv` in `env`: its launcher's decision, made
    in this process (the templates below run launch.sh itself, under the fake srun)."""
    return lambda env, *argv: launcher_says(launcher, argv, env, capfd)


def dry_run(says, env, *args) -> str:
    code, _, err = says(env, *args, "--dry_run")
    assert code == 0, err
    (line,) = commands(err)
    return line


# ---------------------------------------------------------------- launch.sh under Slurm


@pytest.mark.parametrize("node", [0, 1, 2, 3])
def test_each_node_resolves_its_own_rank_and_the_same_head(tmp_path, node, says):
    env = step_env(slurm_env(tmp_path, 4, SLURM_JOB_NODELIST="gpu-[01-03,07]"), node, 4)
    del env["SLURM_STEP_NODELIST"]
    line = dry_run(says, env, "cifar", "--learning_rate", "0.2")
    assert "accelerate_configs/8gpu.yaml --num_processes 32 --num_machines 4 " in line
    assert f"--machine_rank {node} --main_process_ip gpu-01 --main_process_port {PORT} --rdzv_backend c10d " in line
    assert f"--rdzv_conf is_host={int(node == 0)},join_timeout=60 " in line
    assert line.rstrip().endswith("recipes/cifar.py --learning_rate 0.2") and "ACCELERATE_USE_CPU" not in line


@pytest.mark.parametrize(
    "nodelist, head",
    [
        ("gpu-[01-03,07]", "gpu-01"),
        ("a[7-9],b[1-2]", "a7"),
        ("n12,n3", "n12"),
        ("rack[2-3]-gpu[08-09]", "rack2-gpu08"),
        ("node-[5]-ib,node-6-ib", "node-5-ib"),
        ("gpu[001-128]", "gpu001"),
    ],
)
def test_head_node_from_slurm_compressed_node_list(tmp_path, nodelist, head, says):
    env = step_env(slurm_env(tmp_path, 2, SLURM_JOB_NODELIST=nodelist), 1, 2)
    del env["SLURM_STEP_NODELIST"]
    assert f"--main_process_ip {head} " in dry_run(says, env, "cifar")


def test_scontrol_expands_the_node_list_when_present(tmp_path, says):
    env = step_env(slurm_env(tmp_path, 2), 1, 2)
    executable(
        tmp_path / "fakebin/scontrol",
        '#!/bin/sh\n[ "$*" = "show hostnames gpu-[01-02]" ] && printf "gpu-01.cluster\\ngpu-02.cluster\\n"\n',
    )
    assert "--main_process_ip gpu-01.cluster " in dry_run(says, env, "cifar")


def test_master_addr_and_port_override_and_timeout(tmp_path, says):
    env = step_env(slurm_env(tmp_path, 2, MASTER_ADDR="10.1.2.3", MASTER_PORT="29555", RDZV_TIMEOUT="300"), 1, 2)
    line = dry_run(says, env, "cifar")
    assert "--main_process_ip 10.1.2.3 --main_process_port 29555 --rdzv_backend c10d " in line
    assert "--rdzv_conf is_host=0,join_timeout=300 " in line


def test_num_processes_counts_one_node(tmp_path, says):
    line = dry_run(says, step_env(slurm_env(tmp_path, 3), 2, 3), "cifar", "--num_processes", "4")
    assert "accelerate_configs/8gpu.yaml --num_processes 12 --num_machines 3 --machine_rank 2 " in line


def test_gpus_slurm_gave_the_node_choose_the_config(tmp_path, says):
    line = dry_run(says, step_env(slurm_env(tmp_path, 2, SLURM_GPUS_ON_NODE="4"), 0, 2), "cifar")
    assert "accelerate_configs/4gpu.yaml --num_processes 8 --num_machines 2 " in line


def test_cpu_only_nodes_keep_the_cpu_path(tmp_path, says):
    line = dry_run(says, step_env(slurm_env(tmp_path, 2, gpus=0), 1, 2), "cifar")
    assert line.startswith("+ ACCELERATE_USE_CPU=true ")
    assert "accelerate_configs/cpu.yaml --num_processes 4 --num_machines 2 " in line


def test_deepspeed_configs_use_the_standard_multinode_launcher(tmp_path, says):
    line = dry_run(says, step_env(slurm_env(tmp_path, 2), 0, 2), "cifar", "--config", "zero2")
    assert "accelerate_configs/zero2.yaml --num_processes 16 --num_machines 2 " in line
    assert "--deepspeed_multinode_launcher standard " in line


def test_one_node_job_is_a_single_node_launch_on_the_job_port(tmp_path, says):
    line = dry_run(says, step_env(slurm_env(tmp_path, 1), 0, 1), "cifar")
    assert f"accelerate_configs/8gpu.yaml --main_process_port {PORT} " in line and "--num_machines" not in line


def one_error(said, text):
    code, _, err = said
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: ") and text in lines[0], err


def test_outside_srun_and_several_tasks_per_node_are_refused(tmp_path, says):
    env = slurm_env(tmp_path, 3)  # the batch script's own environment: no step
    one_error(says(env, "cifar"), "outside srun, on one node")
    env = {**step_env(env, 1, 3), "SLURM_STEP_NUM_TASKS": "24"}
    one_error(says(env, "cifar"), "use srun --ntasks-per-node=1")
    env = {**step_env(slurm_env(tmp_path, 2), 1, 2), "RDZV_TIMEOUT": "soon"}
    one_error(says(env, "cifar"), "RDZV_TIMEOUT must be a positive number")


def test_a_launcher_a_gpu_a_job_without_a_node_list_and_a_rank_past_the_nodes_are_refused(tmp_path, says):
    env = {**step_env(slurm_env(tmp_path, 1), 0, 1), "SLURM_STEP_NUM_TASKS": "8"}  # --ntasks-per-node=8 on one node
    one_error(says(env, "cifar"), "SLURM_STEP_NUM_TASKS must be 1, one launch.sh a node")
    env = step_env(slurm_env(tmp_path, 2), 1, 2)
    for name in ("SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NODELIST"):
        del env[name]
    one_error(says(env, "cifar"), "no head node: SLURM_JOB_NODELIST is empty")
    env = {**step_env(slurm_env(tmp_path, 2), 0, 2), "SLURM_NODEID": "2"}
    one_error(says(env, "cifar"), "SLURM_NODEID must be 0 to 1, got '2'")


def test_nodes_without_slurm_meet_as_under_it(tmp_path, says):
    """torchrun's NNODES and NODE_RANK, or a filled-in multi-node config: the command Slurm's nodes get (c10d, the
    head hosting it, RDZV_TIMEOUT), one CPU process a node included (not a lone `--cpu` process)."""
    env = slurm_env(tmp_path, 1, gpus=0, MASTER_ADDR="127.0.0.1", RDZV_TIMEOUT="7")
    del env["SLURM_JOB_ID"]
    line = dry_run(says, {**env, "NNODES": "2", "NODE_RANK": "1"}, "cifar", "--num_processes", "1")
    assert "cpu.yaml --num_processes 2 --num_machines 2 --machine_rank 1 --main_process_ip 127.0.0.1 " in line
    assert "--rdzv_backend c10d --rdzv_conf is_host=0,join_timeout=7 " in line and " --cpu " not in line
    config = tmp_path / "mine.yaml"
    config.write_text(
        (REPO / "accelerate_configs/multi_node.yaml")
        .read_text()
        .replace("use_cpu: false", "use_cpu: true")
        .replace("num_processes: 16", "num_processes: 2")
    )
    line = dry_run(says, env, "cifar", "--config", config)
    assert "--num_processes 2 --num_machines 2 --machine_rank 0 --main_process_ip 127.0.0.1 " in line
    assert "--rdzv_conf is_host=1,join_timeout=7 " in line and " --cpu " not in line
    # in a Slurm job of one node (an interactive allocation), on their own port, not the job's
    job = {
        **step_env(slurm_env(tmp_path, 1, gpus=0), 0, 1),
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
    }
    line = dry_run(says, job, "cifar", "--num_processes", "1")
    assert "--num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29500 " in line
    del env["MASTER_ADDR"]
    one_error(
        says({**env, "NNODES": "2", "NODE_RANK": "0"}, "cifar", "--dry_run"),
        "NNODES=2 needs MASTER_ADDR",
    )
    one_error(says(env, "--config", "cpu", "cifar"), "the recipe comes first")
    one_error(says({**env, "NODE_RANK": "1"}, "cifar"), "NODE_RANK=1 is set but not NNODES")


def test_requeue_template_names_a_flag_without_its_value(tmp_path):
    env = slurm_env(tmp_path, 1, SLURM_CPUS_PER_TASK="8")
    args = ["cifar", "--checkpointing_steps", "5", "--resume_from_checkpoint"]
    proc = run(["bash", REPO / "slurm/requeue.sbatch", *args], env=env, check=False)
    assert proc.returncode == 2 and proc.stderr == "error: --resume_from_checkpoint needs a value\n", proc.stderr


# ---------------------------------------------------------------- the sbatch templates


def test_templates_exist_and_pass_bash_n():
    assert {p.name for p in TEMPLATES} == {"single_node.sbatch", "multi_node.sbatch", "requeue.sbatch"}
    for template in TEMPLATES:
        run(["bash", "-n", template])
        options = directives(template)
        assert options["ntasks-per-node"] == "1", "one launcher task per node"
        assert "%j" in options["output"] and options["gres"].startswith("gpu:") and int(options["cpus-per-task"]) > 1
        text = template.read_text()
        assert "srun --ntasks-per-node=1 " in text and "--kill-on-bad-exit=1" in text
        assert "$SLURM_NODEID" not in re.sub(r"^#.*$", "", text, flags=re.M), "the rank is read inside the step"
    assert (REPO / "slurm/logs/.gitignore").is_file(), "the log folder exists in a fresh checkout"


@pytest.mark.parametrize("template, nodes", [("single_node", 1), ("multi_node", 2), ("multi_node", 4), ("requeue", 3)])
def test_template_runs_one_launcher_per_node_as_launch_sh_resolves(tmp_path, template, nodes, says):
    args = ["cifar", "--checkpointing_steps", "500", "--output_dir", "outputs/cifar"]
    lines, env = sbatch(REPO / f"slurm/{template}.sbatch", args, tmp_path, nodes=nodes)
    assert len(lines) == nodes, lines
    extra = ["--resume_from_checkpoint", "latest"] if template == "requeue" else []
    for node, line in enumerate(lines):
        assert line == dry_run(says, step_env(env, node, nodes), *args, *extra)
        if nodes > 1:
            assert f"--machine_rank {node} --main_process_ip gpu-01 --main_process_port {PORT} " in line
    srun_options = (tmp_path / "srun.log").read_text().split()
    assert "--kill-on-bad-exit=1" in srun_options and "--cpus-per-task=64" in srun_options


def test_requeue_template_needs_checkpoints(tmp_path):
    template = REPO / "slurm/requeue.sbatch"
    env = slurm_env(tmp_path, 2, SLURM_CPUS_PER_TASK="64")
    proc = run(["bash", template, "cifar", "--output_dir", "outputs/cifar"], env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: requeue.sbatch needs --checkpointing_steps")


def test_requeue_template_stops_the_step_at_a_checkpoint_and_requeues_on_usr1(tmp_path):
    """Slurm's warning signal before the time limit (--signal=B:USR1@300) reaches the batch shell:
    it passes USR1 to the step (srun forwards it to launch.sh on every node), and once the step
    exits 75 (stopped at a checkpoint) it requeues the job. Preemption requeues through --requeue."""
    env = slurm_env(tmp_path, 2, SLURM_CPUS_PER_TASK="64")
    started = tmp_path / "started"
    # A long training step that, like launch.sh, saves and exits 75 on USR1.
    executable(
        tmp_path / "fakebin/srun",
        f"#!/bin/bash\ntrap 'echo USR1 > {tmp_path}/step.log; exit 75' USR1\ntouch {started}\nsleep 60 & wait\n",
    )
    executable(tmp_path / "fakebin/scontrol", f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol.log\n')
    log = tmp_path / "job.out"  # a file, not a pipe: the fake step would hold a pipe open
    proc = subprocess.Popen(
        ["bash", REPO / "slurm/requeue.sbatch", "cifar", "--checkpointing_steps", "500"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        for _ in range(300):  # the step runs: the trap is set
            if started.exists():
                break
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGUSR1)
        proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the fake step's sleep
        except ProcessLookupError:
            pass
    out = log.read_text()
    assert proc.returncode == 0, out
    assert (tmp_path / "step.log").read_text().strip() == "USR1", "the step was asked to stop"
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", JOB_ID]
    assert "requeueing job 4242" in out


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_requeue_template_resumes_the_users_checkpoint_first_and_latest_once_requeued(tmp_path, form):
    """A job started from a named checkpoint resumes that one on its first run; once requeued
    (SLURM_RESTART_COUNT > 0) it continues `latest`, the newest checkpoint of the run it became.
    One --resume_from_checkpoint each time: argparse would silently keep the last of two."""
    named = "outputs/cifar/checkpoint-100"
    resume = ["--resume_from_checkpoint", named] if form == "separate" else [f"--resume_from_checkpoint={named}"]
    args = ["cifar", "--checkpointing_steps", "500", *resume, "--output_dir", "outputs/cifar"]
    template = REPO / "slurm/requeue.sbatch"
    for restarts, expected in (("0", named), ("2", "latest")):
        env = slurm_env(tmp_path, 1, 8, SLURM_CPUS_PER_TASK="64", SLURM_RESTART_COUNT=restarts)
        (line,) = sbatch(template, args, tmp_path, env=env)[0]
        assert line.count("--resume_from_checkpoint") == 1, line
        assert f"--resume_from_checkpoint {expected}" in line, (restarts, line)


def test_a_recipe_srun_starts_as_several_tasks_is_refused_not_trained_as_copies(digits, tmp_path):
    """`srun --ntasks-per-node=2 python recipes/cifar.py` (no launcher): two copies that never form a group, each
    training its own model into one folder; each task says so in one line, exit 2, nothing written. The first task
    as srun starts it: `python recipes/cifar.py` with the variables srun gives a task of such a step (FAKE_SRUN's)."""
    from conftest import BIN, digits_args

    env = slurm_env(tmp_path, nodes=1, gpus=0, CUDA_VISIBLE_DEVICES="")
    env |= {"SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_NODELIST": env["SLURM_JOB_NODELIST"], "SLURM_NODEID": "0", "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0"}  # fmt: skip
    out = tmp_path / "run"
    args = [*digits_args(digits, out), "--max_train_steps", "1"]
    proc = run([BIN / "python", REPO / "recipes/cifar.py", *args], env=env, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: srun started this command as 2 processes (SLURM_STEP_NUM_TASKS) and none")
    assert "srun --ntasks-per-node=1 ./launch.sh" in lines[0] and not out.exists()
