"""Two "nodes" on one machine: two launch.sh, each the srun task of its node in a 2-node Slurm job
(SLURM_NODEID 0 and 1), one process per node, meeting at 127.0.0.1 on one port through c10d. And a
node whose head cannot be reached fails in bounded time with one clear line, instead of hanging."""

import re
import shutil
import signal
import socket
import subprocess
import time

import pytest
from conftest import REPO, digits_args, free_port, results, run, user_env

LAUNCH = REPO / "launch.sh"


def node_env(node, port, **extra) -> dict:
    return user_env(
        SLURM_JOB_ID="77",
        SLURM_STEP_ID="0",
        SLURM_NNODES="2",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_NODEID=str(node),
        SLURM_JOB_NODELIST="node-[0-1]",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def two_nodes(*args, timeout=300):
    """Start both nodes' launchers at once and wait for both; returns their completed processes."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [LAUNCH, *args],
            cwd=REPO,
            env=node_env(node, port),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for node in (0, 1)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            outs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    for node, (code, out, err) in enumerate(outs):
        assert code == 0, f"node {node} exited {code}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    return outs


@pytest.mark.slow
def test_cifar_trains_across_two_nodes_and_a_requeue_onto_one_node_continues_it(digits, tmp_path):
    """Two nodes of 1 process x 16 train 5 steps with a checkpoint at 3. The job requeued onto one node
    (one launch.sh, 1 process x 32: the same effective batch) resumes `latest` where the two stopped."""
    out = tmp_path / "out"
    args = digits_args(digits, out, "--model", "resnet18", "--max_train_steps", "5", "--checkpointing_steps", "3")
    outs = two_nodes("cifar", "--config", "cpu", "--num_processes", "1", *args, "--per_device_train_batch_size", "16")
    for node, (_, _, err) in enumerate(outs):
        (line,) = [ln for ln in err.splitlines() if ln.startswith("+ ")]
        assert f"--num_processes 2 --num_machines 2 --machine_rank {node} --main_process_ip 127.0.0.1 " in line
    res = results(out)
    assert res["world_size"] == 2 and res["steps"] == 5 and res["eval_samples"] == digits["n_val"], res

    shutil.rmtree(out / "checkpoint-5", ignore_errors=True)  # the requeue finds the step-3 checkpoint newest
    (out / "results.json").unlink()
    env = user_env(
        SLURM_JOB_ID="77",
        SLURM_STEP_ID="0",
        SLURM_NNODES="1",
        SLURM_STEP_NUM_TASKS="1",
        SLURM_NODEID="0",
        SLURM_JOB_NODELIST="node-0",
    )
    proc = run(
        [
            LAUNCH,
            "cifar",
            "--config",
            "cpu",
            "--num_processes",
            "1",
            *args,
            "--per_device_train_batch_size",
            "32",
            "--resume_from_checkpoint",
            "latest",
        ],
        env=env,
    )
    assert "2 x 16 x 1 -> 1 x 32 x 1, effective batch 32 -> 32" in proc.stderr
    res = results(out)
    assert res["world_size"] == 1 and res["steps"] == 5 and res["samples_seen"] == 5 * 32


@pytest.mark.slow
def test_doctor_allreduce_across_two_nodes():
    outs = two_nodes("doctor", "--config", "cpu", "--num_processes", "1", "--iters", "3", "--timeout", "60")
    tables = [out for _, out, _ in outs if "all_reduce, float32 sum" in out]
    assert len(tables) == 1, "rank 0 prints the table"
    assert "gloo, 2 processes (2 node(s) x 1)" in tables[0] and "sums correct on all 2 processes" in tables[0]
    for _, out, _ in outs:  # every node reports itself
        assert "processes:     1 on this node (on CPU)" in out


@pytest.mark.slow
def test_unreachable_head_fails_in_bounded_time_with_one_line():
    """Node 1 of 2, its head's port wrong (nothing listens there): launch.sh waits RDZV_TIMEOUT
    seconds (60 by default; 10 here, to keep the test short), then names the likely causes."""
    tic = time.monotonic()
    env = node_env(1, free_port(), RDZV_TIMEOUT="10")
    proc = subprocess.run(
        [LAUNCH, "cifar", "--config", "cpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - tic
    assert proc.returncode == 2 and 8 < elapsed < 90, (proc.returncode, elapsed)  # it waited, then gave up
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert line.startswith("launch.sh: error: node 1 cannot reach the head node 127.0.0.1:") and "after 10 s" in line
    for cause in ("launcher started", "firewall", "MASTER_ADDR", "./launch.sh doctor"):
        assert cause in line


@pytest.mark.slow
def test_a_head_left_alone_or_on_a_taken_port_fails_with_one_line():
    """The head node of 2 whose other node never comes: it waits RDZV_TIMEOUT seconds, then one
    line instead of torch's RendezvousTimeoutError traceback. And the job's port already taken on
    the head (another job): one line at once."""
    tic = time.monotonic()
    proc = subprocess.run(
        [LAUNCH, "cifar", "--config", "cpu", "--num_processes", "1"],
        cwd=REPO,
        env=node_env(0, free_port(), RDZV_TIMEOUT="5"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and time.monotonic() - tic > 4, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert line.startswith(
        "launch.sh: error: not every node joined within RDZV_TIMEOUT=5 s; check that launch.sh "
        "started on every node of the job and that each reaches 127.0.0.1:"
    ), line
    assert re.search(r"each reaches 127\.0\.0\.1:\d+ \(\$MASTER_ADDR\)", line), line  # where the address came from

    # Stopped while it waits (SIGTERM, as scancel sends): it ends at once, nothing having started; the port is free.
    port = free_port()
    waiting = subprocess.Popen(
        [LAUNCH, "cifar", "--config", "cpu", "--num_processes", "1"],
        cwd=REPO,
        env=node_env(0, port, RDZV_TIMEOUT="600"),
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(8)  # the launcher has started torch's agent, which waits for the other node
    tic = time.monotonic()
    waiting.send_signal(signal.SIGTERM)
    _, stderr = waiting.communicate(timeout=60)
    assert waiting.returncode == 75 and time.monotonic() - tic < 15, (waiting.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and stderr.rstrip().endswith("nothing was saved (exit 75)"), stderr[-3000:]
    with socket.socket() as free:  # no process listens on the port any more (TIME_WAIT aside)
        free.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        free.bind(("127.0.0.1", port))

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [LAUNCH, "cifar", "--config", "cpu", "--num_processes", "1"],
            cwd=REPO,
            env=node_env(0, port),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert line == (
        f"launch.sh: error: port {port} on this node is in use by another process; set MASTER_PORT to a "
        "free port (the same on every node)"
    )


@pytest.mark.parametrize("how", ["NNODES", "config"])
def test_nodes_started_by_hand_meet_as_slurms_do(tmp_path, how):
    """Nodes started by hand (torchrun's NNODES and NODE_RANK, or a filled-in multi-node config) meet as Slurm's do:
    launch.sh (--dry_run: the command it would run) gives the head of 2 the same c10d rendezvous at MASTER_ADDR, with
    RDZV_TIMEOUT as its join timeout, whose end test_a_head_left_alone_or_on_a_taken_port_fails_with_one_line
    launches (one line after RDZV_TIMEOUT, not after torch's own half hour)."""
    port, args = free_port(), ["cifar", "--num_processes", "1"]
    env = user_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="5")
    if how == "NNODES":
        env.update(NNODES="2", NODE_RANK="0")
    else:
        config = tmp_path / "nodes.yaml"
        config.write_text(
            (REPO / "accelerate_configs/multi_node.yaml")
            .read_text()
            .replace("10.0.0.1", "127.0.0.1")
            .replace("use_cpu: false", "use_cpu: true")
            .replace("num_processes: 16", "num_processes: 2")
        )
        args = ["cifar", "--config", str(config)]
    proc = run([LAUNCH, *args, "--dry_run"], env=env)
    (command,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("+ ")]
    assert (
        f"--num_processes 2 --num_machines 2 --machine_rank 0 --main_process_ip 127.0.0.1 --main_process_port {port} "
        "--rdzv_backend c10d --rdzv_conf is_host=1,join_timeout=5 " in command
    ), command
