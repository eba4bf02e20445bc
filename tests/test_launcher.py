"""scripts/launcher.py, in-process and with plain Python processes for recipes (no training): the printed
command with credentials masked, accelerate configs read and checked, the parent-death signal, the stop
signals (each process gets one SIGTERM, later signals wait, a stop under --max_restarts restarts nothing), and
which exit code a failed or stopped launch ends with. launch.sh through real launches: tests/test_launch_sh.py."""

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import launcher
import psutil
import pytest
from conftest import REPO, cpu_env, free_port, started_by_accelerate_launch
from packaging.version import Version

TOKEN = "hf_" + "Zx9" * 10


@pytest.mark.parametrize(
    "words, shown",
    [
        (["--hub_token", TOKEN, "--lr", "1"], ["--hub_token", "'***'", "--lr", "1"]),
        ([f"--hub_token={TOKEN}"], ["'--hub_token=***'"]),
        (["--wandb-api-key", "0123abcd", "--x"], ["--wandb-api-key", "'***'", "--x"]),
        (
            ["--api_key", "k", "--client_secret", "s", "--db_password", "p"],
            ["--api_key", "'***'", "--client_secret", "'***'", "--db_password", "'***'"],
        ),
        (["--model_name_or_path", TOKEN], ["--model_name_or_path", "'***'"]),  # a hub token as any value
        (["--dataset_name", "https://user:pa55@host.org/d"], ["--dataset_name", "'https://***@host.org/d'"]),
        (["HF_TOKEN=" + TOKEN, "accelerate"], ["'HF_TOKEN=***'", "accelerate"]),
        # named like, but not, credentials; a flag without a value before the next flag
        (["--tokenizer_name", "gpt2", "--max_tokens", "512"], ["--tokenizer_name", "gpt2", "--max_tokens", "512"]),
        (["--use_auth_token", "--push_to_hub"], ["--use_auth_token", "--push_to_hub"]),
        (["--hub_token"], ["--hub_token"]),
    ],
)
def test_the_printed_command_masks_credentials(words, shown):
    assert launcher.show(words) == "+ " + " ".join(shown)


def test_show_quotes_for_the_shell():
    line = launcher.show(["ACCELERATE_USE_CPU=true", "/a b/accelerate", "launch", "--rdzv_conf", "is_host=1,x=60"])
    assert line == "+ ACCELERATE_USE_CPU=true '/a b/accelerate' launch --rdzv_conf is_host=1,x=60"


@pytest.mark.parametrize("path", sorted((REPO / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_configs_read_as_yaml(path):
    import yaml

    raw = yaml.safe_load(path.read_text())
    keys = ("num_machines", "num_processes", "distributed_type", "use_cpu")
    assert launcher.read_config(path)[:4] == tuple(raw[key] for key in keys)


@pytest.mark.parametrize(
    "text, message",
    [
        ("num_processes: two\n", "num_processes must be a whole number from 1, got 'two'"),
        ("num_processes: 0\n", "num_processes must be a whole number from 1, got 0"),
        ("num_machines: true\n", "num_machines must be a whole number from 1, got True"),
        ("num_processes:\n", "num_processes must be a whole number from 1, got None"),
        ("use_cpu: 'yes'\n", "use_cpu must be true or false, got 'yes'"),
        ("main_process_port: 295000\n", "main_process_port must be a TCP port number from 1 to 65535, got 295000"),
        ("- a list\n", "not an accelerate config"),
        ("", "not an accelerate config"),
        ("num_processes: [2\n", "not a readable YAML file (expected ',' or ']', but got '<stream end>' at line 2)"),
        ("a: 1\n\tb: 2\n", "not a readable YAML file (found character '\\t' that cannot start any token at line 2)"),
    ],
)
def test_bad_configs_are_named(tmp_path, capfd, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit, match="2"):
        launcher.read_config(path)
    said = capfd.readouterr().err
    assert said.startswith(f"launch.sh: error: {path}: ") and message in said and said.count("\n") == 1


# ---------------------------------------------------------------- the launch refusals (common.preflight), once


def group(n: int, **more) -> dict:
    """The environment a launcher gives each of `n` processes on one node, and `more` (the config's, passed on)."""
    return {"WORLD_SIZE": str(n), "RANK": "0", "MASTER_ADDR": "127.0.0.1", "LOCAL_WORLD_SIZE": str(n), **more}


MESH = dict(ACCELERATE_USE_PARALLELISM_CONFIG="true")
PASSES = "passes"
# (environment, GPUs visible, versions installed, the subject of the first refusal, or PASSES)
PREFLIGHT = {
    "one process": ({}, 0, {}, PASSES),
    "a group on CPU": (group(2), 0, {}, PASSES),
    "stale WORLD_SIZE and RANK": ({"WORLD_SIZE": "4", "RANK": "2"}, 0, {}, "$WORLD_SIZE"),
    "stale LOCAL_RANK": ({"LOCAL_RANK": "1"}, 0, {}, "$LOCAL_RANK"),
    "ranks without MASTER_ADDR": ({"WORLD_SIZE": "1", "RANK": "0"}, 0, {}, "$WORLD_SIZE"),
    "torch 2.7, several processes": (group(2), 0, {"torch": "2.7.1"}, None),
    "torch 2.7, one process": ({}, 0, {"torch": "2.7.1"}, PASSES),
    "torch 2.8, FSDP2 on CPU": (group(2, ACCELERATE_USE_FSDP="true"), 0, {"torch": "2.8.0"}, None),
    "torch 2.8, FSDP2 on GPUs": (group(2, ACCELERATE_USE_FSDP="true"), 2, {"torch": "2.8.0"}, PASSES),
    "torch 2.8, DDP on CPU": (group(2), 0, {"torch": "2.8.0"}, PASSES),
    "context parallelism": (
        group(4, **MESH, PARALLELISM_CONFIG_CP_SIZE="2", PARALLELISM_CONFIG_DP_SHARD_SIZE="2"),
        0,
        {},
        "parallelism_config_cp_size",
    ),  # fmt: skip
    "a mesh short of the processes": (
        group(4, **MESH, PARALLELISM_CONFIG_TP_SIZE="2"),
        0,
        {},
        "--parallelism_config_dp_shard_size",
    ),  # fmt: skip
    "a mesh larger than the processes": (
        group(2, **MESH, PARALLELISM_CONFIG_TP_SIZE="4"),
        0,
        {},
        "--num_processes",
    ),  # fmt: skip
    "a mesh size not a number": (
        group(2, **MESH, PARALLELISM_CONFIG_TP_SIZE="two"),
        0,
        {},
        "parallelism_config_tp_size",
    ),  # fmt: skip
    "a 2-D mesh on accelerate 1.10": (
        group(4, **MESH, PARALLELISM_CONFIG_TP_SIZE="2", PARALLELISM_CONFIG_DP_SHARD_SIZE="2"),
        0,
        {"accelerate": "1.10.0"},
        None,
    ),  # fmt: skip
    "a 2-D mesh on accelerate 1.15": (
        group(4, **MESH, PARALLELISM_CONFIG_TP_SIZE="2", PARALLELISM_CONFIG_DP_SHARD_SIZE="2"),
        0,
        {},
        PASSES,
    ),  # fmt: skip
    "4 processes, 2 GPUs": (group(4), 2, {}, "--num_processes"),
    "4 processes, 2 GPUs, on the CPU": (group(4, ACCELERATE_USE_CPU="true"), 2, {}, PASSES),
    "2 processes, 2 GPUs": (group(2), 2, {}, PASSES),
    "fp16 on the CPU": (
        group(2, ACCELERATE_USE_CPU="true", ACCELERATE_MIXED_PRECISION="fp16"),
        2,
        {},
        "--mixed_precision",
    ),
    "fp16 on GPUs": (group(2, ACCELERATE_MIXED_PRECISION="fp16"), 2, {}, PASSES),
    "bf16 on the CPU": (group(2, ACCELERATE_MIXED_PRECISION="bf16"), 0, {}, PASSES),
    "DeepSpeed under ACCELERATE_USE_CPU": (
        group(2, ACCELERATE_USE_CPU="true", ACCELERATE_USE_DEEPSPEED="true"),
        0,
        {},
        "$ACCELERATE_USE_CPU",
    ),  # fmt: skip
    "FSDP under ACCELERATE_USE_CPU, no GPU": (
        group(2, ACCELERATE_USE_CPU="true", ACCELERATE_USE_FSDP="true"),
        0,
        {},
        PASSES,
    ),
    "FSDP under ACCELERATE_USE_CPU, GPUs": (
        group(2, ACCELERATE_USE_CPU="true", ACCELERATE_USE_FSDP="true"),
        2,
        {},
        "$ACCELERATE_USE_CPU",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", PREFLIGHT)
def test_each_launch_refusal_names_its_subject(case):
    """Each rule of common.preflight, a pure function of the environment, the GPUs and the versions: the first refusal
    is one line, and names its subject (a variable as $NAME, an option, a config's key; none for a library's
    version), which make_accelerator raises (preflight.check) before any process group forms."""
    from common import preflight
    from common.errors import RecipeError

    environ, gpus, versions, subject = PREFLIGHT[case]
    versions = {"torch": "2.9.0", "accelerate": "1.15.0", **versions}
    found = preflight.refusals(environ, gpus, versions)
    if subject == PASSES:
        assert found == [] and preflight.check(environ, gpus, versions) is None
        return
    refusal = found[0]
    line = str(refusal)
    assert isinstance(refusal, RecipeError) and refusal.subject == subject and "\n" not in line
    assert subject is None or subject.lstrip("$") in line
    with pytest.raises(RecipeError) as raised:
        preflight.check(environ, gpus, versions)
    assert str(raised.value) == line


def deepspeed_file(folder: Path, fp16) -> Path:
    """A DeepSpeed JSON config file whose fp16 section says "enabled": `fp16` (none for None)."""
    path = folder / "ds.json"
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    path.write_text(json.dumps(config if fp16 is None else {**config, "fp16": {"enabled": fp16}}))
    return path


FP16 = "mixed precision fp16 needs a GPU: on CPU Accelerate trains in fp32 and would still report fp16; "
ZERO2, ZERO3 = REPO / "accelerate_configs/zero2.yaml", REPO / "accelerate_configs/zero3.yaml"
# (accelerate launch's options, a DeepSpeed file's fp16 "enabled" or None, what the shell exported, the line or PASSES)
LAUNCHES = {
    "fp16 under zero2.yaml": (
        ["--config_file", ZERO2, "--mixed_precision", "fp16"], None, {},
        FP16 + "pass --mixed_precision bf16 (or no) to accelerate launch, or set it in the config",
    ),
    "fp16 a DeepSpeed file enables, with --mixed_precision no": (
        ["--use_deepspeed", "--deepspeed_config_file", "{file}", "--mixed_precision", "no"], True, {},
        FP16 + 'set fp16\'s "enabled" to false (or "auto") in the DeepSpeed config file {file}',
    ),
    "--mixed_precision fp16 a DeepSpeed file leaves to it": (
        ["--use_deepspeed", "--deepspeed_config_file", "{file}", "--mixed_precision", "fp16"], "auto", {},
        FP16 + "pass --mixed_precision bf16 (or no) to accelerate launch, or set it in the config",
    ),
    "--mixed_precision fp16 a DeepSpeed file turns off": (
        ["--use_deepspeed", "--deepspeed_config_file", "{file}", "--mixed_precision", "fp16"], False, {}, PASSES,
    ),
    "zero3.yaml with ACCELERATE_USE_CPU=true exported": (
        ["--config_file", ZERO3, "--mixed_precision", "no"], None, {"ACCELERATE_USE_CPU": "true"},
        "the accelerate config asks for DEEPSPEED, which Accelerate leaves out under ACCELERATE_USE_CPU=true; unset "
        "it: DEEPSPEED runs on CPU without it (./launch.sh --config zero3)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", LAUNCHES)
def test_what_accelerate_launch_passes_on_is_refused_before_the_group_forms(case, tmp_path, monkeypatch):
    """fp16 on the CPU (Accelerate would train fp32 and report fp16), asked by --mixed_precision or by a DeepSpeed
    file's fp16 section, which decides over it; a DeepSpeed config under ACCELERATE_USE_CPU=true (Accelerate would
    drop DeepSpeed): refused by common.preflight from the environment `accelerate launch --num_processes 2` gives
    its processes on this host without GPUs (accelerate's launcher run here, up to torchrun's start), one line."""
    from common import preflight

    launch, fp16, exported, line = LAUNCHES[case]
    file = deepspeed_file(tmp_path, fp16)
    launch = [str(word).replace("{file}", str(file)) for word in launch]
    environ = started_by_accelerate_launch(monkeypatch, free_port(), *launch, "--num_processes", "2", **exported)[0]
    environ = {**environ, "RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    found = preflight.refusals(
        environ, 0, {name: importlib.metadata.version(name) for name in ("torch", "accelerate")}
    )
    assert [str(refusal) for refusal in found] == ([] if line == PASSES else [line.replace("{file}", str(file))])


SETTINGS = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping")
GATHER, STAGE_2 = "stage3_gather_16bit_weights_on_model_save", {"zero_optimization": {"stage": 2}}
# (the accelerate config: zero3.yaml with a replacement, or a DeepSpeed file's settings; --max_grad_norm; the subject)
DEEPSPEED = {
    "zero3.yaml": (("zero3", "", ""), 1.0, PASSES),
    "zero3.yaml clipping at another norm, without the gather": (
        ("zero3", "zero3_save_16bit_model: true", "gradient_clipping: 0.01"), 1.0, "--max_grad_norm",
    ),
    "zero3.yaml without the gather": (
        ("zero3", "zero3_save_16bit_model: true", "gradient_clipping: 0.01"), 0.01, "zero3_save_16bit_model",
    ),
    "zero2.yaml accumulating 4": (("zero2", "zero_stage: 2", "zero_stage: 2\n  gradient_accumulation_steps: 4"), 1.0,
                                  "--gradient_accumulation_steps"),
    "a file's micro-batch": ({**STAGE_2, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4}, 1.0,
                             "--per_device_train_batch_size"),
    "a file's total batch": ({**STAGE_2, "gradient_accumulation_steps": 2, "train_batch_size": 64}, 1.0,
                             "train_batch_size"),
    "a file without accumulation (Accelerate's 1)": (STAGE_2, 1.0, "--gradient_accumulation_steps"),
    "a file of auto": ({**STAGE_2, **dict.fromkeys(SETTINGS, "auto")}, 1.0, PASSES),
}  # fmt: skip


@pytest.mark.parametrize("case", DEEPSPEED)
def test_a_deepspeed_config_at_odds_with_the_flags_is_refused_before_the_group_forms(case, tmp_path, monkeypatch):
    """The DeepSpeed config as accelerate launch passes it on (an accelerate config's deepspeed_config, or a DeepSpeed
    file it names), read by common.preflight as Accelerate's DeepSpeedPlugin reads it (the same settings, compared
    here); where its batch, accumulation or clipping is not the flags' (per device 8, accumulation 2, 2 processes),
    or ZeRO-3 lacks the 16-bit gather, refused before the group forms, naming the flag or the config's key. Through
    launch.sh in 2 DeepSpeed processes, each fix followed: tests/test_fixes.py."""
    from accelerate.utils import DeepSpeedPlugin

    from common import preflight

    config, max_grad_norm, subject = DEEPSPEED[case]
    if isinstance(config, tuple):  # an accelerate config
        name, old, new = config
        path = tmp_path / f"{name}.yaml"
        text = (REPO / f"accelerate_configs/{name}.yaml").read_text()
        path.write_text(text.replace(old, new) if old else text)
        launch = ["--config_file", path]
    else:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        launch = ["--use_deepspeed", "--deepspeed_config_file", path]
    launch += ["--mixed_precision", "no", "--num_processes", "2"]
    environ = started_by_accelerate_launch(monkeypatch, free_port(), *launch)[0]
    ours = preflight.deepspeed_config(environ)
    for name in [name for name in os.environ if name.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    theirs = DeepSpeedPlugin().deepspeed_config  # what Accelerate's plugin holds, "auto" not yet filled
    assert {key: ours.get(key, "auto") for key in SETTINGS} == {key: theirs.get(key, "auto") for key in SETTINGS}
    assert ours["zero_optimization"]["stage"] == theirs["zero_optimization"]["stage"]
    assert (ours["zero_optimization"].get(GATHER) is True) == (theirs["zero_optimization"].get(GATHER) is True)
    args = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=max_grad_norm)
    environ = {**environ, **group(2)}
    versions = {name: importlib.metadata.version(name) for name in ("torch", "accelerate")}
    found = preflight.refusals(environ, 0, versions, args)
    if subject == PASSES:
        assert found == [] and preflight.refusals(environ, 0, versions) == []
        return
    assert found[-1].subject == subject and subject in str(found[-1]) and "\n" not in str(found[-1])
    assert list(map(str, preflight.refusals(environ, 0, versions))) == list(map(str, found[:-1]))  # the arguments'


def launched(argv: list[str], gpus: int, monkeypatch, capfd) -> str | None:
    """launch.sh's launcher in this process (--dry_run: nothing starts), with `gpus` visible: its refusal's line
    without its prefix, or None when it would launch."""
    from unittest import mock

    monkeypatch.setattr(launcher, "count_gpus", lambda: gpus)
    capfd.readouterr()
    with mock.patch.dict(os.environ):  # what it exports for the processes goes with the test
        try:
            assert launcher.main([*argv, "--dry_run"]) == 0
            return None
        except SystemExit as exit_:
            assert exit_.code == 2
    (line,) = [ln for ln in capfd.readouterr().err.splitlines() if "error" in ln]
    return line.removeprefix("launch.sh: error: ")


@pytest.mark.parametrize("per_node, gpus", [(4, 2), (2, 2), (1, 2), (8, 4), (3, 4), (5, 4)])
def test_the_launcher_and_the_recipe_refuse_the_same_gpu_counts(per_node, gpus, monkeypatch, capfd):
    """More processes on a node than GPUs: refused by launch.sh before it starts them and by the processes of a plain
    accelerate launch, in the same line (one rule, common.preflight)."""
    from common import preflight

    said = launched(["cifar", "--config", "4gpu", "--num_processes", str(per_node)], gpus, monkeypatch, capfd)
    versions = {name: importlib.metadata.version(name) for name in ("torch", "accelerate")}
    refusals = preflight.refusals(group(per_node), gpus, versions)
    assert said == (str(refusals[0]) if refusals else None)
    assert (said is not None) == (per_node > gpus)


CPU_FLAG, ZERO = {"ACCELERATE_USE_CPU": "true"}, {"ACCELERATE_USE_DEEPSPEED": "true"}


@pytest.mark.parametrize(
    "argv, exported, environ",
    [  # launch.sh's options, what the shell exported, and what accelerate launch passes its processes
        (["--config", "cpu", "--mixed_precision", "fp16"], {}, {**CPU_FLAG, "ACCELERATE_MIXED_PRECISION": "fp16"}),
        (["--config", "zero2", "--mixed_precision", "fp16"], {}, {**ZERO, "ACCELERATE_MIXED_PRECISION": "fp16"}),
        (["--config", "zero2"], {}, {**ZERO, "ACCELERATE_MIXED_PRECISION": "no"}),
        (["--config", "zero3"], CPU_FLAG, {**CPU_FLAG, **ZERO}),
        (["--config", "fsdp"], CPU_FLAG, {**CPU_FLAG, "ACCELERATE_USE_FSDP": "true"}),
    ],
)  # fmt: skip
def test_the_launcher_and_the_recipe_refuse_the_same_precision_and_cpu_flag(
    argv, exported, environ, monkeypatch, capfd
):
    """fp16 on a host without GPUs, and a DeepSpeed config under an exported ACCELERATE_USE_CPU=true: refused by
    launch.sh before it starts the processes, in the line they would say (one rule each, common.preflight); the
    configs' bf16 on CPU, which launch.sh turns to no, and FSDP2 on CPU under the flag, start."""
    from common import preflight

    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    said = launched(["lm_finetune", *argv], 0, monkeypatch, capfd)
    versions = {name: importlib.metadata.version(name) for name in ("torch", "accelerate")}
    refusals = preflight.refusals(group(2, **environ), 0, versions)
    assert said == (str(refusals[0]) if refusals else None)
    fsdp_right = Version(versions["torch"]).release >= (2, 9)  # else FSDP2 on CPU is refused (known_bad_torch)
    assert (said is None) == (argv == ["--config", "zero2"] or ("fsdp" in argv and fsdp_right))


@pytest.mark.parametrize("cp", [1, 2])
def test_the_launcher_and_the_recipe_refuse_the_same_mesh(cp, tmp_path, monkeypatch, capfd):
    """Context parallelism in a config's mesh: launch.sh refuses it naming the config file, in the line the processes
    of a plain accelerate launch say."""
    from common import mesh, preflight

    config = tmp_path / "cp.yaml"
    config.write_text((REPO / "accelerate_configs/hsdp.yaml").read_text().replace("cp_size: 1", f"cp_size: {cp}"))
    said = launched(["lm_finetune", "--config", str(config), "--num_processes", "8"], 0, monkeypatch, capfd)
    sizes = {"DP_REPLICATE": "2", "DP_SHARD": str(4 // cp), "TP": "1", "CP": str(cp)}
    environ = group(8, **MESH, **{f"PARALLELISM_CONFIG_{dim}_SIZE": size for dim, size in sizes.items()})
    versions = {name: importlib.metadata.version(name) for name in ("torch", "accelerate")}
    refusals = preflight.refusals({**environ, "ACCELERATE_USE_FSDP": "true"}, 0, versions)  # hsdp.yaml is FSDP's
    assert (said or "").removeprefix(f"{config.name}: ") == (str(refusals[0]) if refusals else "")
    tested = Version(versions["accelerate"]).release >= mesh.TESTED_ACCELERATE  # else a 2-D mesh is refused too
    fsdp_right = Version(versions["torch"]).release >= (2, 9)  # else FSDP2 on CPU is refused first (known_bad_torch)
    assert (said is not None) == (cp > 1 or not tested or not fsdp_right)


def test_the_launcher_and_the_recipe_refuse_tensor_parallelism_in_an_fsdp_config(tmp_path, monkeypatch, capfd):
    """hsdp.yaml (FSDP) with a TP size: launch.sh refuses it naming the config file, in the line the processes of a
    plain accelerate launch say (common.preflight.unsplittable)."""
    from common import preflight

    config = tmp_path / "hsdp_tp.yaml"
    config.write_text((REPO / "accelerate_configs/hsdp.yaml").read_text().replace("tp_size: 1", "tp_size: 2"))
    said = launched(["lm_finetune", "--config", str(config), "--num_processes", "8"], 0, monkeypatch, capfd)
    sizes = {"DP_REPLICATE": "2", "DP_SHARD": "2", "TP": "2", "CP": "1"}
    environ = group(8, **MESH, **{f"PARALLELISM_CONFIG_{dim}_SIZE": size for dim, size in sizes.items()})
    environ["ACCELERATE_USE_FSDP"] = "true"
    installed = {name: importlib.metadata.version(name) for name in ("torch", "accelerate")}  # the launcher's
    assert (said or "").removeprefix(f"{config.name}: ") == str(preflight.refusals(environ, 0, installed)[0])
    (refusal,) = preflight.refusals(environ, 0, {"torch": "2.9.0", "accelerate": "1.15.0"})  # on tested versions
    assert refusal.subject == "parallelism_config_tp_size"  # the floor's torch is refused first (known_bad_torch)


# ---------------------------------------------------------------- the parent-death signal (common.runtime's)

CHILD = """
import pathlib, signal, sys, time
sys.path.insert(0, {root!r})
from common.runtime import die_with_parent
done = pathlib.Path({done!r})
signal.signal(signal.SIGTERM, lambda *_: (done.write_text("SIGTERM"), sys.exit(0)))
assert die_with_parent(signal.SIGTERM, {parent})
pathlib.Path({ready!r}).write_text("ready")
time.sleep(60)
"""


def wait_for(path: Path, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow  # the child imports torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_process_gets_sigterm_when_its_parent_is_killed(tmp_path):
    done, ready = tmp_path / "done", tmp_path / "ready"
    child = CHILD.format(root=str(REPO), done=str(done), ready=str(ready), parent=None)
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(90)",
        ]
    )
    try:
        assert wait_for(ready), "the child did not start"
        assert not done.exists()
        parent.kill()  # SIGKILL: nothing the parent does on its way out
        assert wait_for(done, 10), "the child outlived its parent"
        assert done.read_text() == "SIGTERM"
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.slow  # the child imports torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_parent_already_gone_sends_the_signal_at_once(tmp_path):
    """The race: the parent died before the child asked for the signal (the child is reparented)."""
    done, ready = tmp_path / "done", tmp_path / "ready"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that is no process's parent now
    child = CHILD.format(root=str(REPO), done=str(done), ready=str(ready), parent=gone.pid)
    proc = subprocess.run([sys.executable, "-c", child], timeout=60)
    assert proc.returncode == 0 and done.read_text() == "SIGTERM" and not ready.exists()


# ---------------------------------------------------------------- exit codes


def failure(exitcode, timestamp, pid=100):
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, pid=pid)


def test_the_first_failure_is_the_cause():
    assert launcher.first_failure({0: failure(-15, 11), 1: failure(2, 10)})[0] == 1
    # torch stamps whole seconds: a peer cut off in the same second is not the cause
    assert launcher.first_failure({0: failure(1, 10), 1: failure(2, 10)})[0] == 1
    assert launcher.first_failure({0: failure(-15, 10), 1: failure(75, 10), 2: failure(1, 10)})[0] == 1
    assert launcher.first_failure({0: failure(-9, 10), 1: failure(1, 10)})[0] == 1
    assert launcher.first_failure({3: failure(1, 10), 2: failure(1, 10)})[0] == 2
    # one that lost its peer (124: the collective it waited in broke) is not the cause: the peer, crashed or killed, is
    assert launcher.first_failure({0: failure(124, 10), 1: failure(1, 10)})[0] == 1
    assert launcher.first_failure({0: failure(124, 10), 1: failure(-9, 10)})[0] == 1
    # a mistake is the cause, the stop the same second torch's agent sending the others SIGTERM once it exited
    assert launcher.first_failure({0: failure(75, 10), 1: failure(2, 10)})[0] == 1
    # killed (the OOM killer) while the other waited: torch's agent then stopped the other (75), in the same second
    assert launcher.first_failure({0: failure(-9, 10), 1: failure(75, 10)})[0] == 0
    assert launcher.first_failure({0: failure(75, 10), 1: failure(-9, 11)})[0] == 0


def test_exit_codes(capfd):
    assert launcher.exit_code(2, "rank 0") == 2 and launcher.exit_code(75, "rank 0") == 75
    assert capfd.readouterr().err == ""  # the process said why itself
    assert launcher.exit_code(-signal.SIGKILL, "process rank 1 (pid 7)") == 137
    said = capfd.readouterr().err
    assert said == "launch.sh: process rank 1 (pid 7) was killed by SIGKILL (out of memory? see dmesg)\n"
    # a stop that came while the process imported, before its handlers: nothing to save, 75 as for any stop then
    assert launcher.exit_code(-signal.SIGTERM, "process rank 0 (pid 7)") == 75
    assert capfd.readouterr().err == "launch.sh: stopped by SIGTERM before training; nothing was saved (exit 75)\n"


def test_a_second_stop_while_the_first_ends_the_launcher_adds_nothing(monkeypatch, capfd):
    """`timeout` in front of launch.sh passes a stop on as the group gets it: two SIGTERMs, milliseconds apart; the
    second one's handler runs inside the first one's finish (before: the line twice)."""
    ended = []
    monkeypatch.setattr(launcher, "stops", [])
    monkeypatch.setattr(launcher, "finish", lambda code: (launcher.on_stop(signal.SIGTERM, None), ended.append(code)))
    launcher.on_stop(signal.SIGTERM, None)
    assert ended == [75] and capfd.readouterr().err.count("stopped by SIGTERM before the processes started") == 1


@pytest.mark.parametrize(
    "status, stop, said, code, line",
    [  # a process said why: its code, no second line (a stop launch.sh passed on, named by it; a mistake; a hang the
        # watchdog named, whose frozen rank it killed: not 137 and "killed by SIGKILL")
        ("preempted 6 /out/checkpoint-6", "SIGTERM", "75", 75, None),
        ("preempted None None", "Ctrl-C", "130", 130, None),
        ("error", "SIGTERM", "2", 2, None),
        ("error", None, "124", 124, None),
        # none did: the stop came as they finished, or before their handlers
        ("finished", "Ctrl-C", None, 0, "the run had finished when Ctrl-C came;"),
        ("", "SIGUSR1", None, 75, "stopped by SIGUSR1 before training; nothing was saved (exit 75)"),  # requeued
        ("finished", None, None, 0, None),
    ],
)
def test_a_launch_ends_with_what_its_processes_said(tmp_path, monkeypatch, capfd, status, stop, said, code, line):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    monkeypatch.setattr(launcher, "status_file", str(tmp_path / "status"))
    (tmp_path / "status").write_text(f"{status}\n" if status else "")
    if said:
        (tmp_path / "status.said-0").write_text(f"{said}\n")
    failures = {0: ProcessFailure(0, 100, 124, "<N/A>"), 1: ProcessFailure(1, 101, -9, "<N/A>")}  # stamped earlier?
    err = ChildFailedError("x", failures) if status == "error" else None
    assert launcher.job_exit_code(err, stop, SimpleNamespace()) == code
    said = capfd.readouterr().err.splitlines()
    assert said == [] if line is None else len(said) == 1 and said[0].startswith(f"launch.sh: {line}"), said


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_launcher_that_ends_leaves_no_child(tmp_path):
    """finish(): a process started in a session of its own (as torch's agent starts them), even one that ignores
    SIGTERM, does not outlive the launcher."""
    script = tmp_path / "strays.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        f"sys.path.insert(0, {str(REPO / 'scripts')!r})\n"
        "import launcher\n"
        "stubborn = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(100)'],"
        " start_new_session=True, stdout=subprocess.PIPE)\n"
        "stubborn.stdout.readline()\n"
        "print(stubborn.pid, [p.pid for p in launcher.psutil.Process().children()], flush=True)\n"
        "launcher.finish(3)\n"
    )
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    pid, children = proc.stdout.split(" ", 1)
    assert proc.returncode == 3 and children.strip() == f"[{pid}]", proc.stderr
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]


# ---------------------------------------------------------------- stop signals, with recipes that only wait

FAKE_RECIPE = """
import os, signal, sys, time
rank, log = os.environ.get("RANK", "0"), {log!r}
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
with open(log, "a") as f:
    f.write(f"start {{rank}}\\n")
while not got:
    time.sleep(0.05)
time.sleep(3)  # saving a checkpoint: more signals come meanwhile
if rank == "0":  # says why, as common.exit_codes does: the line, and its code beside launch.sh's status file
    stop = open(os.environ["RECIPE_STATUS_FILE"] + ".stop").read()  # the stop launch.sh passed on
    open(os.environ["RECIPE_STATUS_FILE"] + ".said-0", "w").write("75\\n")
    print(f"preempted: stopped by {{stop}} after step 3; saved /out/checkpoint-3", file=sys.stderr, flush=True)
with open(log, "a") as f:
    f.write(f"rank {{rank}}: {{len(got)}} SIGTERM\\n")
time.sleep(1)  # the others count theirs before torch's agent, seeing this one exit, sends them its own SIGTERM
sys.exit(75)
"""


@pytest.fixture
def fake_tree(tmp_path):
    """launch.sh and its launcher with one recipe, recipes/wait.py, that saves (exit 75) on SIGTERM."""
    root = tmp_path / "tree"
    for name in ("scripts", "accelerate_configs", "common"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "launch.sh", root / "launch.sh")
    (root / "recipes").mkdir()
    (root / "recipes" / "wait.py").write_text(FAKE_RECIPE.format(log=str(tmp_path / "log")))
    return root, tmp_path / "log"


@pytest.mark.slow  # the launcher imports torch
@pytest.mark.parametrize("nproc, extra", [(1, []), (2, []), (2, ["--max_restarts", "2"])])
def test_each_process_gets_one_sigterm_and_later_signals_wait(fake_tree, nproc, extra):
    """SIGTERM to launch.sh, then Ctrl-C to it and SIGTERM and SIGUSR1 to the launcher itself while the processes
    save: each process gets SIGTERM once, nothing is restarted (--max_restarts), launch.sh exits 75 with the line
    of the process that said why, naming the stop launch.sh passed on."""
    root, log = fake_tree
    proc = subprocess.Popen(
        [root / "launch.sh", "wait", "--num_processes", str(nproc), *extra],
        env=cpu_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # CI may start us with Ctrl-C ignored
    )
    try:
        assert wait_for(log, 120) and all(wait_for_text(log, f"start {rank}") for rank in range(nproc))
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        (launcher,) = psutil.Process(proc.pid).children()
        launcher.send_signal(signal.SIGTERM)
        launcher.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 75, stderr
    said = [line for line in stderr.splitlines() if not line.startswith("+ ")]
    assert said[-1] == "preempted: stopped by SIGTERM after step 3; saved /out/checkpoint-3", stderr
    assert said[:-1] == [
        "launch.sh: stopping: waiting for the processes to save a checkpoint (at most "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120 s)"
    ], stderr
    lines = log.read_text().splitlines()  # restarted processes are killed as they start: they may say they started
    assert sorted(line for line in lines if not line.startswith("start")) == [
        f"rank {r}: 1 SIGTERM" for r in range(nproc)
    ]


def wait_for_text(path: Path, text: str, seconds: float = 120) -> bool:
    deadline = time.monotonic() + seconds
    while text not in path.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
