"""launch.sh: config choice from the GPUs present, overrides, and its errors. GPUs are faked with
an nvidia-smi on PATH that lists them, the way the real one does."""

import os
import stat

import pytest

from conftest import REPO, run, user_env

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


def dry_run(env, *args):
    proc = run([LAUNCH, "cifar", "--dry_run", *args], env=env)
    (line,) = [l for l in proc.stderr.splitlines() if l.startswith("+ ")]
    return line


def test_help():
    proc = run([LAUNCH, "--help"])
    assert proc.stdout.startswith("Usage: ./launch.sh RECIPE")


@pytest.mark.parametrize("n, config, extra", [
    (1, "1gpu.yaml", ""), (2, "2gpu.yaml", ""), (4, "4gpu.yaml", ""), (8, "8gpu.yaml", ""),
    (3, "2gpu.yaml", "--num_processes 3"),
])
def test_config_follows_the_gpus_present(gpus, n, config, extra):
    line = dry_run(gpus(n), "--learning_rate", "0.2")
    assert f"accelerate_configs/{config}" in line and "ACCELERATE_USE_CPU" not in line
    assert extra in line and line.rstrip().endswith("recipes/cifar.py --learning_rate 0.2")


def test_cuda_visible_devices_narrows_the_count(gpus):
    assert "accelerate_configs/2gpu.yaml" in dry_run(gpus(8, CUDA_VISIBLE_DEVICES="3,5"))


def test_no_gpu_runs_cpu_processes_in_one_group(gpus):
    line = dry_run(gpus(0), "--num_processes", "3")
    assert line.startswith("+ ACCELERATE_USE_CPU=true ") and "accelerate_configs/cpu.yaml --num_processes 3" in line
    assert " --cpu " not in line


def test_one_cpu_process_forms_no_group_unless_it_may_restart(gpus):
    """--cpu: no DistributedDataParallel of one process (benchmarks/README.md); --max_restarts
    needs torchrun's agent, which forms the group."""
    line = dry_run(gpus(0), "--num_processes", "1")
    assert "--num_processes 1 " in line and " --cpu " in line
    assert " --cpu " not in dry_run(gpus(0), "--num_processes", "1", "--max_restarts", "2")


def test_overrides_and_master_port(gpus):
    line = dry_run(gpus(8, MASTER_PORT="29777"), "--config", "4gpu", "--num_processes", "2")
    assert "accelerate_configs/4gpu.yaml --num_processes 2 --main_process_port 29777" in line


def one_error(proc, text):
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(lines) == 1 and text in lines[0], proc.stderr
    return lines[0]


def test_more_processes_than_gpus_is_refused(gpus):
    line = one_error(run([LAUNCH, "cifar", "--num_processes", "4"], env=gpus(2), check=False),
                     "4 processes requested on this node but only 2 GPU(s) are visible")
    assert "--num_processes 2" in line


def test_gpu_config_on_a_cpu_host_is_refused(gpus):
    one_error(run([LAUNCH, "cifar", "--config", "4gpu"], env=gpus(0), check=False), "use --config cpu")


def test_unknown_config_and_recipe():
    line = one_error(run([LAUNCH, "cifar", "--config", "16gpu"], check=False), "unknown config '16gpu'")
    assert "available: 1gpu 2gpu 4gpu 8gpu cpu" in line
    one_error(run([LAUNCH, "imagenet"], check=False), "unknown recipe 'imagenet' (available: cifar")
    one_error(run([LAUNCH, "cifar", "--num_processes", "two"], check=False), "positive integer")
