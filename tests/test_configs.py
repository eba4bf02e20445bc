"""Every YAML in accelerate_configs/ is data accelerate accepts: parsed with accelerate's own
loader (unknown keys are errors there) and resolved by its launch-argument validation."""

from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from conftest import REPO

CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))


def test_the_expected_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"1gpu", "2gpu", "4gpu", "8gpu", "multi_node", "cpu"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid_for_accelerate(path: Path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 20, "each config starts with a one-line comment on its purpose"
    config = ClusterConfig.from_yaml_file(path)
    raw = yaml.safe_load(path.read_text())
    assert config.num_processes == raw["num_processes"]
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.num_processes == raw["num_processes"]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_gpu_configs_are_ddp_bf16(n):
    raw = yaml.safe_load((REPO / f"accelerate_configs/{n}gpu.yaml").read_text())
    assert raw["num_processes"] == n and raw["mixed_precision"] == "bf16" and raw["use_cpu"] is False
    assert raw["distributed_type"] == ("NO" if n == 1 else "MULTI_GPU")


def test_cpu_config_is_the_multi_process_cpu_path():
    raw = yaml.safe_load((REPO / "accelerate_configs/cpu.yaml").read_text())
    # MULTI_CPU would make accelerate start a single process; MULTI_GPU + use_cpu + the
    # ACCELERATE_USE_CPU variable gives N processes in one gloo group.
    assert raw["distributed_type"] == "MULTI_GPU" and raw["use_cpu"] is True and raw["mixed_precision"] == "no"


def test_multi_node_marks_what_to_fill_in():
    text = (REPO / "accelerate_configs/multi_node.yaml").read_text()
    for key in ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "num_processes"):
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"{key}:")]
        assert "FILL IN" in line, key


@pytest.mark.parametrize(
    "name, stage, offload", [("zero2", 2, "none"), ("zero3", 3, "none"), ("zero3_offload", 3, "cpu")]
)
def test_zero_configs_leave_batch_and_accumulation_to_the_recipe(name, stage, offload):
    raw = yaml.safe_load((REPO / f"accelerate_configs/{name}.yaml").read_text())
    ds = raw["deepspeed_config"]
    assert raw["distributed_type"] == "DEEPSPEED" and ds["zero_stage"] == stage
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == offload
    # Filled from the recipe at prepare time ("auto"); a fixed value here could contradict it.
    assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds
    if stage == 3:  # built partitioned, and saved as gathered 16-bit weights rather than an empty file
        assert ds["zero3_init_flag"] is True and ds["zero3_save_16bit_model"] is True


def test_fsdp_config_builds_an_fsdp2_full_shard_plugin(monkeypatch):
    """FSDP cannot run on CPU; what can be checked here is that accelerate turns the file into the
    plugin we mean: the launcher's environment for it, then the plugin built from that."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(REPO / "accelerate_configs/fsdp.yaml"), "train.py"]
    )
    args, _, _ = _validate_launch_command(args)
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.cpu_ram_efficient_loading
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
