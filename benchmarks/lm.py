"""LM: recipes/lm_finetune.py's tokens/s, MFU and peak memory per process under DDP, ZeRO-2, ZeRO-3,
ZeRO-3 with CPU offload, FSDP2, HSDP (2 copies, each sharded over half the processes) and tensor parallelism (tp.yaml:
2 processes that share each batch, each layer split over them), for the same Llama
(built from a config in a local folder: nothing downloaded) on the same packed text. Values come from each run's
results.json.

    .venv/bin/python benchmarks/lm.py                                  # CPU: 2 processes, fp32
    .venv/bin/python benchmarks/lm.py --configs ddp fsdp hsdp --processes 4   # the sharding strategies side by side
    .venv/bin/python benchmarks/lm.py --configs ddp tp --processes 2          # tensor parallelism (a batch per 2)
    .venv/bin/python benchmarks/lm.py --hidden_size 2048 --num_layers 16 --block_size 1024 --torch_compile   # GPUs

MFU is reported on A100/H100/H200 only (common/metrics.py knows their bf16 peak); on CPU it is
empty. Peak memory is the CUDA allocator's peak on GPUs, the resident set on CPU (which includes
the Python runtime and, under DeepSpeed, its libraries: compare sharding savings on GPUs, or with a
model large enough for its states to dominate). The first DeepSpeed run on a machine builds a C++
op (40-60 s); that run's start-up, not its tokens/s, pays for it. HSDP needs 4 processes or more: with it every
config runs in as many. On CPU, processes share the cores and gloo's links are memory copies: the numbers show each
strategy's memory per process and its cost in communication on one machine, not its speed between GPUs or nodes
(where HSDP's point is that per-layer traffic stays within a node).
"""

import benchlib

NAME = "lm"
CONFIGS = {"ddp": None, "zero2": "zero2", "zero3": "zero3", "zero3_offload": "zero3_offload"}
CONFIGS |= {"fsdp": "fsdp", "hsdp": "hsdp", "tp": "tp"}  # hsdp: 4 processes or more; tp: 2 (tp.yaml's degree)


def build_parser():
    p = benchlib.parser(__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="default: all but hsdp and tp (smoke: ddp)")
    p.add_argument("--processes", type="positive_int", help="default: 2 (CPU) or every GPU")
    p.add_argument("--hidden_size", type="positive_int")
    p.add_argument("--num_layers", type="positive_int")
    p.add_argument("--block_size", type="positive_int")
    p.add_argument("--per_device_train_batch_size", type="positive_int", default=8)
    p.add_argument("--steps", type="positive_int")
    p.add_argument("--torch_compile", action="store_true", help="add a DDP run with --torch_compile")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    gpus = benchlib.machine()["gpus"]
    big = gpus and not args.smoke
    args.configs = args.configs or (["ddp"] if args.smoke else [c for c in CONFIGS if c not in ("hsdp", "tp")])
    args.processes = args.processes or max(2, gpus)
    if "hsdp" in args.configs:  # 2 copies of at least 2 shards; the others alike, to compare
        args.processes = max(args.processes, 4)
    args.hidden_size = args.hidden_size or (2048 if big else 64 if args.smoke else 256)
    args.num_layers = args.num_layers or (16 if big else 2 if args.smoke else 4)
    args.block_size = args.block_size or (1024 if big else 32 if args.smoke else 128)
    args.steps = args.steps or (3 if args.smoke else 20)
    # On CPU each DeepSpeed launch spends ~40 s starting for ~10 s of training: one repetition.
    args.repeats = args.repeats or (1 if args.smoke or not gpus else 2)
    args.work_dir = args.work_dir or args.out / "work"
    return args


def main(argv=None):
    args = parse_args(argv)
    lm = benchlib.tiny_lm(
        args.work_dir, args.hidden_size, args.num_layers, args.block_size, lines=200 if args.smoke else 3000
    )
    runs = [(name, CONFIGS[name], []) for name in args.configs]
    if args.torch_compile:
        runs.append(("ddp + torch_compile", None, ["--torch_compile"]))
    measured, dirs = {}, {}
    for rep in range(args.repeats):
        for name, config, extra in runs:
            res, out = benchlib.recipe_run(
                args,
                "lm_finetune",
                args.processes,
                [
                    "--model_name_or_path",
                    lm["model"],
                    "--train_file",
                    lm["train"],
                    "--validation_file",
                    lm["validation"],
                    "--block_size",
                    args.block_size,
                    "--per_device_train_batch_size",
                    args.per_device_train_batch_size,
                    "--max_train_steps",
                    args.steps,
                    "--logging_steps",
                    args.steps,
                    *extra,
                ],
                rep,
                config=config,
            )
            measured.setdefault(name, []).append(res)
            dirs.setdefault(name, []).append(str(out))

    results, rows = [], []
    ddp_tokens = None
    for name, reps in measured.items():
        tokens = benchlib.median([r["steady_tokens_per_second"] for r in reps])
        mfus = [r["mfu"] for r in reps if r.get("mfu") is not None]
        last = reps[-1]
        ddp_tokens = tokens if name == "ddp" else ddp_tokens
        entry = {
            "config": name,
            "processes": last["world_size"],
            "distributed_type": last["distributed_type"],
            "mixed_precision": last["mixed_precision"],
            "parameters": last["parameters"],
            "parameters_per_process": last["parameters_per_process"],
            "tokens_per_second": tokens,
            "all_tokens_per_second": [r["steady_tokens_per_second"] for r in reps],
            "runs": dirs[name],
            "mfu": benchlib.median(mfus),
            "peak_memory_gb_per_process": last["peak_memory_gb_per_process"],
            "peak_memory_kind": last["peak_memory_kind"],
            "train_loss": last["train_loss"],
        }
        results.append(entry)
        precision = "fp32" if entry["mixed_precision"] == "no" else entry["mixed_precision"]
        rows.append(
            [
                name,
                entry["processes"],
                precision,
                tokens,
                tokens / ddp_tokens if ddp_tokens else None,
                None if entry["mfu"] is None else f"{100 * entry['mfu']:.1f}%",
                " / ".join(f"{g:.2f}" for g in entry["peak_memory_gb_per_process"]),
                " / ".join(f"{n:,}" for n in entry["parameters_per_process"]),
            ]
        )
    kind = results[0]["peak_memory_kind"]
    md = (
        f"### LM: recipes/lm_finetune.py under DDP, ZeRO, FSDP2 and HSDP\n\nLlama {args.hidden_size} hidden x "
        f"{args.num_layers} layers ({results[0]['parameters']:,} parameters), packed blocks of {args.block_size}, "
        f"per-device batch {args.per_device_train_batch_size}, {args.steps} steps, {args.processes} processes, "
        f"median of {args.repeats}; tokens/s after the first step. Peak memory: {kind} (GB per process).\n\n"
        + benchlib.markdown_table(
            [
                "config",
                "processes",
                "precision",
                "tokens/s",
                "vs DDP",
                "MFU",
                "peak memory GB",
                "parameters held per process",
            ],
            rows,
        )
    )
    benchlib.save(args.out, NAME, {"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}, md)


if __name__ == "__main__":
    main()
