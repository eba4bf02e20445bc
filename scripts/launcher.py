"""Usage: ./launch.sh RECIPE [--config NAME] [--num_processes N] [--max_restarts N] [--mixed_precision no|bf16|fp16]
                   [--dry_run] [recipe arguments...]
       ./launch.sh doctor [--config NAME] [--num_processes N] [--dry_run] [--timeout S]
       ./launch.sh selftest [--config NAME] [--num_processes N] [--mixed_precision no|bf16]

Runs recipes/RECIPE.py (or RECIPE as a .py file's path: a copy of yours) under `accelerate launch` with
accelerate_configs/NAME.yaml (or --config PATH.yaml, a file of yours): by default the one for this host's GPUs, or N
CPU processes (default 2) in one gloo group, where --config zero2/zero3/fsdp runs DeepSpeed or FSDP2 (fp32 unless
--mixed_precision bf16). --num_processes: on this node; --max_restarts: restarts when a process fails. Other arguments
go to the recipe (./launch.sh cifar --help); its exit code is launch.sh's. Under Slurm: one launch.sh per node, by srun
(slurm/*.sbatch). doctor: GPUs, versions, an all-reduce's speed. selftest: the README's promises, checked on this
machine with a tiny model. Environment:
MASTER_PORT (one node: a free one; several: 29500, under Slurm 20000 + job id % 10000), MASTER_ADDR (the head node;
default: the first Slurm node), NNODES and NODE_RANK (several nodes without Slurm, as torchrun), RDZV_TIMEOUT (seconds
to wait for the other nodes, 60), TORCH_ELASTIC_SHUTDOWN_TIMEOUT (seconds to save a checkpoint when stopped, 120).
SIGTERM, SIGUSR1, SIGHUP or Ctrl-C: the processes save a checkpoint and launch.sh exits 75 (docs/resuming.md).
"""

import glob
import importlib.metadata
import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import suppress
from pathlib import Path

import psutil  # these two are accelerate's dependencies, and import no torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
sys.path.insert(0, str(ROOT))
from common import mesh, preflight  # noqa: E402  (these two import no torch: --dry_run and errors stay fast)
from common.args import LAUNCH_SH_ENV, SECRET_VALUES, mask_words  # noqa: E402

SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
CODE_FILE = os.environ.pop("LAUNCH_SH_CODE", "")  # where launch.sh reads this process's exit code
stops: list[str] = []  # the stop signals received, in order, by name
status_file = ""  # where rank 0 says how the run ended; once set, training processes may exist


def say(text: str) -> None:
    with suppress(OSError):  # unbuffered: also from a signal handler; to a terminal or pipe that may be gone
        os.write(2, f"launch.sh: {SECRET_VALUES.sub('***', text)}\n".encode())


def die(text: str):
    say(f"error: {text}")
    sys.exit(2)


def kill(processes, sig: int) -> None:
    for process in processes:
        with suppress(psutil.Error):  # gone meanwhile
            process.send_signal(sig)


def finish(code: int):
    """Exit now: no status file, no child left (a stray is killed), no second of tearing torch down."""
    kill(psutil.Process().children(), signal.SIGKILL)
    for path in glob.glob(f"{status_file}*") if status_file else ():  # and the lines said (first_to_say)
        Path(path).unlink(missing_ok=True)
    if CODE_FILE:  # launch.sh reads it: its `wait` can lose our status
        with suppress(OSError):
            Path(CODE_FILE).write_text(f"{code & 255}\n")
    with suppress(AttributeError, OSError):  # stdout closed (>&-: None) or gone
        sys.stdout.flush()
    os._exit(code)


def stopped_before(what: str, stop: str) -> int:
    """Nothing was saved: Ctrl-C is the user's 130; any other stop (preemption, Slurm's time limit) 75, like a stop
    at a checkpoint, so that a requeued job starts again."""
    code = 130 if stop == "Ctrl-C" else 75
    say(f"stopped by {stop} before {what}; nothing was saved (exit {code})")
    return code


def on_stop(signum, frame) -> None:
    stops.append("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)
    if not status_file:  # nothing to save (a helper such as `doctor --report` ends too): the first stop ends the
        if len(stops) == 1:  # launcher, and one that comes while it ends (`timeout` passing a stop on) adds nothing
            finish(stopped_before("the processes started", stops[0]))
        return
    # a second signal does not cut the save short; not said after a process's line saying why the job ended
    if len(stops) == 2 and said_code() is None:
        say(f"stopping: waiting for the processes to save a checkpoint (at most {SHUTDOWN}={os.environ[SHUTDOWN]} s)")


def env(*names: str, default: str = "") -> str:
    """The first of these environment variables that is set and not empty."""
    return next((os.environ[name] for name in names if os.environ.get(name)), default)


def number(name: str, value: str | None, low: int, what: str, high: int = 999999) -> int | None:
    if value and not (re.fullmatch(r"[0-9]{1,6}", value) and low <= int(value) <= high):
        die(f"{name} must be {what}, got {value!r}")
    return int(value) if value else None


def read_config(path: Path) -> tuple[int, int, str, bool, dict]:
    """num_machines, num_processes, distributed_type and use_cpu of an accelerate YAML, and the YAML; a bad value of
    those launch.sh reads would surface as a traceback (accelerate launch refuses the rest: see job_exit_code)."""
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        mark, reason = getattr(err, "problem_mark", None), getattr(err, "problem", None) or err
        die(f"{path}: not a readable YAML file ({reason}{f' at line {mark.line + 1}' if mark else ''})")
    if not isinstance(config, dict):
        die(f"{path}: not an accelerate config (a YAML mapping of keys such as distributed_type)")
    deepspeed_file = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if deepspeed_file and not Path(deepspeed_file).is_file():
        die(f"{path}: deepspeed_config_file {deepspeed_file}: no such file")
    machines, processes = config.get("num_machines", 1), config.get("num_processes", 1)
    kind, use_cpu = config.get("distributed_type", "NO"), config.get("use_cpu", False)
    sizes = config.get("parallelism_config") or {}  # HSDP's or TP's mesh (common.mesh reads it)
    if not isinstance(sizes, dict):
        die(f"{path}: parallelism_config must be a mapping of sizes such as parallelism_config_tp_size: 2")
    numbers = [("num_machines", machines), ("num_processes", processes)]
    numbers += [(f"parallelism_config: {key}", value) for key, value in sizes.items() if key.endswith("_size")]
    for key, value in numbers:
        if type(value) is not int or value < 1:
            die(f"{path}: {key} must be a whole number from 1, got {value!r}")
    if not isinstance(use_cpu, bool):
        die(f"{path}: use_cpu must be true or false, got {use_cpu!r}")
    if (port := config.get("main_process_port")) is not None and not (type(port) is int and 0 < port < 65536):
        die(f"{path}: main_process_port must be a TCP port number from 1 to 65535, got {port!r}")  # launch.sh uses it
    return machines, processes, kind, use_cpu, config


def output(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True).stdout if shutil.which(cmd[0]) else ""


def count_gpus() -> int:
    """nvidia-smi's GPUs, narrowed by CUDA_VISIBLE_DEVICES and by the GPUs Slurm gave this node."""
    gpus = sum(line.startswith("GPU") for line in output("nvidia-smi", "-L").splitlines())
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        gpus = min(gpus, 0 if visible == "-1" else len([d for d in visible.split(",") if d]))
    return min(gpus, int(env("SLURM_GPUS_ON_NODE"))) if env("SLURM_GPUS_ON_NODE").isdigit() else gpus


def head_node(nodelist: str) -> str:
    """The first host of a Slurm node list, which may be compressed: gpu-[01-03,07],cpu1 -> gpu-01."""
    if shutil.which("scontrol"):
        return output("scontrol", "show", "hostnames", nodelist).split("\n")[0]
    first = re.match(r"(?:\[[^\]]*\]|[^,])*", nodelist).group()  # up to the first comma outside brackets
    return re.sub(r"\[([^\],-]*)[^\]]*\]", r"\1", first)  # each [range,...] -> the start of its first range


def show(words: list[str]) -> str:
    """A command as launch.sh prints it, for the shell, credentials masked (common.args's rule)."""
    return "+ " + " ".join(shlex.quote(word) for word in mask_words(words))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_head(head: str, port: int, seconds: int, rank: int) -> None:
    """A head that cannot be reached fails in `seconds` with the likely causes, not with torch's traceback."""
    deadline = time.monotonic() + seconds
    while time.monotonic() <= deadline:
        with suppress(OSError):
            return socket.create_connection((head, port), timeout=5).close()
        time.sleep(1)
    die(
        f"node {rank} cannot reach the head node {head}:{port} after {seconds} s; check that the head's launcher "
        f"started, that port {port} is free and open between the nodes (firewall), that {head!r} resolves to an "
        "address of the network the nodes share (or set MASTER_ADDR); see ./launch.sh doctor"
    )


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "selftest":  # it launches the recipes through launch.sh itself
        os.execv(sys.executable, [sys.executable, str(ROOT / "scripts/selftest.py"), *argv[1:]])
    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
    recipe = argv[0].removeprefix("recipes/").removesuffix(".py")
    if argv[0].endswith(".py") and Path(argv[0]).is_file():  # a recipe's file: this repo's, or a copy of yours
        script = Path(argv[0]).resolve()
    elif recipe in (*recipes, "doctor"):
        script = ROOT / ("scripts/doctor.py" if recipe == "doctor" else f"recipes/{recipe}.py")
    else:  # also a first argument that is an option
        first = "; the recipe comes first: ./launch.sh RECIPE [options]" if argv[0].startswith("-") else ""
        known = f"{' '.join(recipes)}, doctor, selftest, or a recipe's .py file"
        die(f"unknown recipe {argv[0]!r} (available: {known}){first}")
    ours, rest, words = {}, [], iter(argv[1:])  # launch.sh's options; the rest is the recipe's
    for word in words:
        name, eq, value = word.partition("=")
        if name in ("--config", "--num_processes", "--max_restarts", "--mixed_precision"):
            ours[name] = value if eq else next(words, "")
            if not ours[name] or ours[name].startswith("--"):  # not the next option, nor the recipe's argument
                die(f"{name} needs a value (see ./launch.sh --help)")
        elif word in ("--dry_run", "-h", "--help"):
            ours[{"-h": "--help"}.get(word, word)] = True
        else:
            rest.append(word)
    # Every number launch.sh takes, checked here: a bad one would surface as a traceback of accelerate or torch.
    processes_here = "a positive integer (the processes on this node)"
    num_processes = number("--num_processes", ours.get("--num_processes"), 1, processes_here)
    max_restarts = number("--max_restarts", ours.get("--max_restarts"), 0, "a number of restarts (0 or more)")
    port = master_port = number("MASTER_PORT", env("MASTER_PORT"), 1, "a TCP port number from 1 to 65535", 65535)
    rdzv_timeout = number("RDZV_TIMEOUT", env("RDZV_TIMEOUT"), 1, "a positive number of seconds") or 60
    os.environ[SHUTDOWN] = str(number(SHUTDOWN, env(SHUTDOWN), 1, "a positive number of seconds") or 120)
    number("OMP_NUM_THREADS", env("OMP_NUM_THREADS"), 1, "a positive number of threads")  # accelerate reads it too
    precision = ours.get("--mixed_precision")
    if precision not in (None, "no", "bf16", "fp16"):
        die(f"--mixed_precision must be no, bf16 or fp16, got {precision!r}")
    if env("MASTER_ADDR") and not re.fullmatch(r"[\]\[A-Za-z0-9._:%-]+", env("MASTER_ADDR")):
        die(f"MASTER_ADDR must be a host name or an IP address, got {env('MASTER_ADDR')!r}")
    configs = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    config = ours.get("--config", "")  # a name of accelerate_configs/, or the path of a YAML file (yours, say)
    if config.endswith((".yaml", ".yml")) and Path(config).is_file():
        path = Path(config).resolve()
        config = path.stem if path.parent == CONFIGS.resolve() else str(path)
    else:
        config = config.removeprefix("accelerate_configs/").removesuffix(".yaml")
        if "--config" in ours and config not in configs:
            die(f"unknown config {ours['--config']!r} (available: {' '.join(configs)}, or the path of a YAML file)")
    if "--help" in ours:  # the recipe's options, from one process (every process of a launch would print them)
        os.execv(sys.executable, [sys.executable, str(script), "--help"])
    # The job's nodes, this one's rank and the head node: from Slurm (one launch.sh a node, by srun; the batch script
    # runs on the first node only), from torchrun's NNODES and NODE_RANK, or below from a multi-node config.
    nodes, rank, head = 1, 0, None
    if env("SLURM_JOB_ID"):
        nodes = number("SLURM_NNODES", env("SLURM_STEP_NUM_NODES", "SLURM_NNODES", default="1"), 1, "a node count")
        if port is None and re.fullmatch(r"[0-9]{1,12}", env("SLURM_JOB_ID")):  # the same on every node of a job
            port = 20000 + int(env("SLURM_JOB_ID")) % 10000
        if nodes > 1 and not env("SLURM_STEP_ID"):  # in the batch script SLURM_NODEID is 0 on every node
            die(
                f"this Slurm job has {nodes} nodes but launch.sh runs outside srun, on one node; start one launch.sh "
                "per node: srun --ntasks-per-node=1 ./launch.sh ... (see slurm/multi_node.sbatch)"
            )
        if env("SLURM_STEP_ID"):  # srun --ntasks-per-node=GPUs would start a launch.sh (a job) per GPU
            one_a_node = f"{nodes}, one launch.sh a node (it starts the processes): use srun --ntasks-per-node=1"
            number("SLURM_STEP_NUM_TASKS", env("SLURM_STEP_NUM_TASKS", default=str(nodes)), nodes, one_a_node, nodes)
        if nodes > 1:
            rank = number(
                "SLURM_NODEID", env("SLURM_NODEID", "SLURM_PROCID", default="?"), 0, f"0 to {nodes - 1}", nodes - 1
            )
            head = env("MASTER_ADDR") or head_node(env("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
            if not head:
                die("no head node: SLURM_JOB_NODELIST is empty and MASTER_ADDR unset; set MASTER_ADDR")
    if nodes == 1 and env("NNODES", default="1") != "1":  # one launch.sh a node, by hand (in a Slurm job of one too)
        nodes, port = number("NNODES", env("NNODES"), 1, "a node count"), master_port  # not the Slurm job's
        rank = number("NODE_RANK", env("NODE_RANK", default="?"), 0, f"0 to {nodes - 1}", nodes - 1)
        head = env("MASTER_ADDR") or die(f"NNODES={nodes} needs MASTER_ADDR, the head node's address (NODE_RANK 0)")
    if nodes == 1 and env("NODE_RANK", default="0") != "0":  # a node of several that would train alone
        die(f"NODE_RANK={env('NODE_RANK')} is set but not NNODES, the number of nodes: set it on every node")
    gpus = count_gpus()
    if not config:
        config = "cpu" if gpus == 0 else f"{gpus}gpu" if (CONFIGS / f"{gpus}gpu.yaml").is_file() else "2gpu"
        num_processes = num_processes or (gpus if config == "2gpu" else None)
    config_file = Path(config) if config.endswith((".yaml", ".yml")) else CONFIGS / f"{config}.yaml"
    machines, processes, kind, use_cpu, yaml_config = read_config(config_file)
    if yaml_config.get("mixed_precision") is False:  # an unquoted `no`, which YAML reads as false: accelerate fails
        precision = precision or "no"  # what it means; the file stays as it is
    if kind == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:  # accelerate launch: a traceback
        die(f"{config_file.name} runs DeepSpeed, which is not installed here: pip install -e '.[deepspeed]', or pass "
            "another --config (fsdp trains sharded without it)")  # fmt: skip
    if nodes == 1 and machines > 1:  # a multi-node config: one launch.sh a machine, by hand
        nodes, rank = machines, yaml_config.get("machine_rank", 0)
        head = str(env("MASTER_ADDR") or yaml_config.get("main_process_ip") or "")
        port = master_port or yaml_config.get("main_process_port")  # not the Slurm job's: other jobs' nodes meet
        if not head or type(rank) is not int or not 0 <= rank < machines:
            die(
                f"{config_file}: num_machines: {machines} starts one launch.sh on each machine, and they meet at the "
                f"first one's main_process_ip, each with its machine_rank (0 to {machines - 1}); set them, or use "
                "num_machines: 1 on one machine (under Slurm launch.sh sets them)"
            )
    per_node = num_processes or max(processes // machines, 1)
    sizes = mesh.from_config(yaml_config)  # HSDP's or tensor parallelism's mesh, sized to the job below
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", str(config_file)]
    variables = {}  # environment variables of the command
    if use_cpu:  # without it a GPU-less launch trains N unsynchronised copies (common/runtime.py refuses it)
        variables["ACCELERATE_USE_CPU"] = "true"
    elif gpus == 0 and (kind in ("DEEPSPEED", "FSDP") or sizes):  # on a laptop: DeepSpeed's CPU accelerator, FSDP2
        # or tensor parallelism (tp.yaml) over gloo; a mesh's least: 2 shards a copy under FSDP, a node's TP group
        least = (
            sizes["tp"] * (sizes["dp_replicate"] if nodes == 1 else 1) * (2 if kind == "FSDP" else 1) if sizes else 2
        )
        per_node = num_processes = num_processes or least
        precision = precision or "no"  # the configs' bf16 is for GPUs, unless asked for
        strategy = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP2"}.get(kind, "tensor parallelism")
        what = strategy, "fp32" if precision == "no" else precision
        say(f"no GPU visible: {what[0]} runs on CPU, {per_node} process(es) on this node, {what[1]}")
    elif refusal := preflight.more_processes_than_gpus(per_node, gpus, on_cpu=False):  # GPUs' processes, as theirs
        die(str(refusal))
    # first, as the processes' preflight says it: a torch that would train wrong whatever else is asked
    if refusal := preflight.known_bad_torch(per_node * nodes, importlib.metadata.version("torch"), kind == "FSDP"
                                            and gpus == 0):  # fmt: skip
        die(str(refusal))
    cpu_flag = use_cpu or preflight.flag(os.environ, "ACCELERATE_USE_CPU")  # the processes' ACCELERATE_USE_CPU
    deepspeed_file = (yaml_config.get("deepspeed_config") or {}).get("deepspeed_config_file")
    for refusal in (  # what the processes' preflight would refuse of this config and environment, said before them
        preflight.sharding_left_out_on_cpu({"ACCELERATE_USE_CPU": str(cpu_flag), f"ACCELERATE_USE_{kind}": "1"}, gpus),
        preflight.fp16_on_cpu(
            precision or str(yaml_config.get("mixed_precision") or "no"),
            cpu_flag or gpus == 0,
            deepspeed_file if kind == "DEEPSPEED" and not cpu_flag else None,
        ),
    ):
        if refusal:
            die(str(refusal))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if gpus == 0 and per_node > 4 * cores:  # a typo: processes that would take turns on the cores for ever
        die(f"{per_node} CPU processes requested on this node, which has {cores} cores; pass --num_processes {cores}")
    cmd += ["--mixed_precision", precision] if precision else []
    if sizes:  # the config's mesh for this job's nodes and processes (accelerate takes the options over the YAML's)
        if refusal := preflight.unbuilt_mesh(sizes) or preflight.unsplittable(sizes, kind == "FSDP"):
            die(f"{config_file.name}: {refusal}")
        sizes, problem, fits = mesh.fitted(sizes, nodes, per_node)
        if problem:
            die(f"{config_file.name}: {problem}; pass --num_processes {fits}")
        if refusal := preflight.untested_mesh(sizes, importlib.metadata.version("accelerate")):
            die(f"{config_file.name}: {refusal}")
        cmd += mesh.options(sizes)
        say(f"{config_file.name}: a mesh of {mesh.describe(sizes)} over {nodes} node(s) x {per_node} process(es)")
    if nodes > 1:
        port = port or 29500
        # c10d: the head hosts the rendezvous (is_host, not a guess from host names); nodes start RDZV_TIMEOUT apart
        cmd += ["--num_processes", str(per_node * nodes), "--num_machines", str(nodes), "--machine_rank", str(rank)]
        cmd += ["--main_process_ip", head, "--main_process_port", str(port), "--rdzv_backend", "c10d"]
        cmd += ["--rdzv_conf", f"is_host={int(rank == 0)},join_timeout={rdzv_timeout}"]
        if kind == "DEEPSPEED":  # torchrun on every node, as for DDP; DeepSpeed's default (pdsh) would ssh into them
            cmd += ["--deepspeed_multinode_launcher", "standard"]
    else:
        if (num_processes or processes) > 1:  # accelerate's own pick of a free port races with another launch's
            port = port or yaml_config.get("main_process_port") or free_port()
        cmd += ["--num_processes", str(num_processes)] if num_processes else []
        cmd += ["--main_process_port", str(port)] if port else []
        # One CPU process needs no group: without --cpu accelerate would wrap the model in a DistributedDataParallel
        # of one process (benchmarks/). --max_restarts needs torchrun's agent; the doctor times a group's all-reduce.
        cmd += ["--cpu"] if use_cpu and per_node == 1 and max_restarts is None and recipe != "doctor" else []
    if max_restarts is not None:  # restarted processes resume from the newest checkpoint (common.OutputDir)
        # Each attempt its own store: the one torch's rendezvous shares with the processes keeps a dead attempt's
        # addresses, and a restart would hang on them (pytorch#135712); static rendezvous always shares it, so c10d,
        # on one node too, at MASTER_PORT (torchrun's PET_ variable: accelerate sets no endpoint on one node).
        variables["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if nodes == 1:
            variables["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{port or 29500}"
            cmd += ["--rdzv_backend", "c10d", "--rdzv_conf", "is_host=1"]
        cmd += ["--max_restarts", str(max_restarts)]
    cmd += [str(script), *rest]
    print(show([f"{name}={value}" for name, value in variables.items()] + cmd), file=sys.stderr, flush=True)
    os.environ.update(variables)  # the command printed is the one that runs (it runs by hand too)
    # the processes check that they formed as many (accelerate launch starts one for a MULTI_CPU config)
    os.environ[LAUNCH_SH_ENV] = str(ROOT / "launch.sh")
    os.environ["RECIPE_WORLD_SIZE"] = str(per_node * nodes if nodes > 1 else num_processes or processes)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # a group's launcher sets these; left
        os.environ.pop(name, None)  # from another job, they would make a process of one take itself for a rank
    if "--dry_run" in ours:
        return 0
    if recipe == "doctor":  # this node's report first: it needs no other node
        shown = ["--num_processes", str(per_node)]
        shown += ["--mesh", mesh_line(sizes, nodes, per_node)] if sizes or nodes > 1 else []  # HSDP's use: nodes
        report = subprocess.run([sys.executable, str(script), "--report", *shown, *rest])
        if report.returncode:
            return report.returncode
    if rank:  # else torch waits for the head as long as its own timeout
        wait_for_head(head, port, rdzv_timeout, rank)
    return run(cmd[2:])


def mesh_line(sizes: dict | None, nodes: int, per_node: int) -> str:
    """The doctor's line on the mesh of this job: the config's, or the one hsdp_multi_node would give it."""
    name = None if sizes else "hsdp_multi_node"
    fit = mesh.fitted(sizes or mesh.from_config(read_config(CONFIGS / f"{name}.yaml")[4]), nodes, per_node)
    under = f" under --config {name}" if name else ""
    if fit.problem:
        return f"none{under}: {fit.problem}; --num_processes {fit.per_node} would give one"
    return f"{mesh.describe(fit.mesh)} over {nodes} node(s) x {per_node} process(es){under}"


def run(launch_args: list[str]) -> int:
    """`accelerate launch` in a worker thread, so that the stop signals stay ours (torch's elastic agent sets its
    handlers only in the main thread): the first sends each training process (our children, in sessions of their
    own) one SIGTERM, to save a checkpoint; later ones wait. Rank 0 says how it ended in RECIPE_STATUS_FILE."""
    global status_file
    import accelerate.commands.launch as accelerate_launch

    from common.runtime import die_with_parent

    parent = os.environ.pop("LAUNCH_SH_PID", "")
    die_with_parent(signal.SIGTERM, int(parent) if parent.isdigit() else None)  # launch.sh killed: a stop
    args = accelerate_launch.launch_command_parser().parse_args(launch_args)
    for name in ("torch.distributed.elastic", "torch.distributed.run"):  # what it says, launch.sh says in one line
        logging.getLogger(name).setLevel(logging.CRITICAL)  # (the printed command, run by hand, shows torch's log)
    logging.getLogger("accelerate.commands.launch").addFilter(  # that it chose the CPU threads asks nothing of us
        lambda record: not str(record.msg).startswith("The following values were not passed to `accelerate launch`")
    )
    fd, status_file = tempfile.mkstemp(prefix="launch-status.")
    os.close(fd)
    os.environ["RECIPE_STATUS_FILE"] = status_file
    grace = int(os.environ[SHUTDOWN])
    launch = ThreadPoolExecutor(1).submit(accelerate_launch.launch_command, args)  # raises in the main thread
    present, killed, deadline = set(), set(), 0.0
    while not launch.done():
        wait([launch], timeout=0.1)
        if not stops:
            continue
        alive = set(psutil.Process().children())  # torch's agent starts the processes in sessions of their own
        if not deadline:  # SIGTERM to those running: they finish their step, save a checkpoint and exit 75
            deadline, present = time.monotonic() + grace, alive
            Path(f"{status_file}.stop").write_text(stops[0])  # which stop it was, for their line (stop_name)
            kill(present, signal.SIGTERM)
        # SIGKILL to one started since, which has nothing to save (a restart under --max_restarts, each ended so in a
        # fraction of a second), and to those still running `grace` seconds on
        late = time.monotonic() > deadline
        for process in alive - killed - (set() if late else present):
            if process in present:
                say(f"process {process.pid} had not exited {grace} s after SIGTERM ({SHUTDOWN}): killed it")
            kill([process], signal.SIGKILL)
            killed.add(process)
        if not alive and (late or not present):  # none to stop: a rendezvous waiting for nodes that will not come
            break
    return job_exit_code(launch.exception() if launch.done() else None, stops[0] if stops else None, args)


def job_exit_code(err: BaseException | None, stop: str | None, args) -> int:
    """launch.sh's exit code, and the one line that says why where the processes could not."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    status = Path(status_file).read_text().strip()  # rank 0's: how the run ended
    # the last attempt finished (under --max_restarts, what an earlier one said is past)
    if status == "finished" and not (err or stop):
        return 0
    if (code := said_code()) is not None:  # a process said why the job ended (first_to_say): the others followed
        return code
    if stop and status == "finished":  # the stop came as the processes exited
        say(f"the run had finished when {stop} came; its model and results.json are complete (exit 0)")
        return 0
    if stop:  # they died of the SIGTERM starting, before their handlers
        return stopped_before("training", stop)
    if isinstance(err, ChildFailedError):
        rank, failure = first_failure(err.failures)
        return exit_code(failure.exitcode, f"process rank {rank} (pid {failure.pid})")
    if isinstance(err, subprocess.CalledProcessError):  # accelerate's launcher of one process without a group
        return exit_code(err.returncode, "the process")
    if isinstance(err, RendezvousError):  # a node that did not come, or a head that cannot be reached
        timeout = re.search(r"join_timeout=(\d+)", args.rdzv_conf) if "Timeout" in type(err).__name__ else None
        what = f"the nodes did not meet ({type(err).__name__}: {str(err).partition(chr(10))[0]})"
        die(
            f"{f'not every node joined within RDZV_TIMEOUT={timeout[1]} s' if timeout else what}; check that "
            f"launch.sh started on every node of the job and that each reaches {args.main_process_ip}:"
            f"{args.main_process_port}{' ($MASTER_ADDR)' if env('MASTER_ADDR') else ''} (see ./launch.sh doctor)"
        )
    if isinstance(err, ConnectionError) and "utilizing it" in str(err):  # accelerate's check of the head's port
        die(
            f"port {args.main_process_port} on this node is in use by another process; set MASTER_PORT to a free "
            "port (the same on every node)"
        )
    if isinstance(err, (ValueError, TypeError, KeyError, RuntimeError)):  # accelerate launch refusing the config
        from common.runtime import one_line

        die(
            f"{args.config_file}: accelerate launch refuses it: {one_line(err)}; correct the config, or pass another "
            "--config"
        )
    if err:
        raise err
    return 0


def said_code() -> int | None:
    """The exit code of the process that said why the last attempt ended (common.args.first_to_say), if one did."""
    said = sorted(glob.glob(f"{status_file}.said-*"), key=lambda path: int(path.rpartition("-")[2]))
    with suppress(OSError, ValueError, IndexError):
        return int(Path(said[-1]).read_text())
    return None


def first_failure(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the process that failed first. torch stamps whole seconds, and a process whose peer left
    often fails in the same one: then the one that said why is the cause (2: a user mistake, before 75: stopped,
    as torch's agent stops the others once one exits, unless one was SIGKILLed that second: their stop followed the
    kill), then one that did not lose its peer (124), then one that exited rather than was killed."""
    by_rank = sorted(failures.items())  # min() keeps the first of equals: the lowest rank
    # a process SIGKILLed (the OOM killer) in the second its peers stopped: their stop was torch's agent's, after it
    stopped = {failure.timestamp for _, failure in by_rank if failure.exitcode == 75}
    return min(by_rank, key=lambda rf: (rf[1].timestamp, rf[1].exitcode != 2,
                                        not (rf[1].exitcode == -signal.SIGKILL and rf[1].timestamp in stopped),
                                        rf[1].exitcode != 75, rf[1].exitcode == 124, rf[1].exitcode < 0))  # fmt: skip


def exit_code(exitcode: int, who: str) -> int:
    """A shell's exit code for a process's, saying why where the process could not: it was killed."""
    if exitcode >= 0:
        return exitcode
    if -exitcode in (signal.SIGTERM, signal.SIGUSR1):  # in its first seconds, before its handlers: nothing to save
        return stopped_before("training", signal.Signals(-exitcode).name)
    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
    say(f"{who} was killed by {name}{' (out of memory? see dmesg)' if -exitcode == signal.SIGKILL else ''}")
    return 128 - exitcode


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, on_stop)
    if os.environ.get("LAUNCH_SH_PID") == str(os.getppid()):  # a stop that came before this line is sent again
        os.kill(os.getppid(), signal.SIGUSR2)
    try:
        finish(main(sys.argv[1:]))
    except SystemExit as exit_:
        finish(exit_.code if isinstance(exit_.code, int) else 1)
    except Exception:  # a bug: its traceback is the report
        traceback.print_exc()
        finish(1)
