"""The model card: README.md in --output_dir at the end of a run, as transformers' Trainer writes one (YAML front
matter the Hub reads, then prose), with the training curves and, for a classifier, its confusion matrix as PNGs.
Everything on it comes from the run's results.json record; credentials never do (the arguments are masked there).

    README.md               the card: model, data and digests, the command, hyperparameters, metrics, how to upload
    training_curves.png     loss, learning rate and held-out metrics against samples seen (with matplotlib)
    confusion_matrix.png    the image recipe's, over the held-out set (with matplotlib)

A run writes only what it owns: a README.md (or picture) there that no run recorded writing is the user's, and is
left as it is. peft's README.md of a LoRA run is the run's (save_model recorded it) and the card replaces it."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

from . import mesh, tensor_parallel
from .args import LAUNCH_SH_ENV, mask_secrets, mask_words
from .checkpoint import model_files
from .runtime import logger

CARD, CURVES, CONFUSION = "README.md", "training_curves.png", "confusion_matrix.png"
# What `hf upload` leaves out of the output folder: the checkpoints (resume state, not the model) and the hidden files
# (the lock of a run in progress, the run's record of its files, a save's temporary folders). Patterns of
# huggingface_hub's filter_repo_objects (fnmatch, `*` crossing "/").
UPLOAD_EXCLUDE = ("checkpoint-*", ".*")
LINKED = ("samples.jsonl", "merged")  # linked from the card when a run left them there
CONFIGS = Path(__file__).resolve().parents[1] / "accelerate_configs"
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def launch_record(accelerator, args) -> dict:
    """How this run was launched, as a command that launches it again (./launch.sh with the accelerate config of this
    strategy, the processes of a node, the precision and the recipe's arguments, credentials masked) and in words."""
    kind, processes = accelerator.distributed_type.value, accelerator.num_processes
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    nodes = max(processes // per_node, 1)
    if kind == "DEEPSPEED":
        plugin = accelerator.state.deepspeed_plugin
        offload = plugin.deepspeed_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
        offload = offload not in (None, "none")
        config = {2: "zero2", 3: "zero3_offload" if offload else "zero3"}.get(plugin.zero_stage, "")
        strategy = f"DeepSpeed ZeRO-{plugin.zero_stage}{' with optimizer offload' if offload else ''}"
    elif kind == "FSDP" and (sizes := mesh.from_environment()) and sizes["dp_replicate"] > 1:
        config = "hsdp_multi_node" if nodes > 1 else "hsdp"
        strategy = f"HSDP on FSDP2, mesh {mesh.describe(sizes)}"
    elif kind == "FSDP":
        config, strategy = "fsdp", "FSDP2"
    elif (tp := tensor_parallel.degree()) > 1:  # presented as MULTI_GPU, as DDP is
        config, strategy = "tp", f"tensor parallelism, each layer split over {tp} processes"
        if (sizes := mesh.from_environment())["dp_shard"] > 1:  # the 2-D case
            strategy += f", sharded with FSDP2 across {sizes['dp_shard']} such groups (mesh {mesh.describe(sizes)})"
    elif accelerator.device.type == "cpu":
        config, strategy = "cpu", "DDP over gloo on CPU" if processes > 1 else "one CPU process"
    else:
        config = f"{per_node}gpu" if (CONFIGS / f"{per_node}gpu.yaml").is_file() else "2gpu"
        strategy = f"DDP over NCCL on {accelerator.device.type.upper()}" if processes > 1 else "one GPU"
    script = Path(sys.argv[0])
    recipe = args.recipe if script.resolve() == RECIPES / f"{args.recipe}.py" else str(script)
    # launch.sh as the run was started from its folder: ./launch.sh there, else by its path, with the folder to cd to
    here, launch_sh = Path.cwd(), Path(os.environ.get(LAUNCH_SH_ENV) or RECIPES.parent / "launch.sh")
    at_home = launch_sh.resolve() == (here / "launch.sh").resolve()
    launch = ["./launch.sh" if at_home else str(launch_sh), recipe, *(["--config", config] if config else [])]
    launch += ["--num_processes", str(per_node)]
    if accelerator.mixed_precision in ("no", "bf16", "fp16"):
        launch += ["--mixed_precision", accelerator.mixed_precision]
    return {
        "command": shlex.join(launch + mask_words(sys.argv[1:])),
        "cwd": None if at_home else mask_secrets(str(here)),  # the folder the command's relative paths are from
        "strategy": strategy,
        "distributed_type": kind,
        "processes": processes,
        "nodes": nodes,
        "mixed_precision": accelerator.mixed_precision,
    }


def write_card(output_dir, record: dict) -> list:
    """The card and its pictures from `record` (results.json's), each written atomically; the names written (for the
    run's record of its files). A README.md no run wrote is kept and no card written, said in one info line."""
    output_dir = Path(output_dir)
    ours = set(model_files(output_dir))
    theirs = [n for n in (CARD, CURVES, CONFUSION) if (output_dir / n).exists() and n not in ours]
    for name in theirs:
        what = "the model card" if name == CARD else "this picture"
        logger.info(f"{output_dir / name} is no run's (yours?): kept as it is, and {what} not written")
    written = []
    pictures = (CURVES, _plot_curves), (CONFUSION, _plot_confusion)
    if any(name not in theirs for name, _ in pictures):
        if importlib.util.find_spec("matplotlib") is None:  # the optional extra `bench`
            logger.info("matplotlib is not installed (pip install -e '.[bench]'): the model card has no pictures")
            pictures = ()
        for name, plot in pictures:
            if name not in theirs and plot(record, output_dir / name):
                written.append(name)
    if CARD not in theirs:
        _atomic_write(output_dir / CARD, lambda path: path.write_text(card_text(output_dir, record, written)))
        written.append(CARD)
    return written


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)` then a rename: a reader never sees half a file, a failure leaves none."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# The card ------------------------------------------------------------------------------------------------------


def _hub_id(name) -> bool:
    """Whether `name` reads as a Hub repository id (owner/name, or a legacy name) rather than a local path: only
    those go in the front matter, whose base_model and datasets the Hub checks."""
    return bool(name) and not Path(name).exists() and bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name))


def front_matter(record: dict) -> str:
    """The metadata the Hub reads (huggingface_hub's ModelCardData, as transformers' Trainer fills it)."""
    from huggingface_hub import ModelCardData

    args = record.get("args", {})
    image, model, lora = args.get("recipe") == "cifar", args.get("model", ""), bool(args.get("lora_r"))
    if image:  # timm's published weights are a Hub repository; torchvision's are not
        base = model if model.startswith("timm/") and args.get("pretrained") else None
        library, tags = "timm" if model.startswith("timm/") else "pytorch", ["image-classification", "torchvision"]
    else:
        base = args.get("model_name_or_path") if _hub_id(args.get("model_name_or_path")) else None
        library, tags = "peft" if lora else "transformers", ["text-generation", *(["lora"] if lora else [])]
    data = None if image else args.get("dataset_name")
    return ModelCardData(
        library_name=library,
        base_model=base,
        tags=["accelerate-recipes", args.get("recipe", "recipe"), *tags],
        datasets=[data] if _hub_id(data) else None,
        metrics=["accuracy"] if image else ["loss", "perplexity"],
    ).to_yaml()


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _sources(record: dict) -> list:
    """The data the run read, each with its digest where one is recorded or cheap (a file's sha256 is remembered in
    the datasets cache by common.prepared, which computed it to prepare the blocks)."""
    args, lines = record.get("args", {}), []
    if args.get("recipe") == "cifar":
        if args.get("dataset") == "imagefolder":
            lines += [
                f"- training images: ImageFolder `{args.get('train_dir')}`",
                f"- held-out images: `{args.get('val_dir')}`",
            ]
        else:
            lines.append(f"- {args.get('dataset')}, torchvision's download (train split; test split held out)")
    else:
        if args.get("dataset_name"):
            config = f" ({args['dataset_config_name']})" if args.get("dataset_config_name") else ""
            lines.append(f"- dataset `{args['dataset_name']}`{config}")
        for flag in ("train_file", "validation_file"):
            if path := args.get(flag):
                lines.append(f"- --{flag} `{path}`, sha256 `{_file_sha256(path)}`")
        if not args.get("validation_file") and not args.get("streaming"):
            lines.append(
                f"- held out: {args.get('validation_split_percentage')}% of the training rows, by --seed "
                f"{args.get('seed')}"
            )
    if fingerprint := record.get("data_fingerprint"):
        lines.append(
            f"- training data fingerprint `{fingerprint}` (common.data.fingerprint: what a checkpoint of this run "
            "resumes only with)"
        )
    return lines


def _file_sha256(path) -> str:
    try:
        from .prepared import file_sha256

        return file_sha256(path)
    except (OSError, ImportError) as err:  # moved since, or datasets not installed
        return f"unknown ({type(err).__name__})"


def card_text(output_dir: Path, record: dict, pictures: list) -> str:
    args, launch = record.get("args", {}), record.get("launch", {})
    image = args.get("recipe") == "cifar"
    model = (
        args.get("model") if image else args.get("model_name_or_path") or f"a new model of {args.get('config_name')}"
    )
    tuned = (
        "from torchvision's/timm's published weights" if args.get("pretrained")
        else f"from `{args['pretrained_path']}`" if args.get("pretrained_path")
        else "from random weights" if image
        else "from a new model (random weights)" if args.get("config_name")
        else "fine-tuned from it"
    )  # fmt: skip
    adapter = (
        f", a LoRA adapter of rank {args['lora_r']} (alpha {args.get('lora_alpha')})" if args.get("lora_r") else ""
    )
    name = output_dir.name
    lines = [
        "---",
        front_matter(record).rstrip("\n"),
        "---",
        "",
        f"# {name}",
        "",
        f"Trained with accelerate-recipes' `recipes/{args.get('recipe')}.py`: `{model}`, {tuned}{adapter}.",
        "",
        "## Data",
        "",
        *_sources(record),
        "",
        "## How it was trained",
        "",
        f"{launch.get('strategy', record.get('distributed_type'))} ({record.get('world_size')} process(es))"
        + (f" on {launch['nodes']} nodes (one launch.sh per node)" if launch.get("nodes", 1) > 1 else "")
        + f", mixed precision {record.get('mixed_precision')}. The command, from the folder it was started in:",
        "",
        "```bash",
        *([f"cd {shlex.quote(launch['cwd'])}"] if launch.get("cwd") else []),
        launch.get("command", "(not recorded)"),
        "```",
        "",
        "| hyperparameter | value |",
        "|---|---|",
    ]
    batch = (
        f"{record.get('effective_batch_size')} ({args.get('per_device_train_batch_size')} a process x "
        f"{record.get('world_size')} processes x {args.get('gradient_accumulation_steps')} accumulation)"
    )
    scaled = f"{_number(record.get('learning_rate'))} ({_number(args.get('learning_rate'))} for "
    scaled += f"{args.get('reference_batch_size')} samples, scaled {args.get('lr_scaling')})"
    warmup = record.get("warmup_steps")
    rows = [
        ("effective batch", batch),
        ("learning rate", scaled),
        ("schedule", f"{args.get('lr_scheduler_type')}" + (f", {warmup} warmup steps" if warmup is not None else "")),
        (
            "steps",
            f"{record.get('steps')} (epochs {record.get('epochs')}, {_number(record.get('samples_seen'))} samples)",
        ),
        ("optimizer", args.get("optimizer", "adamw")),
        ("weight decay", args.get("weight_decay")),
        ("max grad norm", args.get("max_grad_norm")),
        ("seed", args.get("seed")),
    ]
    lines += [f"| {k} | {_number(v)} |" for k, v in rows if v is not None]
    metrics = [k for k in ("eval_accuracy", "eval_loss", "perplexity", "eval_samples", "eval_tokens", "train_loss")
               if record.get(k) is not None]  # fmt: skip
    lines += ["", "## Results", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_number(record[k])} |" for k in metrics]
    if per_class := record.get("eval_per_class_accuracy"):
        samples = record.get("eval_per_class_samples", {})
        lines += ["", "| class | held-out samples | accuracy |", "|---|---|---|"]
        lines += [
            f"| {c} | {samples.get(c, '')} | {_number(per_class[c])} |" for c in record.get("class_names", per_class)
        ]
    lines.append("")
    if CURVES in pictures:
        lines += [f"![training curves]({CURVES})", ""]
    if CONFUSION in pictures:
        lines += [f"![confusion matrix over the held-out set]({CONFUSION})", ""]
    if present := [n for n in LINKED if (output_dir / n).exists()]:
        lines += [
            "## Also here",
            "",
            *[f"- [{n}]({n}{'/' if (output_dir / n).is_dir() else ''})" for n in present],
            "",
        ]
    lines += ["## Use and share", ""]
    if image:
        lines += [
            f"`model.safetensors` loads into the model the recipe builds; `scripts/predict.py {output_dir} IMAGE...` "
            "prints each image's top labels (`--json` for JSON lines).",
            "",
        ]
    elif (output_dir / "adapter_config.json").exists():  # a LoRA run: the adapter here, merged beside it
        lines += [
            f"The adapter loads with peft's `AutoPeftModelForCausalLM.from_pretrained({str(output_dir)!r})`; "
            f"`merged/`, the adapter merged into the base weights, with "
            f"`AutoModelForCausalLM.from_pretrained({str(output_dir / 'merged')!r})`, without peft.",
            "",
        ]
    else:
        lines += [
            f"The `save_pretrained` files load with `AutoModelForCausalLM.from_pretrained({str(output_dir)!r})`.",
            "",
        ]
    excludes = " ".join(f"--exclude {shlex.quote(p)}" for p in UPLOAD_EXCLUDE)
    lines += [
        "Upload this folder without its checkpoints and hidden files (the lock, the run's record of its files); drop "
        "the first `--exclude` to include the checkpoints:",
        "",
        "```bash",
        f"hf upload YOUR_NAME/{name} {shlex.quote(str(output_dir))} . {excludes}",
        "```",
        "",
    ]
    return "\n".join(lines)


# The pictures --------------------------------------------------------------------------------------------------


def _figure(panels: int, width: float = 4.0, height: float = 3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display, no global pyplot state
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * panels, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(1, panels, squeeze=False)[0]


def _save(figure, path: Path) -> bool:
    _atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=100))
    return True


COUNTS = {"eval_samples", "eval_tokens", "step", "samples_seen", "epoch"}


def _plot_curves(record: dict, path: Path) -> bool:
    """Training loss, learning rate and each held-out metric against samples seen (results.json's log_history and
    eval_history)."""
    logs, evals = record.get("log_history", []), record.get("eval_history", [])
    series = [("train_loss", logs), ("lr", logs)]
    series += [(k, evals) for k in dict.fromkeys(k for e in evals for k in e) if k not in COUNTS]
    series = [(k, rows) for k, rows in series if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not series:
        return False
    figure, axes = _figure(len(series))
    for ax, (key, rows) in zip(axes, series):
        points = [(r["samples_seen"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3)
        ax.set(title="learning rate" if key == "lr" else key, xlabel="samples seen")
        ax.grid(alpha=0.3)
    return _save(figure, path)


def _plot_confusion(record: dict, path: Path) -> bool:
    """Rows: the true class, columns: the predicted one, over the held-out set (counts written in when few)."""
    matrix, names = record.get("eval_confusion_matrix"), record.get("class_names")
    if not matrix or not names:
        return False
    n = len(names)
    size = min(max(4.0, 0.45 * n), 20.0)
    figure, (ax,) = _figure(1, size + 1, size)
    shown = ax.imshow(matrix, cmap="Blues")
    figure.colorbar(shown, ax=ax, shrink=0.8)
    if n <= 40:
        ax.set_xticks(range(n), names, rotation=90, fontsize=8)
        ax.set_yticks(range(n), names, fontsize=8)
    if n <= 20:
        top = max(max(row) for row in matrix) or 1
        for i, row in enumerate(matrix):
            for j, count in enumerate(row):
                if count:
                    ax.text(
                        j,
                        i,
                        count,
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if count > top / 2 else "black",
                    )
    ax.set(xlabel="predicted", ylabel="true", title=f"held-out set, accuracy {record.get('eval_accuracy', 0):.4f}")
    return _save(figure, path)
