"""Overhead: recipes/cifar.py, launched as users launch it, against hand-written PyTorch loops on the
same model, data, batch and precision (benchmarks/baseline_loop.py: plain PyTorch in one process,
DDP + DistributedSampler under torchrun in N). Runs alternate, several repetitions; the median of
the per-repetition ratios is reported. Also: gradient accumulation with DDP's no_sync against an
all-reduce after every micro-batch, the saving `accelerator.accumulate` gives the recipe.

    .venv/bin/python benchmarks/overhead.py                 # CPU: 1 and 2 processes
    .venv/bin/python benchmarks/overhead.py --smoke         # a few steps, to keep it working

Samples/s are taken at the median optimizer step: the recipe logs every step (its log_history
holds the training time at each), the loops time each step the same way, after the loss reached
the host. The first step (one-time costs: kernel choice, the allocator's first requests) is left
out, and the median ignores the steps another job on a shared machine slowed down, which move a
short run's mean by 10-20%. Default data path: --data_on_device (the whole set as
uint8 on the device, batches cut there), so the comparison is of training-loop overhead, not of
image decoding; --data loader compares the worker-process path instead.
"""

import json

import benchlib

NAME = "overhead"


def build_parser():
    p = benchlib.parser(__doc__.split("\n")[0])
    p.add_argument("--processes", type="positive_int", nargs="+", help="default: 1 and 2 (CPU) or 1 and every GPU")
    p.add_argument("--steps", type="positive_int", help="optimizer steps per run")
    p.add_argument("--per_device_train_batch_size", type="positive_int", default=32)
    p.add_argument("--model", help="default: resnet18 (CPU: a stride-2 stem, fast), resnet18_cifar (GPU)")
    p.add_argument(
        "--accumulation", type="positive_int", default=4, help="micro-batches per step in the accumulation rows"
    )
    p.add_argument("--data", choices=["device", "loader"], default="device")
    p.add_argument("--cifar_dir", help="measure on CIFAR-10 in this folder instead of the bundled digits")
    p.add_argument("--torch_compile", action="store_true")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    gpus = benchlib.machine()["gpus"]
    args.processes = args.processes or ([1] if args.smoke else [1, max(2, gpus)] if gpus > 1 else [1, 2])
    args.steps = args.steps or (3 if args.smoke else 40)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.model = args.model or ("resnet18_cifar" if gpus else "resnet18")
    args.work_dir = args.work_dir or args.out / "work"
    return args


def accumulation_steps(args, accumulation):
    """Optimizer steps of a run: as many samples with accumulation as without (at least 2 steps)."""
    return args.steps if accumulation == 1 else max(2, args.steps // accumulation)


def recipe_args(args, accumulation):
    return benchlib.cifar_args(
        args,
        args.per_device_train_batch_size,
        accumulation_steps(args, accumulation),
        accumulation,
        data_on_device=args.data == "device",
    )


def run_recipe(args, nproc, accumulation, rep):
    res, out = benchlib.recipe_run(args, "cifar", nproc, recipe_args(args, accumulation), rep)
    return benchlib.median_step_rate(res), out


def run_baseline(args, nproc, variants, tag):
    out = args.work_dir / f"baseline-{nproc}p-{tag}.json"
    script = benchlib.REPO / "benchmarks" / "baseline_loop.py"
    env = benchlib.env_for(nproc)
    launcher = (
        [benchlib.BIN / "python"]
        if nproc == 1
        else [benchlib.BIN / "torchrun", "--nproc_per_node", nproc, "--master_port", env["MASTER_PORT"]]
    )
    benchlib.run(
        [
            *launcher,
            script,
            "--out",
            out,
            "--variants",
            *variants,
            "--accumulation",
            args.accumulation,
            "--accumulation_max_steps",
            accumulation_steps(args, args.accumulation),
            "--",
            *recipe_args(args, 1),
        ],
        env=env,
    )
    return json.loads(out.read_text())["median_step_samples_per_second"], out


def run_step_cost(args):
    """benchmarks/step_cost.py in a process of its own: the machinery's microseconds per step."""
    out = args.work_dir / "step_cost.json"
    env = benchlib.env_for(1, **({} if benchlib.has_cuda() else {"ACCELERATE_USE_CPU": "true"}))
    benchlib.run(
        [
            benchlib.BIN / "python",
            benchlib.REPO / "benchmarks" / "step_cost.py",
            "--out",
            out,
            *(["--steps", 50, "--repeats", 1] if args.smoke else []),
        ],
        env=env,
    )
    return json.loads(out.read_text())


def main(argv=None):
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    step_cost = run_step_cost(args)
    rows = {}  # (processes, accumulation) -> {"recipe": [...], "ddp": [...], ..., "runs": [...]}
    for rep in range(args.repeats):
        for nproc in args.processes:
            accumulations = [1, args.accumulation] if nproc > 1 else [1]
            variants = ["ddp", "accum_no_sync", "accum_sync_every_step"] if nproc > 1 else ["ddp"]
            baseline_first = rep % 2 == 1  # alternate the order: drift in machine load hits both sides
            if baseline_first:
                base, base_file = run_baseline(args, nproc, variants, rep)
            recipe = {k: run_recipe(args, nproc, k, rep) for k in accumulations}
            if not baseline_first:
                base, base_file = run_baseline(args, nproc, variants, rep)
            for k in accumulations:
                row = rows.setdefault(
                    (nproc, k), {"recipe": [], "runs": [], "loop_runs": [], **{v: [] for v in variants}}
                )
                row["recipe"].append(recipe[k][0])
                row["runs"].append(str(recipe[k][1]))
                row["loop_runs"].append(str(base_file))
                for v in variants:
                    row[v].append(base[v])

    results, overhead_rows, accumulation_rows = [], [], []
    for (nproc, k), m in sorted(rows.items()):
        baseline = "ddp" if k == 1 else "accum_no_sync"
        ratios = [r / b for r, b in zip(m["recipe"], m[baseline])]
        entry = {
            "processes": nproc,
            "accumulation": k,
            "baseline": baseline,
            "recipe_samples_per_second": m["recipe"],
            "baseline_samples_per_second": m[baseline],
            "ratios": ratios,
            "median_ratio": benchlib.median(ratios),
            "spread": [min(ratios), max(ratios)],
            "recipe_runs": m["runs"],
            "loop_runs": m["loop_runs"],
        }
        name = ("plain PyTorch" if nproc == 1 else "DDP + DistributedSampler (torchrun)") + (
            f", no_sync x{k}" if k > 1 else ""
        )
        overhead_rows.append(
            [
                nproc,
                k,
                name,
                benchlib.median(m["recipe"]),
                benchlib.median(m[baseline]),
                entry["median_ratio"],
                f"{min(ratios):.3f}-{max(ratios):.3f}",
                "yes" if entry["median_ratio"] >= 0.98 else "no",
            ]
        )
        if k > 1:
            every = m["accum_sync_every_step"]
            gains = [n / e for n, e in zip(m["accum_no_sync"], every)]
            entry.update(
                sync_every_micro_step_samples_per_second=every,
                no_sync_speedups=gains,
                median_no_sync_speedup=benchlib.median(gains),
            )
            accumulation_rows.append(
                [
                    nproc,
                    k,
                    benchlib.median(every),
                    benchlib.median(m["accum_no_sync"]),
                    entry["median_no_sync_speedup"],
                    benchlib.median(m["recipe"]),
                ]
            )
        results.append(entry)

    how = (
        f"{args.model}, per-device batch {args.per_device_train_batch_size}, {args.steps} optimizer steps "
        f"({accumulation_steps(args, args.accumulation)} with accumulation x{args.accumulation}: as many samples), "
        f"data {'on the device (--data_on_device)' if args.data == 'device' else 'from loader workers'}, "
        f"{'bf16 on CUDA' if benchlib.has_cuda() else 'fp32 on CPU'}"
        f"{', torch.compile' if args.torch_compile else ''}; samples/s at each run's median step, the ratio the "
        f"median of {args.repeats} alternating repetitions"
    )
    md = [
        f"### Overhead: recipes/cifar.py against hand-written loops\n\n{how}.\n",
        benchlib.markdown_table(
            [
                "processes",
                "accumulation",
                "hand-written loop",
                "recipe samples/s",
                "loop samples/s",
                "ratio recipe/loop (median)",
                "ratios (lowest-highest)",
                "within 2%",
            ],
            overhead_rows,
        ),
    ]
    if accumulation_rows:
        md += [
            "\n#### Gradient accumulation: all-reduce every micro-batch vs DDP no_sync\n",
            benchlib.markdown_table(
                [
                    "processes",
                    "accumulation",
                    "loop, all-reduce every micro-batch",
                    "loop, no_sync",
                    "no_sync speedup (median)",
                    "recipe (accelerator.accumulate)",
                ],
                accumulation_rows,
            ),
        ]
    cost = step_cost["machinery_us_per_step"]
    md += [
        f"\n#### What the machinery costs per step\n\nA 2-layer MLP (batch {8}) trained in one process on "
        f"{step_cost['device']} by the recipes' loop, by the same bare loop through Accelerate's prepared objects, "
        f"and by a bare PyTorch loop, in turn ({step_cost['repeats']} x {step_cost['steps']} steps, "
        f"`benchmarks/step_cost.py`): the recipe's loop adds **{cost:.0f} us per optimizer step** (bare loop "
        f"{benchlib.median(step_cost['bare_us_per_step']):.0f} us, recipe "
        f"{benchlib.median(step_cost['recipe_us_per_step']):.0f} us): {step_cost['accelerate_us_per_step']:.0f} us "
        f"of it Accelerate's prepared loader, optimizer and backward, {step_cost['recipes_own_us_per_step']:.0f} us "
        f"the recipes' own (the schedule, the log, the stop check, the accumulation windows). A fixed cost: under "
        f"2% of any step longer than {cost / 0.02 / 1000:.1f} ms. On a GPU it is host time, hidden behind the "
        f"device's work unless the host is what limits the step.\n"
    ]
    benchlib.save(
        args.out,
        NAME,
        {"settings": {k: str(v) for k, v in vars(args).items()}, "results": results, "step_cost": step_cost},
        "\n".join(md),
    )


if __name__ == "__main__":
    main()
