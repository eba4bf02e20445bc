"""Every command in the bash blocks of README.md and docs/*.md is run here (or by .ci/run), in a copy of the repo.

Commands that need GPUs or CIFAR's download run as far as this GPU-less, network-less machine
allows: `accelerate launch` lines start their processes on CPU and must get past the launch
checks to the dataset; `./launch.sh` lines are resolved against a faked 8-GPU host and their
recipe arguments parsed by the recipe itself; `sbatch` lines run their template on a faked Slurm
job (tests/conftest.py) and `./launch.sh doctor` runs on CPU. The `lm_eval` line runs in
tests/test_lm_finetune.py, on a LoRA run's merged model with a local task.
"""

import contextlib
import os
import re
import shlex
import stat
import tempfile
from pathlib import Path
from unittest import mock

import doctor
import pytest
from conftest import (
    BIN,
    QUICKSTART,
    README_BLOCKS,
    README_PAGES,
    REPO,
    bash,
    copy_checkout,
    error_lines,
    load_recipe,
    results,
    run,
    sbatch,
    sbatch_line,
    user_env,
)
from make_digits import write_digits

PAGES, BLOCKS = README_PAGES, README_BLOCKS  # the front page and the pages it links; their bash blocks
README = "\n".join(page.read_text() for page in PAGES)
COMMANDS = [line for block in BLOCKS for line in block.splitlines() if line.strip() and not line.startswith("#")]
SETUP, FLOOR = BLOCKS[0], next(b for b in BLOCKS if "constraints/floor.txt" in b)
COPY = next(b for b in BLOCKS if "mkdir -p myproject" in b)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """The repo's files in a fresh folder, with the test environment as its .venv."""
    return copy_checkout(tmp_path_factory.mktemp("checkout"))


def test_every_readme_command_is_covered():
    covered = {line for block in (SETUP, FLOOR, QUICKSTART, COPY) for line in block.splitlines()}
    for line in COMMANDS:
        assert (
            line in covered
            or line.startswith("accelerate launch ")
            or launch_sh_args(line) is not None
            or sbatch_line(line) is not None
            or line.startswith("lm_eval ")  # run offline on a trained run by tests/test_lm_finetune.py
        ), line


def test_every_page_is_linked_from_the_front_page_and_every_local_link_resolves():
    front = PAGES[0].read_text()
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in front, f"README.md does not link {page.name}"
    for page in [*PAGES, REPO / "benchmarks" / "README.md"]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links {target}, which is not there"


def test_setup_commands_are_what_ci_runs():
    ci = (REPO / ".ci/run").read_text().splitlines()
    setup = [line for line in SETUP.splitlines() if line.strip()]
    assert len(setup) == 2, "the README has exactly two set-up commands: install, test"
    assert setup == [line for line in ci if line in setup], ".ci/run runs the README's commands, in order"
    floor = [line for line in FLOOR.splitlines() if line.strip()]
    assert ci[-2:] == floor, ".ci/run ends with the README's floor check"
    pinned = dict(
        line.split("==") for line in (REPO / "constraints/floor.txt").read_text().splitlines() if "==" in line
    )
    declared = (REPO / "pyproject.toml").read_text()
    for package, version in pinned.items():  # the floor set is what pyproject.toml declares
        assert re.search(rf'"{package}>={re.escape(version.removesuffix(".0"))}(\.0)?"', declared), package


@pytest.mark.floor
@pytest.mark.slow
def test_quick_start_and_copy_run_as_written(quick_start):
    """The quick start, run as written with no virtual environment active (conftest's quick_start, whose training
    test_cifar.py also compares with one process's), then the commands the README gives next, in the same folder."""
    checkout, env = quick_start, user_env()
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != str(BIN))  # no venv active
    res = results(checkout / "outputs/digits")  # 2 processes that form one group and learn together
    assert res["world_size"] == 2 and res["num_processes"] == 2 and res["distributed_type"] == "MULTI_CPU"
    assert res["eval_samples"] == 397 and res["eval_accuracy"] > 0.9, res  # an odd eval set, each sample once
    assert res["effective_batch_size"] == 64 and res["steps"] == 5 * ((1400 // 32) // 2)  # half the batches each
    assert res["args"]["data_on_device"] is True  # the digits fit: held in memory, cropped there
    assert len(res["peak_memory_gb_per_process"]) == 2
    assert (checkout / "outputs/digits/model.safetensors").is_file()
    # the output folder as the README says: its card ends with the upload command the README shows, and predict.py
    # labels an image with the run's model
    upload = re.search(r"`(hf upload [^`]*)`", README)[1]
    assert upload in (checkout / "outputs/digits/README.md").read_text().splitlines()
    image = sorted((checkout / "data/digits/val/3").glob("*.png"))[0]
    proc = run([BIN / "python", "scripts/predict.py", "outputs/digits", image.relative_to(checkout)], cwd=checkout)
    assert re.fullmatch(rf"{image.relative_to(checkout)}: (\d \d\.\d{{4}}(, )?){{3}}\n", proc.stdout), proc.stdout

    bash(COPY, checkout, env)
    assert results(checkout / "myproject/out")["steps"] == 20


# What each recipe cannot fetch on a machine with no network: the data, or (fine-tuning the digits) the weights.
OFFLINE_ERRORS = {"recipes/cifar.py": "cifar10 is not in data and could not be downloaded"}
OFFLINE_WEIGHTS = (
    "--pretrained: torchvision's weights for --model resnet18 (ResNet18_Weights.IMAGENET1K_V1) are "
    "not in the cache and could not be downloaded"
)


@pytest.mark.slow
@pytest.mark.parametrize("line", dict.fromkeys(c for c in COMMANDS if c.startswith("accelerate launch ")))  # each once
def test_accelerate_launch_lines_form_their_group_then_need_the_network(checkout, tmp_path, line):
    """On CPU, with no network: every process starts, the group forms and passes the checks,
    and the recipe stops at the download with its one-line error. (An empty TORCH_HOME: weights
    cached on this machine would start a full training.)"""
    words = shlex.split(line)
    recipe = next(w for w in words if w.startswith("recipes/"))
    if "data/digits/train" in words and not (checkout / "data/digits").is_dir():
        write_digits(checkout / "data/digits")
    proc = run(words, cwd=checkout, env=user_env(ACCELERATE_USE_CPU="true", TORCH_HOME=str(tmp_path)), check=False)
    assert proc.returncode != 0
    (message,) = error_lines(proc.stderr)
    assert (OFFLINE_WEIGHTS if "--pretrained" in words else OFFLINE_ERRORS[recipe]) in message, proc.stderr[-3000:]
    assert f"put it at {tmp_path}/hub/checkpoints/resnet18-f37072fd.pth" in message or "--pretrained" not in words


def launch_sh_args(line):
    """(environment, arguments) of a `[VAR=value ...] ./launch.sh ...` line, else None."""
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return (env, words[1:]) if words and words[0] == "./launch.sh" else None


def is_doctor(line):
    return launch_sh_args(line) is not None and launch_sh_args(line)[1][:1] == ["doctor"]


def is_selftest(line):  # run by tests/test_selftest.py, which checks that it runs the README's
    return launch_sh_args(line) is not None and launch_sh_args(line)[1][:1] == ["selftest"]


@pytest.mark.parametrize(
    "line",
    dict.fromkeys(  # each line once, however many pages show it
        c for c in COMMANDS if launch_sh_args(c) and c not in QUICKSTART and not is_doctor(c) and not is_selftest(c)
    ),
)
def test_launch_sh_lines_resolve_on_a_gpu_node(checkout, tmp_path, line):
    extra_env, args = launch_sh_args(line)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3"\n' for i in range(8)))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = user_env(**extra_env)
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    proc = run(["./launch.sh", *args, "--dry_run"], cwd=checkout, env=env)
    (command,) = [line for line in proc.stderr.splitlines() if line.startswith("+ ")]
    config = args[args.index("--config") + 1] if "--config" in args else "8gpu"
    assert f"accelerate_configs/{config}.yaml" in command
    if "MASTER_PORT" in extra_env:
        assert f"--main_process_port {extra_env['MASTER_PORT']}" in command
    parse_recipe_args(args)  # every recipe argument in the README exists


def parse_recipe_args(args):
    """The recipe's (or the doctor's) own parser on a launch.sh argument list, less launch.sh's options."""
    recipe_args, config = args[1:], args[args.index("--config") + 1] if "--config" in args else ""
    for option in ("--config", "--num_processes", "--max_restarts"):  # launch.sh's own options, not the recipe's
        if option in recipe_args:
            at = recipe_args.index(option)
            del recipe_args[at : at + 2]
    deepspeed = {"ACCELERATE_USE_DEEPSPEED": "true"} if config.startswith("zero") else {}  # as accelerate launch sets
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder), mock.patch.dict(os.environ, deepspeed):
        for flag in ("--train_file", "--validation_file"):  # parsing reads that they are there: made, in here
            if flag in recipe_args:
                at = recipe_args.index(flag) + 1
                path = Path(folder, recipe_args[at].lstrip("/"))  # /mnt/corpus/train.jsonl too
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text('{"text": "a line"}\n')
                recipe_args[at] = str(path)
        return (doctor.parse_args if args[0] == "doctor" else load_recipe(args[0]).parse_args)(recipe_args)


@pytest.mark.parametrize("line", [c for c in COMMANDS if sbatch_line(c)])
def test_sbatch_lines_run_one_launch_sh_per_node(tmp_path, line):
    """The template passes bash -n; on a faked Slurm job of the line's --nodes, 8 GPUs a node, each
    node's srun task resolves its command; the recipe accepts the arguments."""
    options, template, args = sbatch_line(line)
    assert set(options) <= {"nodes"}, "the test fakes --nodes only"
    run(["bash", "-n", REPO / template])
    nodes = int(options.get("nodes", 1))
    commands, _ = sbatch(REPO / template, args, tmp_path, nodes=nodes)
    assert len(commands) == nodes and all(f"--num_machines {nodes} " in c for c in commands if nodes > 1)
    parse_recipe_args(args)


def test_the_doctor_lines_are_the_one_tests_test_doctor_runs():
    """`./launch.sh doctor` on CPU, the README's only doctor line, is run by tests/test_doctor.py
    (test_doctor_on_cpu_times_a_gloo_allreduce), which asserts what it shows: the GPUs visible, the all-reduce's sums
    correct on all 2 processes."""
    lines = [c for c in COMMANDS if is_doctor(c)]
    assert lines and set(lines) == {"./launch.sh doctor"}, lines
