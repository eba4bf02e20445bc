"""launch.sh: config choice from the GPUs present (faked with an nvidia-smi on PATH that lists them,
the way the real one does), overrides, and every check of its own input; then real launches: a
recipe's error is its one line and exit code, killing the launcher outright leaves nothing
training, Ctrl-C before and during training, ZeRO on CPU."""

import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import launcher
import psutil
import pytest
from conftest import (
    ACCELERATE_LAUNCH,
    BIN,
    REPO,
    cpu_env,
    digits_args,
    error_lines,
    free_port,
    launcher_says,
    lm_args,
    preempted_at,
    results,
    run,
    session_killed_at_exit,
    user_env,
)

LAUNCH = REPO / "launch.sh"


@pytest.fixture
def gpus(tmp_path):
    """gpus(n) -> an environment whose nvidia-smi reports n GPUs."""

    def make(n, **extra):
        bin_dir = tmp_path / f"bin{n}"
        bin_dir.mkdir(exist_ok=True)
        smi = bin_dir / "nvidia-smi"
        lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})"\n' for i in range(n))
        smi.write_text(f"#!/bin/sh\n{lines}")
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
        env = user_env(**extra)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        return env

    return make


@pytest.fixture
def dry_run(capfd, monkeypatch):
    """dry_run(env, *args) -> the command `./launch.sh cifar --dry_run args` prints in `env`: its launcher's decision,
    made in this process, from the repository's folder as the runs here start it (launch.sh itself runs below)."""
    monkeypatch.chdir(REPO)

    def decide(env, *args):
        code, _, err = launcher_says(launcher, ["cifar", "--dry_run", *args], env, capfd)
        assert code == 0, err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("+ ")]
        return line

    return decide


@pytest.mark.slow
def test_the_exit_code_is_the_launchers_also_when_it_ends_during_a_trap(tmp_path):
    """bash 5.2's `wait` loses the status of a child that ends while a trap runs (it gives 255). A launcher that ends
    right after its ready signal (USR2) is the worst case: a stand-in that does only that, and writes its code where
    launch.sh says, as scripts/launcher.py does. Before the fix about 1 run in 3 exited 255."""
    shutil.copy(REPO / "launch.sh", tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "accelerate").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "python").write_text(
        '#!/bin/bash\nkill -USR2 "$LAUNCH_SH_PID"\necho 2 > "$LAUNCH_SH_CODE"\nexit 2\n'
    )
    for stub in (tmp_path / "bin").iterdir():
        stub.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "TMPDIR": str(tmp_path / "tmp")}
    codes = [subprocess.run([tmp_path / "launch.sh", "x"], env=env, timeout=30).returncode for _ in range(100)]
    assert set(codes) == {2}, sorted(codes)
    assert not list((tmp_path / "tmp").iterdir())  # launch.sh removed the file the code came in


def test_help():
    proc = run([LAUNCH, "--help"])
    assert proc.stdout.startswith("Usage: ./launch.sh RECIPE")
    # the recipe's options, once: from one process, not from each of those a launch starts
    proc = run([LAUNCH, "cifar", "--learning_rate", "0.2", "--help"])
    assert proc.stdout.startswith("usage: cifar.py ") and proc.stdout.count("usage:") == 1
    assert "--per_device_train_batch_size" in proc.stdout


@pytest.mark.parametrize(
    "n, config, extra",
    [
        (1, "1gpu.yaml", ""),
        (2, "2gpu.yaml", ""),
        (4, "4gpu.yaml", ""),
        (8, "8gpu.yaml", ""),
        (3, "2gpu.yaml", "--num_processes 3"),
    ],
)
def test_config_follows_the_gpus_present(gpus, n, config, extra, dry_run):
    line = dry_run(gpus(n), "--learning_rate", "0.2")
    assert f"accelerate_configs/{config}" in line and "ACCELERATE_USE_CPU" not in line
    assert extra in line and line.rstrip().endswith("recipes/cifar.py --learning_rate 0.2")


def test_cuda_visible_devices_narrows_the_count(gpus, dry_run):
    assert "accelerate_configs/2gpu.yaml" in dry_run(gpus(8, CUDA_VISIBLE_DEVICES="3,5"))


def test_no_gpu_runs_cpu_processes_in_one_group(gpus, dry_run):
    line = dry_run(gpus(0), "--num_processes", "3")
    assert line.startswith("+ ACCELERATE_USE_CPU=true ") and "accelerate_configs/cpu.yaml --num_processes 3" in line
    assert " --cpu " not in line


def test_one_cpu_process_forms_no_group_unless_it_may_restart(gpus, dry_run):
    """--cpu: no DistributedDataParallel of one process (benchmarks/README.md); --max_restarts
    needs torchrun's agent, which forms the group."""
    line = dry_run(gpus(0), "--num_processes", "1")
    assert "--num_processes 1 " in line and " --cpu " in line
    assert " --cpu " not in dry_run(gpus(0), "--num_processes", "1", "--max_restarts", "2")


def test_restarts_get_a_store_each_at_the_jobs_port(gpus, dry_run):
    """--max_restarts: c10d rendezvous at MASTER_PORT, and a store of its own for each attempt (see launcher.py)."""
    env = gpus(2)
    line = dry_run(env, "--max_restarts", "2")
    assert line.startswith(f"+ TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PET_RDZV_ENDPOINT=127.0.0.1:{env['MASTER_PORT']} ")
    assert line.endswith(" --rdzv_backend c10d --rdzv_conf is_host=1 --max_restarts 2 " + f"{REPO}/recipes/cifar.py")


def test_a_config_by_its_path_and_launch_sh_by_a_link(gpus, tmp_path, dry_run):
    """--config takes the path of a YAML file, the repo's or one of yours; launch.sh reached through a link to it
    finds its scripts; its stdout closed (>&-), it still ends with the recipe's code."""
    mine = tmp_path / "my.yaml"
    shutil.copy(REPO / "accelerate_configs/cpu.yaml", mine)
    assert f"--config_file {REPO}/accelerate_configs/cpu.yaml " in dry_run(
        gpus(0), "--config", "./accelerate_configs/cpu.yaml"
    )
    assert f"--config_file {mine} " in dry_run(gpus(0), "--config", str(mine))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "train").symlink_to(LAUNCH)
    proc = run([tmp_path / "bin" / "train", "cifar", "--dry_run"], env=gpus(0))
    assert f"{REPO}/recipes/cifar.py" in proc.stderr
    if shutil.which("sh"):  # `sh launch.sh` (dash on Debian): it runs in the shell it is written for
        proc = run(["sh", LAUNCH, "cifar", "--dry_run"], env=gpus(0))
        assert f"{REPO}/recipes/cifar.py" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    proc = run(["bash", "-c", f"{LAUNCH} cifar --dry_run >&-"], env=gpus(0), check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    # a config of several machines needs the head's address: without it, one line (not accelerate's assertion)
    (tmp_path / "two.yaml").write_text(mine.read_text().replace("num_machines: 1", "num_machines: 2"))
    proc = run([LAUNCH, "cifar", "--dry_run", "--config", tmp_path / "two.yaml"], env=gpus(0), check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"launch.sh: error: {tmp_path / 'two.yaml'}: num_machines: 2 starts one launch.sh on each machine"
    ), proc.stderr


def test_overrides_and_master_port(gpus, dry_run):
    line = dry_run(gpus(8, MASTER_PORT="29777"), "--config", "4gpu", "--num_processes", "2")
    assert "accelerate_configs/4gpu.yaml --num_processes 2 --main_process_port 29777" in line
    # Without MASTER_PORT a free port of the OS's, one for each launch: accelerate's own check of 29500 races with
    # another launch's on the host (both see it free, one fails with EADDRINUSE)
    env = {k: v for k, v in gpus(0).items() if k != "MASTER_PORT"}
    ports = {re.search(r"--main_process_port (\d+) ", dry_run(env, "--num_processes", "2"))[1] for _ in range(3)}
    assert len(ports) == 3 and "29500" not in ports, ports
    # the file's path works as well as its name, for the config and for the recipe
    proc = run([LAUNCH, "recipes/cifar.py", "--dry_run", "--config", "accelerate_configs/4gpu.yaml"], env=gpus(8))
    assert f"--config_file {REPO}/accelerate_configs/4gpu.yaml " in proc.stderr
    assert proc.stderr.rstrip().endswith(f" {REPO}/recipes/cifar.py")


def said(decided):
    """launcher_says's (exit code, stdout, stderr) as the finished process one_error reads."""
    return subprocess.CompletedProcess([], decided[0], decided[1], decided[2])


def one_error(proc, text):
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and text in lines[0], proc.stderr
    return lines[0]


def test_more_processes_than_gpus_is_refused(gpus, capfd):
    line = one_error(
        said(launcher_says(launcher, ["cifar", "--num_processes", "4"], gpus(2), capfd)),
        "4 processes requested on this node but only 2 GPU(s) are visible",
    )
    assert "--num_processes 2" in line


def test_gpu_config_on_a_cpu_host_is_refused(gpus, capfd):
    one_error(said(launcher_says(launcher, ["cifar", "--config", "4gpu"], gpus(0), capfd)), "use --config cpu")


def test_unknown_config_and_recipe():
    line = one_error(run([LAUNCH, "cifar", "--config", "16gpu"], check=False), "unknown config '16gpu'")
    assert "available: 1gpu 2gpu 4gpu 8gpu cpu" in line
    one_error(run([LAUNCH, "imagenet"], check=False), "unknown recipe 'imagenet' (available: cifar")
    one_error(run([LAUNCH, "cifar", "--num_processes", "two"], check=False), "positive integer")


# ---------------------------------------------------------------- launch.sh's own input


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """launch.sh with its scripts, recipes and configs in a folder of its own, plus a broken config."""
    root = tmp_path_factory.mktemp("tree")
    shutil.copy2(LAUNCH, root / "launch.sh")
    for name in ("scripts", "recipes", "accelerate_configs", "common"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "accelerate_configs/broken.yaml").write_text("num_processes: two\n")
    (root / "accelerate_configs/typo.yaml").write_text("distributed_type: MULTI_GPU\nuse_cpu: true\nnum_processs: 2\n")
    (root / "accelerate_configs/mcpu.yaml").write_text(  # what `accelerate config` writes for CPU processes
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\nnum_processes: 2\n"
        "mixed_precision: 'no'\nuse_cpu: true\n"
    )
    (root / "accelerate_configs/node1.yaml").write_text(  # node 1 of a multi-node config run by hand, no head
        (REPO / "accelerate_configs/multi_node.yaml")
        .read_text()
        .replace("machine_rank: 0 ", "machine_rank: 1 ")
        .replace("10.0.0.1", "127.0.0.1")
        .replace("29500", str(free_port()))
        .replace("use_cpu: false", "use_cpu: true")
        .replace("num_processes: 16", "num_processes: 2")
    )
    (root / "accelerate_configs/nofile.yaml").write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: /no/such/ds.json\n"
    )
    return root


CONFIG_NAMES = (
    "1gpu 2gpu 4gpu 8gpu broken cpu fsdp hsdp hsdp_multi_node mcpu multi_node node1 nofile tp typo "
    "zero2 zero3 zero3_offload"
)

PROCESSES = "--num_processes must be a positive integer (the processes on this node),"
SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be a positive number of seconds,"

# (arguments, environment, the error line's text). Each must stop before anything starts.
INVALID = [
    (
        ["--config", "cpu"],
        {},
        "unknown recipe '--config' (available: cifar lm_finetune zero, doctor, selftest, or a recipe's .py file)",
    ),
    (
        ["imagenet"],
        {},
        "unknown recipe 'imagenet' (available: cifar lm_finetune zero, doctor, selftest, or a recipe's .py file)",
    ),
    (["../recipes/cifar"], {}, "unknown recipe '../recipes/cifar'"),
    (["cifar", "--num_processes"], {}, "--num_processes needs a value (see ./launch.sh --help)"),
    (["cifar", "--num_processes", "--dry_run"], {}, "--num_processes needs a value"),
    (["cifar", "--num_processes="], {}, "--num_processes needs a value"),
    (["cifar", "--num_processes", "0"], {}, f"{PROCESSES} got '0'"),
    (["cifar", "--num_processes", "-2"], {}, f"{PROCESSES} got '-2'"),
    (["cifar", "--num_processes", "two"], {}, "got 'two'"),
    (["cifar", "--num_processes", "1.5"], {}, "got '1.5'"),
    (["cifar", "--num_processes", "99999999999999999999"], {}, "got '99999999999999999999'"),
    (["cifar", "--num_processes=2 "], {}, "got '2 '"),
    (["cifar", "--max_restarts"], {}, "--max_restarts needs a value"),
    (["cifar", "--max_restarts", "-1"], {}, "--max_restarts must be a number of restarts (0 or more), got '-1'"),
    (["cifar", "--max_restarts", "many"], {}, "--max_restarts must be a number of restarts (0 or more), got 'many'"),
    (["cifar", "--config"], {}, "--config needs a value"),
    (["cifar", "--config", "--num_processes", "2"], {}, "--config needs a value"),
    (["cifar", "--config="], {}, "--config needs a value"),
    (
        ["cifar", "--config", "16gpu"],
        {},
        f"unknown config '16gpu' (available: {CONFIG_NAMES}, or the path of a YAML file)",
    ),
    (
        ["cifar", "--config", "../accelerate_configs/cpu"],
        {},
        f"unknown config '../accelerate_configs/cpu' (available: {CONFIG_NAMES}, or the path of a YAML file)",
    ),
    (
        ["cifar", "--config", "cpu yaml"],
        {},
        f"unknown config 'cpu yaml' (available: {CONFIG_NAMES}, or the path of a YAML file)",
    ),
    (
        ["cifar", "--config", ".yaml"],
        {},
        f"unknown config '.yaml' (available: {CONFIG_NAMES}, or the path of a YAML file)",
    ),
    (
        ["cifar", "--config", "broken"],
        {},
        "accelerate_configs/broken.yaml: num_processes must be a whole number from 1, got 'two'",
    ),
    (["cifar", "--config", "nofile"], {}, "nofile.yaml: deepspeed_config_file /no/such/ds.json: no such file"),
    (["cifar", "--num_processes", "999999"], {}, "999999 CPU processes requested on this node, which has"),
    (["cifar", "--mixed_precision", "fp8"], {}, "--mixed_precision must be no, bf16 or fp16, got 'fp8'"),
    (["cifar", "--mixed_precision"], {}, "--mixed_precision needs a value"),
    (
        ["cifar", "--config", "4gpu"],
        {},
        "4 processes requested on this node but only 0 GPU(s) are visible; use --config cpu",
    ),
    (["cifar"], {"MASTER_PORT": "0"}, "MASTER_PORT must be a TCP port number from 1 to 65535, got '0'"),
    (["cifar"], {"MASTER_PORT": "65536"}, "MASTER_PORT must be a TCP port number from 1 to 65535, got '65536'"),
    (["cifar"], {"MASTER_PORT": "29500x"}, "MASTER_PORT must be a TCP port number from 1 to 65535, got '29500x'"),
    (["cifar"], {"RDZV_TIMEOUT": "0"}, "RDZV_TIMEOUT must be a positive number of seconds, got '0'"),
    (["cifar"], {"RDZV_TIMEOUT": "soon"}, "RDZV_TIMEOUT must be a positive number of seconds, got 'soon'"),
    (["cifar"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "-1"}, f"{SHUTDOWN} got '-1'"),
    (["cifar"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"}, f"{SHUTDOWN} got '0'"),  # no time to save at all
    (["cifar"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2m"}, f"{SHUTDOWN} got '2m'"),
    (["cifar"], {"MASTER_ADDR": "node 1"}, "MASTER_ADDR must be a host name or an IP address, got 'node 1'"),
    (["cifar"], {"OMP_NUM_THREADS": "abc"}, "OMP_NUM_THREADS must be a positive number of threads, got 'abc'"),
]


@pytest.fixture(scope="module")
def tree_launcher(tree):
    """The tree's scripts/launcher.py, launch.sh's launcher, imported in this process as a module of its own (its
    folder, and so its configs, the tree's): its refusals read where they are made, without a process for each."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location("tree_launcher", tree / "scripts" / "launcher.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # it puts its folder first: this process keeps importing this repository's modules
    return module


def test_every_bad_input_of_launch_sh_is_one_error_line(tree, tree_launcher, gpus, capfd):
    """Checked before anything starts, in --dry_run too (a key accelerate does not read: by accelerate launch, before
    it starts a process, below the command): one `launch.sh: error:` line, exit 2. The launcher's main() with the
    arguments and environment launch.sh hands it, in this process (launch.sh relays its line and exit code: the
    tests above, through launch.sh)."""
    for args, env, message in INVALID:
        for dry in ([], ["--dry_run"]):
            code, out, err = launcher_says(tree_launcher, [*args, *dry], gpus(0, **env), capfd)
            assert (code, out) == (2, ""), (args, env, err[-2000:])
            (line,) = err.splitlines()
            assert line.startswith("launch.sh: error: ") and message in line, (args, env, line)
    proc = run([tree / "launch.sh", "cifar", "--config", "typo"], env=gpus(0), check=False, timeout=60)
    command, line = proc.stderr.splitlines()  # the command it was to run, and why it did not
    assert proc.returncode == 2 and command.startswith("+ ACCELERATE_USE_CPU=true "), proc.stderr
    assert line.startswith("launch.sh: error: ") and "typo.yaml: accelerate launch refuses it: The config" in line


# ---------------------------------------------------------------- real launches


@pytest.mark.slow
def test_a_node_of_a_multi_node_config_whose_head_never_comes_gives_up_in_rdzv_timeout(tree, gpus):
    """Without Slurm (multi_node.yaml filled in by hand, one launch.sh a node), node 1 waited for its head as long
    as torch's rendezvous does; now RDZV_TIMEOUT, as under Slurm, then one line with the likely causes."""
    tic = time.monotonic()
    proc = run([tree / "launch.sh", "cifar", "--config", "node1"], env=gpus(0, RDZV_TIMEOUT="5"), check=False)
    assert proc.returncode == 2 and 4 < time.monotonic() - tic < 60, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert line.startswith("launch.sh: error: node 1 cannot reach the head node 127.0.0.1:") and "after 5 s" in line


@pytest.mark.slow
def test_a_config_accelerate_starts_as_fewer_processes_is_refused_by_hand_too(tree, tiny_lm, tmp_path):
    """accelerate config's answer for CPU processes (distributed_type MULTI_CPU) makes accelerate launch start one
    process where the config asks for 2: it trained alone, exit 0. Through launch.sh the process knows what launch.sh
    asked for (refused, and its fix followed to a run: tests/test_fixes.py, the DeepSpeed launch's test); by hand (or
    as accelerate's default config) the process reads what the config asked for."""
    out = tmp_path / "run"
    args = lm_args(tiny_lm, out, "--max_train_steps", "2")
    cmd = [
        ACCELERATE_LAUNCH,
        "--config_file",
        tree / "accelerate_configs/mcpu.yaml",
        REPO / "recipes/lm_finetune.py",
        *args,
    ]
    proc = run(cmd, env=user_env(), check=False)  # accelerate's launcher adds its traceback and exit 1
    assert proc.returncode != 0, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert line.startswith(
        "error: accelerate launch with num_processes: 2 started one process: it starts several only with a "
        "distributed_type such as MULTI_GPU, not MULTI_CPU; on a host without GPUs pass --multi_gpu with "
        "ACCELERATE_USE_CPU=true exported"
    ), line
    assert not out.exists()


TOKEN, PASSWORD = "hf_" + "Qw3rty" * 5, "pa55w0rd-in-a-url"


def no_noise(text: str):
    """Nothing of a launcher's own failure report: no traceback, no torch.distributed.elastic log."""
    assert "Traceback" not in text and "ChildFailedError" not in text and "elastic" not in text, text[-3000:]
    assert not re.search(r"^[EW]\d{4} ", text, flags=re.M), text[-3000:]  # torch's log format


@pytest.mark.floor
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_recipe_error_is_its_one_line_and_its_exit_code(digits, tmp_path, nproc):
    """A user mistake met by every process: exit 2 and the recipe's one `error:` line, without
    torch's ChildFailedError report. Credentials in the arguments or the environment reach
    neither the printed command nor any message."""
    not_a_checkpoint = tmp_path / "checkpoint-7"
    not_a_checkpoint.mkdir()
    out = tmp_path / "run"
    secrets = {"HF_TOKEN": TOKEN, "WANDB_API_KEY": "0123456789abcdef" * 2}
    args = digits_args(
        digits,
        out,
        "--resume_from_checkpoint",
        not_a_checkpoint,
        "--pretrained_path",  # a URL pasted with its credentials (read after the checkpoint is refused)
        f"https://user:{PASSWORD}@example.org/{TOKEN}",
    )
    proc = run([LAUNCH, "cifar", "--num_processes", nproc, *args], env=cpu_env(**secrets), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower() and not ln.startswith("+ ")]
    assert line.startswith(f"error: --resume_from_checkpoint {not_a_checkpoint}: ")
    no_noise(proc.stdout + proc.stderr)
    (command,) = [line for line in proc.stderr.splitlines() if line.startswith("+ ")]
    assert command.endswith(" --pretrained_path 'https://***@example.org/***'")
    for secret in (TOKEN, PASSWORD, *secrets.values()):
        assert secret not in proc.stdout + proc.stderr
    assert not out.exists()


def start(args, env):
    """launch.sh in a session of its own, as a terminal or a Slurm step runs it; its output in files."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [str(a) for a in [LAUNCH, *args]],
        cwd=REPO,
        env=env,
        stdout=out,
        stderr=err,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # CI may start us with Ctrl-C ignored
    )
    return proc, out, err


def read(file) -> str:
    file.seek(0)
    return file.read()


def processes_of(output_dir) -> list:
    """The launcher and the training processes (and their loader workers) of the run writing `output_dir`. Callers
    read p.info["cmdline"], the command line as listed: p.cmdline() raises once the process has ended (a zombie)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(output_dir) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


def wait_until(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} after {seconds} s"
        time.sleep(0.05)


def training(proc, output_dir, step=3, timeout=300):
    """Wait until checkpoint-<step> of the run is complete."""
    marker = output_dir / f"checkpoint-{step}" / "trainer_state.json"
    wait_until(lambda: marker.exists() or proc.poll() is not None, timeout, f"no checkpoint-{step}")
    assert proc.poll() is None, f"launch.sh ended (exit {proc.returncode}) before checkpoint-{step}"


# A run that cannot end by itself while a test waits for it to stop.
LONG_RUN = ("--max_train_steps", "100000", "--checkpointing_steps", "3", "--save_total_limit", "2")


def newest_checkpoint(output_dir):
    from common.checkpoint import checkpoint_damage

    newest = max(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoint_damage(newest) is None, checkpoint_damage(newest)
    assert not list(output_dir.glob(".tmp-checkpoint-*")), "a half-written checkpoint was left"
    return newest


@pytest.mark.slow
@pytest.mark.parametrize("target, nproc", [("process group", 1), ("launcher", 1), ("launcher", 2)])
def test_killing_the_launcher_outright_leaves_no_training_process(tiny_lm, tmp_path, target, nproc):
    """SIGKILL, which no process can catch, of launch.sh's process group (as `kill -9 -- -PGID`
    does; the launcher has a group of its own) or of the launcher alone: Linux's parent-death
    signal reaches the launcher, or the training processes, as SIGTERM, and they stop as on any
    stop signal: at a step, with a complete checkpoint. Nothing keeps training.
    WORLD_SIZE and RANK left in the shell by another job: the processes train as the `nproc` launch.sh started (a
    group's launcher sets them; launch.sh drops stale ones), their checkpoint says how many. The temporary files of
    the launch.sh and launcher killed, which nothing is left to delete, go to the test's folder (TMPDIR)."""
    out, env = tmp_path / "run", cpu_env(WORLD_SIZE="4", RANK="2", TMPDIR=str(tmp_path))
    proc, _, err = start(["lm_finetune", "--num_processes", nproc, *lm_args(tiny_lm, out, *LONG_RUN)], env)
    try:
        training(proc, out)
        ours = processes_of(out)
        (launcher,) = [p for p in ours if "scripts/launcher.py" in " ".join(p.info["cmdline"])]
        assert len([p for p in launcher.children() if "recipes/lm_finetune.py" in " ".join(p.cmdline())]) == nproc
        if target == "process group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            launcher.kill()
        wait_until(lambda: not processes_of(out), 120, f"processes still running: {processes_of(out)}")
    finally:
        for p in processes_of(out):
            p.kill()
        proc.wait()
    text = read(err)
    assert preempted_at(text) is not None, text[-3000:]
    assert json.loads((newest_checkpoint(out) / "trainer_state.json").read_text())["world_size"] == nproc
    assert not (out / "results.json").exists()


def stop_when(args, out, ready, sig=signal.SIGINT, group=False):
    """launch.sh `args` in a session of its own, sent `sig` once `ready(proc)` holds (to its whole process
    group if `group`, as a terminal's Ctrl-C is). Its exit code and stderr, once no process of the run in
    `out` is left."""
    proc, _, err = start(args, cpu_env())
    try:
        wait_until(lambda: ready(proc) or proc.poll() is not None, 300, "never ready to be stopped")
        if proc.poll() is None:  # else it ended before: its exit code tells how
            (os.killpg if group else os.kill)(proc.pid, sig)
        code = proc.wait(timeout=180)
        wait_until(lambda: not processes_of(out), 30, "processes still running")
    finally:
        for p in processes_of(out):
            p.kill()
        proc.kill()
        proc.wait()
    return code, read(err)


def test_ctrl_c_before_training_is_one_line_saying_nothing_was_saved(tiny_lm, tmp_path):
    """Ctrl-C while the processes start: they end at once, and launch.sh says that nothing was saved.
    On a loaded machine the signal can come later, once they record it: then they stop at a
    checkpoint (exit 75), and the one line says which. Either way the line tells the truth."""
    out = tmp_path / "run"

    def starting(proc):  # the training processes exist and are still starting (importing torch takes seconds)
        try:
            return any(
                "recipes/lm_finetune.py" in " ".join(p.cmdline()[1:3])
                for p in psutil.Process(proc.pid).children(recursive=True)
            )
        except psutil.Error:  # a process of launch.sh's that ended meanwhile
            return False

    code, text = stop_when(["lm_finetune", *lm_args(tiny_lm, out, *LONG_RUN)], out, starting)
    lines = [line for line in text.splitlines() if not line.startswith("+ ")]
    if code == 130:
        assert len(lines) == 1 and lines[0] in stopped_before_training("Ctrl-C"), text
        # nothing but the lock of the run that was starting (a process ended by a signal leaves it)
        assert not out.exists() or {p.name for p in out.iterdir()} <= {".run.lock"}
    else:
        assert code == 75 and lines[-1].startswith("preempted: stopped by Ctrl-C after step "), text[-3000:]
        newest_checkpoint(out)


@pytest.mark.floor
@pytest.mark.slow
def test_ctrl_c_during_training_stops_at_a_checkpoint(tiny_lm, tmp_path):
    """Ctrl-C reaches launch.sh alone (the launcher's process group is not the terminal's); it
    passes SIGTERM on, and the processes stop as on a preemption. Signals that follow (Ctrl-C
    pressed again, scancel's SIGTERM to every process) do not cut the launcher's wait for the
    checkpoint short."""
    out = tmp_path / "run"
    proc, _, err = start(["lm_finetune", *lm_args(tiny_lm, out, *LONG_RUN)], cpu_env())
    with session_killed_at_exit(proc):
        training(proc, out)
        (launcher,) = [p for p in processes_of(out) if "scripts/launcher.py" in " ".join(p.info["cmdline"])]
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.05)  # handled apart from the first (two pending ones would be one); the stop takes longer
        os.kill(proc.pid, signal.SIGINT)
        for _ in range(3):
            launcher.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)
    text = read(err)
    assert proc.returncode == 75, text[-3000:]
    no_noise(text)
    checkpoint = newest_checkpoint(out)
    said = [line for line in text.splitlines() if line.startswith(("launch.sh:", "preempted:", "error:"))]
    step = checkpoint.name.split("-")[1]
    assert said[-1] in (  # one line, the process's, naming the stop launch.sh passed on as SIGTERM
        f"preempted: stopped by Ctrl-C {during}after step {step}; saved {checkpoint}. Continue with "
        "--resume_from_checkpoint latest (exit code 75)"
        for during in ("", "during evaluation ")
    ), text[-3000:]
    assert said[:-1] in (
        [],
        [
            "launch.sh: stopping: waiting for the processes to save a checkpoint (at most "
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120 s)"
        ],
    ), said
    assert not processes_of(out)


@pytest.mark.slow
def test_ctrl_c_as_the_run_claims_its_folder_leaves_nothing_half_done(tiny_lm, tmp_path):
    """Ctrl-C the moment the run has locked its --output_dir: the processes are checking that they can
    write there, before they record stop signals, and end at once on the SIGTERM passed on to them.
    None leaves a file of that check behind. The signal may also come later, once they record it:
    then they stop at a checkpoint. Either way the last line says which, the folder holds just that,
    and the same command with --resume_from_checkpoint latest finishes the run. SIGTERM to that run after it wrote
    its results, while its processes exit: the run is complete, and launch.sh says so with exit 0, not that it stopped
    without a checkpoint."""
    out = tmp_path / "run"
    args = [
        "lm_finetune",
        "--num_processes",
        "2",
        *lm_args(tiny_lm, out, "--max_train_steps", "4", "--checkpointing_steps", "2"),
    ]
    code, text = stop_when(args, out, lambda _: (out / ".run.lock").exists())
    no_noise(text)
    last = text.rstrip().splitlines()[-1]
    if code == 130:  # said by the processes, or by launch.sh where they had no handlers yet
        assert last in stopped_before_training("Ctrl-C"), text
        assert not out.exists() or {p.name for p in out.iterdir()} <= {".run.lock"}
    else:
        assert code == 75 and last.startswith("preempted: stopped by Ctrl-C after step "), text[-3000:]
        newest_checkpoint(out)
        assert {p.name for p in out.iterdir() if not p.name.startswith("checkpoint-")} <= {".run.lock"}
    written = lambda _: (out / "results.json").exists()  # noqa: E731
    code, text = stop_when([*args, "--resume_from_checkpoint", "latest"], out, written, signal.SIGTERM)
    assert code == 0, text[-3000:]
    assert results(out)["steps"] == 4
    if "SIGTERM came" in text:  # the processes were still exiting when it arrived
        assert text.rstrip().splitlines()[-1] == (
            "launch.sh: the run had finished when SIGTERM came; its model and results.json are complete (exit 0)"
        )


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_launch_sh_prepares_is_one_line(tiny_lm, tmp_path, sig):
    """Ctrl-C (to the terminal's process group) or SIGTERM to launch.sh alone, as the launcher starts (Python
    itself is starting, or the launcher reads the config, prints the command, imports torch): one line saying
    nothing was saved, not a KeyboardInterrupt traceback, and exit 130 for Ctrl-C, 75 for SIGTERM (a requeued
    job starts again). The signal may land a little later, as the processes start: the line says so."""
    out = tmp_path / "run"

    def helper_running(proc):  # the launcher, from its first instant
        try:
            return any("scripts/launcher.py" in " ".join(p.cmdline()) for p in psutil.Process(proc.pid).children())
        except psutil.Error:  # launch.sh (or that child) has just ended
            return proc.poll() is not None

    args = ["lm_finetune", *lm_args(tiny_lm, out, *LONG_RUN)]
    code, text = stop_when(args, out, helper_running, sig, group=sig == signal.SIGINT)
    no_noise(text)
    by = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert code == (130 if sig == signal.SIGINT else 75), text
    lines = [line for line in text.splitlines() if not line.startswith("+ ")]
    assert len(lines) == 1 and lines[0] in stopped_before_training(by), text
    assert not out.exists() or {p.name for p in out.iterdir()} <= {".run.lock"}


def stopped_before_training(by: str) -> list:
    """The one line of a stop launch.sh passed on before training: its own, or the processes' once they record one."""
    code = 130 if by == "Ctrl-C" else 75
    theirs = (
        "interrupted by Ctrl-C: nothing was saved after the last checkpoint"
        if by == "Ctrl-C"
        else f"preempted: stopped by {by} before training started; nothing to save, run it again (exit 75)"
    )
    return [
        f"launch.sh: stopped by {by} before the processes started; nothing was saved (exit {code})",
        f"launch.sh: stopped by {by} before training; nothing was saved (exit {code})",
        theirs,
    ]


@pytest.mark.slow
def test_a_stop_sent_to_the_training_processes_as_they_start_is_a_stop(tiny_lm, tmp_path):
    """SIGTERM to the training processes themselves (a cgroup's kill under Slurm) in their first instants, while
    they import torch and before their handlers exist: it kills them, and launch.sh reports the stop (exit 75, a
    requeued job starts again), not a process killed by a signal (143)."""
    out = tmp_path / "run"
    proc, _, err = start(["lm_finetune", "--num_processes", "2", *lm_args(tiny_lm, out, *LONG_RUN)], cpu_env())
    try:

        def training_processes():
            # the command line read as they were listed: one that ended since is a zombie, whose cmdline() raises
            return [p for p in processes_of(out) if "recipes/lm_finetune.py" in " ".join(p.info["cmdline"][1:3])]

        wait_until(lambda: len(training_processes()) == 2 or proc.poll() is not None, 120, "no training processes")
        for p in training_processes():
            p.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        for p in processes_of(out):
            p.kill()
    text = read(err)
    no_noise(text)
    assert code == 75 and "killed by" not in text, text[-3000:]


def test_variables_left_from_another_job_do_not_make_a_process_of_one_a_rank(tiny_lm, tmp_path):
    """WORLD_SIZE and RANK left in the shell by another job: the recipe started by hand with them says so in one line.
    (launch.sh's process of one trains alone with them: the launcher-kill test's runs.)"""
    env = cpu_env(WORLD_SIZE="4", RANK="2")
    by_hand = tmp_path / "by_hand"
    proc = run([BIN / "python", REPO / "recipes/lm_finetune.py", *lm_args(tiny_lm, by_hand)], env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: WORLD_SIZE=4 RANK=2 are set, but no launcher started this process as one of a group (no MASTER_ADDR): "
        "left from another job? unset WORLD_SIZE and RANK, and start the processes with ./launch.sh or accelerate "
        "launch"
    ), proc.stderr[-2000:]
    assert not by_hand.exists()
    for stale, missing in (
        ({"LOCAL_RANK": "1"}, "WORLD_SIZE or RANK or MASTER_ADDR"),
        (
            {"WORLD_SIZE": "1", "RANK": "0"},
            "MASTER_ADDR",  # torch's env:// would fail on each in a traceback
        ),
    ):
        env = {k: v for k, v in cpu_env(**stale).items() if k not in ("WORLD_SIZE", "RANK") or k in stale}
        proc = run([BIN / "python", REPO / "recipes/lm_finetune.py", *lm_args(tiny_lm, by_hand)], env=env, check=False)
        lines = error_lines(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1 and f"of a group (no {missing}): left" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr and not by_hand.exists()


@pytest.mark.slow
def test_gpus_nvidia_smi_lists_but_torch_cannot_use_are_named_and_the_fix_runs(gpus, digits, tmp_path):
    """nvidia-smi lists 2 GPUs (faked), this torch has no CUDA: launch.sh picks the 2-GPU config, and the processes
    say that the two tools disagree, not that they formed no group (whose advice, ./launch.sh, was what ran). The
    fix the line gives, followed literally, trains."""
    out = tmp_path / "run"
    args = digits_args(
        digits, out, "--model", "resnet18", "--max_train_steps", "1", "--per_device_train_batch_size", "8"
    )
    proc = run([LAUNCH, "cifar", *args], env=gpus(2), check=False)
    (line,) = error_lines(proc.stderr)
    assert proc.returncode == 2 and line.startswith("error: nvidia-smi lists 2 GPU(s) but this torch ("), line
    assert line.endswith("or train on the CPU: ./launch.sh --config cpu") and not out.exists(), line
    run([LAUNCH, "cifar", "--config", "cpu", *args], env=gpus(2))
    assert results(out)["steps"] == 1
