"""Fixtures: a real image set built on disk, and helpers that launch recipes the way users do."""

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

# One thread per process: two pytest workers on two cores each launch processes, and torch's default (a thread per
# core) in each made them wait for one another's threads, 3.6x slower a step (measured: two one-process ResNet-18 runs
# side by side). Multi-process launches get 1 already (accelerate launch sets it); a test may set its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtual environment's bin: accelerate, python
# `accelerate launch` as accelerate's own entry point for that one command (the same parser and launch_command): the
# `accelerate` CLI first imports every other command, estimate-memory's transformers and timm (and through timm
# torchvision and torch._dynamo) among them, 3 CPU-seconds of each launch on this machine (5.2 against 2.0). The
# README's `accelerate launch` lines run as written (test_readme.py).
ACCELERATE_LAUNCH = BIN / "accelerate-launch"
sys.path.insert(0, str(REPO / "scripts"))

import selftest  # noqa: E402
from launcher import free_port  # noqa: E402, F401  (launch.sh's own: tests import it from here)
from make_digits import write_digits  # noqa: E402
from make_tiny_lm import write_tiny_lm  # noqa: E402

# Small enough for a 2-core CI machine, large enough that a broken training shows: stock
# torchvision ResNet-18 reaches ~0.9 on the digits in 3 epochs, chance is 0.1.
FAST_MODEL = ["--model", "resnet18", "--per_device_train_batch_size", "32"]
NO_NETWORK = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}  # a download fails at once


def user_env(**extra) -> dict:
    """The environment of a user on a GPU-less machine with the venv active; no ACCELERATE_*
    left over from the test runner, a fresh rendezvous port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "PYTEST_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = env["HF_DATASETS_OFFLINE"] = "1"  # no network here: fail at once, never wait
    env.update(extra)
    return env


def started_by_accelerate_launch(monkeypatch, port, *launch, recipe=REPO / "recipes/cifar.py", **exported) -> tuple:
    """(environment, torchrun's arguments) the processes of `accelerate launch <launch> <recipe>` start with, in a
    shell that exported `exported`: accelerate's own launcher, run in this process as a user's shell runs it, up to
    torchrun's start of them."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import launch_command, launch_command_parser

    for name in [name for name in os.environ if name.startswith("ACCELERATE_")]:  # as user_env()
        monkeypatch.delenv(name)
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    started = []
    monkeypatch.setattr(distrib_run, "run", lambda args: started.append((dict(os.environ), vars(args))))
    argv = [*launch, "--main_process_port", port, recipe, "--output_dir", "run"]
    launch_command(launch_command_parser().parse_args([str(a) for a in argv]))
    (processes,) = started
    return processes


def run(cmd, env=None, cwd=REPO, timeout=420, check=True):
    """Run a command as a user would; on an unexpected exit code show its output. `python <a recipe>` runs forked
    from a process that has its libraries imported (tests/warm.py) when its environment allows."""
    cmd, env = [str(c) for c in cmd], env or user_env()
    if _WARM.takes(cmd, env):
        proc = _WARM.run(cmd, env, cwd, timeout)
    else:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


class _Warm:
    """The process tests/warm.py serves from, started at the first one-process recipe run of the session."""

    def __init__(self):
        self.proc, self.read_at_import = None, None

    def takes(self, cmd: list, env: dict) -> bool:
        recipe = len(cmd) > 1 and Path(cmd[0]) == BIN / "python" and Path(cmd[1]).parent.name == "recipes"
        if not recipe or env.get("RECIPES_TESTS_COLD"):  # a fresh interpreter asked for
            return False
        wanted, alive = read_at_import(env), self.proc is not None and self.proc.poll() is None
        if alive and self.read_at_import != wanted == read_at_import(user_env()):
            # started in an environment this process has since left (a test or a library changed a variable of
            # it): a user's run of now is started from a server of now
            self.proc.kill()
            self.proc.wait()
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "warm.py")], cwd=REPO, env=user_env(), text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            )  # fmt: skip
            self.read_at_import = read_at_import(json.loads(self.proc.stdout.readline())["environment"])
        return wanted == self.read_at_import

    def run(self, cmd: list, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"argv": cmd, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            print(json.dumps(request), file=self.proc.stdin, flush=True)
            pid = json.loads(self.proc.stdout.readline())["pid"]
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:  # the run goes with its processes; the server then answers for it
                with contextlib.suppress(psutil.Error):
                    for p in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
                        p.kill()
                self.proc.stdout.readline()
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
            code = json.loads(self.proc.stdout.readline())["returncode"]
            return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


_WARM = _Warm()
# The variables the libraries read when imported (caches, offline switches, threads): a run with other values of them
# is started afresh (CXX, CC: inductor's compiler, read when it is imported).
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TORCH", "PYTORCH_", "XDG_", "HOME",
               "OMP_", "MKL_", "CXX", "CC")  # fmt: skip


def read_at_import(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


def accelerate_cpu(nproc, script, *args, env=None):
    """`accelerate launch --config_file accelerate_configs/cpu.yaml` with ACCELERATE_USE_CPU=true."""
    env = env or user_env(ACCELERATE_USE_CPU="true")
    return [
        ACCELERATE_LAUNCH,
        "--config_file",
        REPO / "accelerate_configs/cpu.yaml",
        "--num_processes",
        nproc,
        "--main_process_port",
        env["MASTER_PORT"],
        script,
        *args,
    ], env


def results(output_dir) -> dict:
    return json.loads((Path(output_dir) / "results.json").read_text())


def is_png(path) -> bool:
    """A PNG of nonzero size that decodes (Pillow reads its header and checks its chunks)."""
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
        return image.format == "PNG" and min(image.size) > 0 and Path(path).stat().st_size > 0


def card(output_dir) -> tuple:
    """(front matter, text) of the model card a run wrote, read as the Hub reads it (huggingface_hub's ModelCard)."""
    from huggingface_hub import ModelCard

    loaded = ModelCard.load(Path(output_dir) / "README.md")
    return loaded.data.to_dict(), loaded.text


def uploaded(output_dir, text: str) -> set:
    """The files `hf upload` would send of output_dir with the card's command (`text`): its --exclude patterns and
    huggingface_hub's own defaults, through huggingface_hub's public filter."""
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    (line,) = [line for line in text.splitlines() if line.startswith("hf upload ")]
    words = shlex.split(line)
    assert words[3] == str(output_dir) and words[4] == ".", words  # the folder, to the repository's root
    excludes = [words[i + 1] for i, word in enumerate(words) if word == "--exclude"]
    files = [p.relative_to(output_dir).as_posix() for p in sorted(Path(output_dir).glob("**/*")) if p.is_file()]
    return set(filter_repo_objects(files, ignore_patterns=excludes + DEFAULT_IGNORE_PATTERNS))


def samples(output_dir) -> list:
    """The rows of a run's samples.jsonl (common.samples): step, samples_seen, prompt, completion."""
    return [json.loads(line) for line in (Path(output_dir) / "samples.jsonl").read_text().splitlines()]


def error_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("error:")]


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with a digest of its bytes ({} when the folder does not exist)."""
    return (
        {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*"))
            if p.is_file()
        }
        if Path(folder).exists()
        else {}
    )


def eval_loss(model_dir, lm, block_size=32, model=None, chat=False):
    """Token-weighted loss of a saved model on the validation blocks the recipe held out (the selftest's function)."""
    return selftest.reloaded_eval_loss(model_dir, lm, chat=chat, block_size=block_size, model=model)


def load_recipe(name="cifar"):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def untouched(folder: Path) -> dict:
    """Every file under `folder` by its bytes' digest and its ctime, every folder by its mtime: a write (even of the
    same bytes), a chmod, a rename, a file added or removed change them, and nothing sets a ctime back."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_ctime_ns)
        if p.is_file()
        else p.stat().st_mtime_ns
        for p in [folder, *sorted(folder.rglob("*"))]
    }


def read_only(*folders) -> list:
    """A command prefix that runs the rest with `folders` read-only (a bind mount in a mount namespace of its own:
    nothing outside it changes, nothing is left mounted, however it ends); as root, chmod would not stop a write."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "--bind", "/", "/mnt"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode:
        pytest.skip(f"no mount namespace here for a read-only bind mount: {probe.stderr.strip()[-200:]}")
    mounts = " && ".join(f"mount --bind '{f}' '{f}' && mount -o remount,ro,bind '{f}'" for f in folders)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's handwritten digits as an ImageFolder: 1400 train, 397 (odd) val images. Every run of every test
    reads it, and none may write into it: an input is never written (checked when the session ends)."""
    root = tmp_path_factory.mktemp("digits")
    n_train, n_val = write_digits(root)
    before = untouched(root)
    yield {"train": root / "train", "val": root / "val", "n_train": n_train, "n_val": n_val}
    assert untouched(root) == before, f"a run wrote into its input image folders, {root}"


def made_once_per_session(tmp_path_factory, name: str, make) -> Path:
    """The folder `name`, made by `make(folder)` in the first pytest worker that asks for it and read by every other:
    one run that tests of several files check (pytest-xdist runs a file in one worker process; the workers share the
    parent of their temporary folders). A worker that asks while another makes it waits for it, within the test's
    timeout; one that asks after a failed attempt makes it again."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def copy_checkout(root: Path) -> Path:
    """The repository's files in `root`, as a clone has them, with the test environment as its .venv."""
    for name in ("launch.sh", "recipes", "common", "accelerate_configs", "scripts", "slurm"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / name)
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


def bash(script, cwd, env=None):
    return run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env)


README_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # the front page and the pages it links
README_BLOCKS = re.findall(r"```bash\n(.*?)```", "\n".join(page.read_text() for page in README_PAGES), flags=re.S)
QUICKSTART = next(block for block in README_BLOCKS if "make_digits" in block)


@pytest.fixture(scope="session")
def quick_start(tmp_path_factory):
    """The README's quick start run as written, in a checkout of its own with no virtual environment active (its
    folder): its training is the 2-process side of test_cifar.py's learning comparison, and test_readme.py runs the
    README's next commands on it. Made once in a session, whichever of the two asks first."""

    def make(checkout):
        env = user_env()
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != str(BIN))
        bash(QUICKSTART, copy_checkout(checkout), env)

    return made_once_per_session(tmp_path_factory, "quick_start", make)


def digits_args(digits, output_dir, *extra):
    return [
        "--dataset",
        "imagefolder",
        "--train_dir",
        digits["train"],
        "--val_dir",
        digits["val"],
        "--output_dir",
        output_dir,
        *extra,
    ]


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """scripts/make_tiny_lm.py's 2-layer Llama, tokenizer and counting text and chats (`./launch.sh selftest` uses the
    same). No run may write into them (checked when the session ends)."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("tiny_lm")
    lm = write_tiny_lm(root)
    before = untouched(root)
    yield lm
    assert untouched(root) == before, f"a run wrote into its inputs, the model folder or data files in {root}"


def lm_args(lm, output_dir, *extra, data=None):
    """lm_finetune's arguments for the tiny model; `data`: the data arguments (default: the counting
    text and its validation file)."""
    data = data or ["--train_file", lm["train"], "--validation_file", lm["validation"]]
    return [
        "--model_name_or_path",
        lm["model"],
        *data,
        "--output_dir",
        output_dir,
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "8",
        "--learning_rate",
        "3e-3",
        "--lr_scaling",
        "none",
        "--warmup_ratio",
        "0",
        *extra,
    ]


update_distance = selftest.distance  # the tests measure as ./launch.sh selftest does


# Chats whose replies hold 1 to 24 words (tiny_lm's chat_varied): a 32-token block's target tokens vary
# from a few to most of it. No clipping and no weight decay, so an update is the gradient's alone.
def chat_args(lm, output_dir, batch, *extra):
    chats = ["--train_file", lm["chat_varied"], "--data_format", "chat", "--validation_split_percentage", "10"]
    return lm_args(
        lm,
        output_dir,
        "--per_device_train_batch_size",
        str(batch),
        "--max_grad_norm",
        "0",
        "--max_train_steps",
        "6",
        "--logging_steps",
        "1",
        *extra,
        data=chats,
    )


@pytest.fixture(scope="session")
def chat_reference(tiny_lm, tmp_path_factory):
    """One process, batch 4: the run every other split of the same samples must reproduce."""
    out = tmp_path_factory.mktemp("chat_reference") / "1x4"
    run([BIN / "python", REPO / "recipes" / "lm_finetune.py", *chat_args(tiny_lm, out, 4)])
    return out


# The run the stop/restart tests compare with: 14 steps of 2 micro-batches, crossing epochs.
LM_INTERRUPTED_ARGS = ("--gradient_accumulation_steps", "2", "--max_train_steps", "14", "--logging_steps", "1")


@pytest.fixture(scope="session")
def lm_uninterrupted(tiny_lm, tmp_path_factory):
    """An uninterrupted 2-process lm_finetune run with LM_INTERRUPTED_ARGS (its output folder)."""
    out = tmp_path_factory.mktemp("lm_uninterrupted") / "run"
    cmd, env = accelerate_cpu(2, REPO / "recipes" / "lm_finetune.py", *lm_args(tiny_lm, out, *LM_INTERRUPTED_ARGS))
    run(cmd, env=env)
    return out


def preempted_at(stderr, sig="SIGTERM"):
    """The step of the `preempted:` line a run stopped by `sig` printed (None without one). The stop
    may land in an evaluation (the end of an epoch), which the line names."""
    found = re.search(rf"^preempted: stopped by {sig} (?:during evaluation )?after step (\d+); saved ", stderr, re.M)
    return int(found.group(1)) if found else None


def interrupt(cmd, env, output_dir, after_step, sig=signal.SIGTERM, rank=None, timeout=300):
    """Start `cmd` in a session of its own (as a terminal or a Slurm step runs it), wait until
    checkpoint-<after_step> is complete, then send `sig` to every process of the job, or to the
    process of one `rank` only. Returns the finished process and the seconds it took to end."""
    marker = Path(output_dir) / f"checkpoint-{after_step}" / "trainer_state.json"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [str(c) for c in cmd], cwd=REPO, env=env, stdout=out, stderr=err, text=True, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        with session_killed_at_exit(proc):
            while not marker.exists():
                assert proc.poll() is None, f"ended before checkpoint-{after_step}"
                assert time.monotonic() < deadline, f"no checkpoint-{after_step} after {timeout} s"
                time.sleep(0.05)
            if rank is None:
                os.killpg(proc.pid, sig)
            else:
                rank_process(proc, rank).send_signal(sig)
            sent = time.monotonic()
            proc.wait(timeout=timeout)
            took = time.monotonic() - sent
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), took


def rank_process(proc, rank) -> psutil.Process:
    """The recipe's process of `rank` in the job `proc` started (not its DataLoader workers)."""
    ranks = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if p.environ().get("RANK") == str(rank) and str(REPO / "recipes") in " ".join(p.cmdline())
    ]
    (target,) = [p for p in ranks if p.parent() not in ranks]
    return target


@contextlib.contextmanager
def session_killed_at_exit(proc):
    """Whatever the test's code in it ends with, nothing of the job `proc` started in a session of its own is left
    running: a process still running then is SIGKILLed with its whole session."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cpu_env(**extra) -> dict:
    """A GPU-less user's environment, also on a machine with GPUs."""
    return user_env(CUDA_VISIBLE_DEVICES="", **extra)


# ---------------------------------------------------------------- a fake Slurm (test_slurm.py, test_readme.py)
# launch.sh under Slurm on a machine without it: the job's variables set by hand, and a fake srun that runs each task
# of a step in turn with the variables the real one gives it (SLURM_NODEID, SLURM_PROCID, SLURM_STEP_*).

JOB_ID, PORT = "4242", "24242"  # the port every node derives from the job id: 20000 + 4242 % 10000

FAKE_SRUN = r"""#!/bin/bash
# srun on one machine: each task of the step in turn, with the variables the real srun sets.
tpn=${SLURM_NTASKS_PER_NODE:-1}
while [[ $# -gt 0 && $1 == -* ]]; do
  echo "$1" >> "$FAKE_SLURM_LOG"
  case $1 in --ntasks-per-node=*) tpn=${1#*=} ;; esac
  shift
done
tasks=$(( SLURM_NNODES * tpn ))
for (( t = 0; t < tasks; t++ )); do
  SLURM_STEP_ID=0 SLURM_STEPID=0 SLURM_STEP_NUM_NODES=$SLURM_NNODES SLURM_STEP_NUM_TASKS=$tasks \
  SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_NODEID=$(( t / tpn )) SLURM_PROCID=$t SLURM_LOCALID=$(( t % tpn )) \
  "$@" || exit $?
done
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def node_list(nodes: int) -> str:
    return f"gpu-[01-{nodes:02d}]" if nodes > 1 else "gpu-01"


def slurm_env(tmp_path, nodes, gpus=8, **extra) -> dict:
    """The environment of a batch script on the first node of a `nodes`-node job with `gpus` GPUs
    a node (faked with an nvidia-smi on PATH), and a fake srun; no MASTER_PORT."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    executable(bin_dir / "srun", FAKE_SRUN)
    executable(
        bin_dir / "nvidia-smi",
        "#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})"\n' for i in range(gpus)),
    )
    env = user_env()
    del env["MASTER_PORT"]
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env.update(
        SLURM_JOB_ID=JOB_ID,
        SLURM_NNODES=str(nodes),
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_NODELIST=node_list(nodes),
        SLURM_NODELIST=node_list(nodes),
        SLURM_NODEID="0",
        SLURM_PROCID="0",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_SUBMIT_DIR=str(REPO),
        FAKE_SLURM_LOG=str(tmp_path / "srun.log"),
    )
    env.update(extra)
    return env


def commands(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("+ ")]


def directives(template: Path) -> dict:
    found = re.findall(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", template.read_text(), flags=re.M)
    return {key: value for key, value in found}


def sbatch(template: Path, args, tmp_path, nodes=None, gpus=None, env=None):
    """Run a template as sbatch would on its first node, with `args` and --dry_run for launch.sh.
    Returns (every srun task's resolved command, the environment the job had)."""
    options = directives(template)
    nodes = nodes or int(options["nodes"])
    gpus = gpus or int(options["gres"].split(":")[-1])
    env = env or slurm_env(
        tmp_path, nodes, gpus, SLURM_CPUS_PER_TASK=options["cpus-per-task"], SLURM_GPUS_ON_NODE=str(gpus)
    )
    proc = run(["bash", template, *args, "--dry_run"], env=env)
    return commands(proc.stderr), env


def sbatch_line(line):
    """(sbatch options, template, arguments) of a README `sbatch [--opt=value ...] slurm/X.sbatch ...` line."""
    words = shlex.split(line)
    if not words or words[0] != "sbatch":
        return None
    at = next(i for i, w in enumerate(words) if w.endswith(".sbatch"))
    return dict(w[2:].split("=", 1) for w in words[1:at]), words[at], words[at + 1 :]


# Seconds each file's tests took in a full run on 2 cores (2026-12-01, pytest's durations, quiet): the order files
# start in, longest first. Only the order: a file missing here comes after them, by its number of slow tests.
FILE_SECONDS = {
    "test_cifar.py": 315, "test_fixes.py": 305, "test_rules.py": 285, "test_selftest.py": 280, "test_hang.py": 245,
    "test_fsdp.py": 210, "test_fault.py": 190, "test_zero.py": 155, "test_lm_finetune.py": 145, "test_tp.py": 135,
    "test_launch_sh.py": 110, "test_prepared.py": 105, "test_benchmarks.py": 100, "test_hsdp.py": 90,
    "test_streaming.py": 85, "test_multinode.py": 80, "test_readme.py": 60, "test_compile.py": 55,
    "test_inputs.py": 50, "test_launcher.py": 25,
}  # fmt: skip


def pytest_collection_modifyitems(items):
    """The files that take longest first: pytest-xdist hands each worker a whole file at a time (--dist loadfile), and
    a long one started last would leave one worker running it alone at the end."""
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (-FILE_SECONDS.get(item.path.name, 0), -slow[item.path]))  # stable within a file


def launcher_says(launcher, argv, env: dict, capfd) -> tuple:
    """launch.sh's launcher (a module of scripts/launcher.py) deciding `argv` in the environment `env`, in this
    process, as launch.sh starts it: (exit code, stdout, stderr). For refusals and --dry_run plans, which start
    nothing: what would start the processes fails the test instead. This process's environment is as it was after."""

    def started(cmd):
        raise AssertionError(f"launch.sh would start {cmd}")

    saved, real = dict(os.environ), launcher.run
    capfd.readouterr()
    os.environ.clear()
    os.environ.update({k: str(v) for k, v in env.items()})
    launcher.run = started
    try:
        code = launcher.main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    finally:
        launcher.run = real
        os.environ.clear()
        os.environ.update(saved)
    out, err = capfd.readouterr()
    return code, out, err
