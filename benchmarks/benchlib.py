"""What the benchmark scripts share: the machine they ran on, launching recipes as users do,
medians, JSON/markdown output and plots. Measurements are always ratios or rates taken in the
same run; nothing here asserts a speed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACCELERATE_LAUNCH = BIN / "accelerate-launch"  # `accelerate launch` without the CLI's imports of its other commands
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from launcher import free_port  # noqa: E402  (launch.sh's own)

from common import mesh  # noqa: E402
from common.args import ArgumentParser  # noqa: E402


def parser(description: str) -> ArgumentParser:
    """The options every benchmark takes, on the recipes' parser (one error line, numbers checked)."""
    p = ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=RESULTS, help="where <name>.json, <name>.md and plots go")
    p.add_argument(
        "--smoke", action="store_true", help="the smallest setting: keeps the script working, measures little"
    )
    p.add_argument("--repeats", type="positive_int", help="repetitions per measurement (the median is reported)")
    p.add_argument("--work_dir", type=Path, help="scratch folder for data and run outputs (default: OUT/work)")
    p.add_argument(
        "--reuse_runs",
        action="store_true",
        help="take a recipe run with the same command and repetition from WORK_DIR/runs instead of "
        "launching it again (run_all.py clears that folder, then shares runs between benchmarks)",
    )
    return p


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine() -> dict:
    """The hardware and software a result came from, and how loaded the machine was."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cores": cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    for name in ("accelerate", "transformers", "deepspeed"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            pass
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    else:
        info.update(gpu=None, gpus=0)
    return info


def describe(m: dict) -> str:
    where = f"{m['gpus']} x {m['gpu']}, CUDA {m['cuda']}" if m.get("gpu") else "no GPU"
    return (
        f"{m['cpu']}, {m['cores']} cores, {where}; Python {m['python']}, torch {m['torch']}, "
        f"accelerate {m.get('accelerate', '-')}; 1-min load average {m['load_average_1min']} at start"
    )


def median(values):
    return statistics.median(values) if values else None


def env_for(nproc: int, **extra) -> dict:
    """A user's environment: the venv first, offline, a fresh port, and each process's share of the
    cores as its thread count (torchrun and accelerate launch set 1 for N > 1 otherwise)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "PYTEST_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["MASTER_PORT"] = str(free_port())
    env["OMP_NUM_THREADS"] = str(max(1, cores() // nproc))
    env["HF_HUB_OFFLINE"] = env["HF_DATASETS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(cmd, env=None, timeout=1800) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(
            f"benchmark command failed ({proc.returncode}): {shlex.join(cmd)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def accelerate_config(nproc: int, config: str | None = None) -> tuple[list, dict]:
    """The `accelerate launch` arguments and environment a user would use for nproc processes:
    cpu.yaml with ACCELERATE_USE_CPU=true without CUDA, otherwise the GPU config (bf16)."""
    if config is None:
        config = ("1gpu" if nproc == 1 else "2gpu") if has_cuda() else "cpu"
    env = env_for(nproc, **({"ACCELERATE_USE_CPU": "true"} if config == "cpu" else {}))
    args = [
        ACCELERATE_LAUNCH,
        "--config_file",
        REPO / "accelerate_configs" / f"{config}.yaml",
        "--num_processes",
        nproc,
        "--main_process_port",
        env["MASTER_PORT"],
    ]
    if config != "cpu" and not has_cuda():  # DeepSpeed, FSDP2, a mesh on CPU: fp32, as launch.sh runs them
        args += ["--mixed_precision", "no"]
    yaml_config = yaml.safe_load((REPO / "accelerate_configs" / f"{config}.yaml").read_text())
    if sizes := mesh.from_config(yaml_config):  # HSDP's or TP's mesh sized to the processes, as launch.sh does
        fit = mesh.fitted(sizes, 1, nproc)
        if fit.problem:
            raise SystemExit(f"{config}.yaml: {fit.problem}; pass --processes {fit.per_node}")
        args += mesh.options(fit.mesh)
    if config == "cpu" and nproc == 1:  # no process group of one, as launch.sh does
        args += ["--cpu"]
    return args, env


def launch_recipe(recipe: str, nproc: int, recipe_args, output_dir: Path, config: str | None = None) -> dict:
    """Run recipes/<recipe>.py under accelerate launch and return its results.json."""
    launch, env = accelerate_config(nproc, config)
    shutil.rmtree(output_dir, ignore_errors=True)  # a fresh run each time, never a resumed one
    run([*launch, REPO / "recipes" / f"{recipe}.py", *recipe_args, "--output_dir", output_dir], env=env)
    for path in Path(output_dir).iterdir():  # keep the record, not the weights and checkpoints
        if path.is_dir():
            shutil.rmtree(path)
        elif path.name != "results.json":
            path.unlink()
    return json.loads((Path(output_dir) / "results.json").read_text())


def recipe_run(args, recipe: str, nproc: int, recipe_args, rep: int, config: str | None = None) -> tuple[dict, Path]:
    """(results.json, run folder) of repetition `rep` of recipes/<recipe>.py with these arguments.
    The folder is named after the command, so with --reuse_runs a benchmark takes a run another
    one already made (scaling's weak-scaling points are overhead's recipe runs)."""
    command = json.dumps([recipe, nproc, config, [str(a) for a in recipe_args]])
    out = Path(args.work_dir) / "runs" / f"{recipe}-{nproc}p-{hashlib.sha1(command.encode()).hexdigest()[:10]}-{rep}"
    if getattr(args, "reuse_runs", False) and (out / "results.json").is_file():
        return json.loads((out / "results.json").read_text()), out
    return launch_recipe(recipe, nproc, recipe_args, out, config), out


def cifar_data_args(args) -> list:
    """recipes/cifar.py's data arguments: CIFAR-10 in --cifar_dir, else the digits as an ImageFolder."""
    if getattr(args, "cifar_dir", None):
        return ["--dataset", "cifar10", "--data_dir", str(args.cifar_dir)]
    d = digits(args.work_dir)
    return ["--dataset", "imagefolder", "--train_dir", str(d["train"]), "--val_dir", str(d["val"])]


def cifar_args(args, per_device: int, steps: int, accumulation: int = 1, data_on_device: bool = True) -> list:
    """recipes/cifar.py's arguments for a benchmark run: the data, --model, the batch."""
    return [
        *cifar_data_args(args),
        "--model",
        args.model,
        "--per_device_train_batch_size",
        per_device,
        "--gradient_accumulation_steps",
        accumulation,
        "--max_train_steps",
        steps,
        "--logging_steps",
        1,
        "--data_on_device" if data_on_device else "--no-data_on_device",
        *(["--torch_compile"] if getattr(args, "torch_compile", False) else []),
    ]


def median_step_rate(res: dict) -> float | None:
    """Samples/s at the median optimizer step of a run logged every step (--logging_steps 1),
    the first step left out. On a shared machine other jobs only ever slow steps down, and they
    come and go within seconds: the median step is the undisturbed one, where the mean of a short
    run moves by 10-20% with the load."""
    ends = [h["train_seconds"] for h in res["log_history"]]
    if len(ends) < 3 or [h["step"] for h in res["log_history"]] != list(range(1, len(ends) + 1)):
        return None  # not logged every step
    return res["effective_batch_size"] / statistics.median(b - a for a, b in zip(ends[:-1], ends[1:]))


def digits(work_dir: Path) -> dict:
    """scikit-learn's handwritten digits as a 32x32 ImageFolder (no download): 1400 train, 397 val."""
    from make_digits import write_digits

    root = Path(work_dir) / "digits"
    if not root.is_dir():
        with made_whole(root) as tmp:
            write_digits(tmp)
    return {"train": root / "train", "val": root / "val"}


@contextlib.contextmanager
def made_whole(folder: Path):
    """A folder written beside `folder` and renamed to it when complete: a benchmark stopped while it wrote leaves
    no half of one that the next would take for the whole (416 of 1797 images, a PNG of 0 bytes)."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    yield tmp
    os.replace(tmp, folder)


NUMBERS = "zero one two three four five six seven eight nine".split()


def tiny_lm(work_dir: Path, hidden_size=64, num_layers=2, block_size=64, lines=600) -> dict:
    """A Llama of the given size built from a config and saved like a hub model, a word-level
    tokenizer and counting text: no network, nothing downloaded (as tests/conftest.py's tiny_lm)."""
    final = Path(work_dir) / f"lm-{hidden_size}x{num_layers}"
    if not final.is_dir():
        with made_whole(final) as root:
            _write_tiny_lm(root, hidden_size, num_layers, block_size, lines)
    return {"model": final / "model", "train": final / "train.jsonl", "validation": final / "validation.jsonl"}


def _write_tiny_lm(root: Path, hidden_size: int, num_layers: int, block_size: int, lines: int) -> None:
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", *NUMBERS]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", model_max_length=block_size
    )
    tokenizer.save_pretrained(root / "model")
    heads = max(1, hidden_size // 64)
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=block_size,
        eos_token_id=1,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    rng = random.Random(0)
    for name, count in (("train", lines), ("validation", max(20, lines // 20))):
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(count):
                start = rng.randrange(10)
                text = " ".join(NUMBERS[(start + i) % 10] for i in range(rng.randrange(20, 60)))
                f.write(json.dumps({"text": text}) + "\n")


def markdown_table(headers, rows) -> str:
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save(out: Path, name: str, payload: dict, markdown: str) -> Path:
    """<out>/<name>.json (the measurements, the machine, the command) and <out>/<name>.md."""
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        **payload,
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown.rstrip() + "\n")
    return out / f"{name}.json"


def machine_now() -> str:
    """The CPU, its cores and the load average now: the line the data benchmarks (prepare, streaming, loader) start
    with, since other jobs' load skews every rate they measure."""
    import platform

    load = os.getloadavg()[0]
    return f"{platform.processor() or platform.machine()}, {cores()} cores, load average {load:.1f} at start"


def in_fresh_process(script: str, work: Path, *argv) -> dict:
    """The JSON `script --_measure <argv>` prints last, run in a process of its own with a fresh datasets cache under
    `work` (nothing imported or cached before it)."""
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, script, "--_measure", *map(str, argv)], env=env, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{argv} failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(cache, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def publish(args, name: str, result: dict, markdown: str) -> None:
    """<out>/<name>.json and <name>.md, the table printed, and, with the default --out and not --smoke, the table in
    benchmarks/README.md between <!-- <name>.py --> and <!-- /<name>.py -->."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown)
    print(markdown)
    if args.out == RESULTS and not args.smoke:
        readme = REPO / "benchmarks" / "README.md"
        section = re.compile(rf"(<!-- {name}.py -->\n).*?(<!-- /{name}.py -->)", re.S)
        readme.write_text(section.sub(lambda m: m.group(1) + markdown + m.group(2), readme.read_text()))


def plot(path: Path, title: str, xlabel: str, panels) -> Path:
    """A PNG with one panel per (ylabel, {series name: (xs, ys)}) in `panels`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xticks(sorted({x for xs, _ in series.values() for x in xs}))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_recipe(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
