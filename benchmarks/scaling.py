"""Scaling: recipes/cifar.py's training throughput in 1, 2, ... N processes (CPU processes here, GPUs
where present), as speedup = throughput(N) / throughput(1) and efficiency = speedup / N, for
weak scaling (fixed per-device batch: the global batch grows with N) and strong scaling (fixed
global batch: the per-device batch shrinks with N). Writes scaling.json, scaling.md, scaling.png.

    .venv/bin/python benchmarks/scaling.py                  # CPU: 1 and 2 processes
    .venv/bin/python benchmarks/scaling.py --processes 1 2 4 8 --per_device_train_batch_size 512   # GPUs
"""

import benchlib

NAME = "scaling"


def build_parser():
    p = benchlib.parser(__doc__.split("\n")[0])
    p.add_argument(
        "--processes", type="positive_int", nargs="+", help="default: 1..cores (CPU, at most 4) or 1, 2, 4, ... GPUs"
    )
    p.add_argument("--steps", type="positive_int", help="optimizer steps per run")
    p.add_argument(
        "--per_device_train_batch_size",
        type="positive_int",
        default=32,
        help="weak scaling's per-device batch; strong scaling keeps this x max(processes) global",
    )
    p.add_argument("--model", help="default: resnet18 (CPU), resnet18_cifar (GPU)")
    p.add_argument("--modes", nargs="+", choices=["weak", "strong"], help="default: both (smoke: weak)")
    p.add_argument("--cifar_dir", help="measure on CIFAR-10 in this folder instead of the bundled digits")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    gpus = benchlib.machine()["gpus"]
    args.modes = args.modes or (["weak"] if args.smoke else ["weak", "strong"])
    if args.smoke and not args.processes:
        args.processes = [1, 2]
    if not args.processes:
        top = gpus or min(4, max(2, benchlib.cores()))
        args.processes = sorted({1, *[n for n in (2, 4, 8, 16) if n <= top], top})
    args.steps = args.steps or (3 if args.smoke else 40)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.model = args.model or ("resnet18_cifar" if gpus else "resnet18")
    args.work_dir = args.work_dir or args.out / "work"
    return args


def throughput(args, nproc, per_device, rep):
    res, out = benchlib.recipe_run(args, "cifar", nproc, benchlib.cifar_args(args, per_device, args.steps), rep)
    assert res["world_size"] == nproc, res
    return benchlib.median_step_rate(res), str(out)


def main(argv=None):
    args = parse_args(argv)
    b, top = args.per_device_train_batch_size, max(args.processes)
    points = {}  # (mode, processes) -> per-device batch
    for mode in args.modes:
        for n in args.processes:
            if mode == "strong" and (b * top) % n:
                continue  # the global batch must split evenly
            points[(mode, n)] = b if mode == "weak" else b * top // n
    measured, runs = {}, {}
    for rep in range(args.repeats):  # every point once per repetition, so load drift spreads over all
        for key, per_device in points.items():
            sps, out = throughput(args, key[1], per_device, rep)
            measured.setdefault(key, []).append(sps)
            runs.setdefault(key, []).append(out)

    results, rows, panels = [], [], {"samples/s": {}, "efficiency": {}}
    for mode in args.modes:
        ns = [n for n in args.processes if (mode, n) in measured]
        base = benchlib.median(measured[(mode, ns[0])]) / ns[0]  # one process's share at the smallest count
        for n in ns:
            sps = benchlib.median(measured[(mode, n)])
            speedup = sps / base
            entry = {
                "mode": mode,
                "processes": n,
                "per_device_batch": points[(mode, n)],
                "global_batch": points[(mode, n)] * n,
                "samples_per_second": sps,
                "all_samples_per_second": measured[(mode, n)],
                "speedup": speedup,
                "efficiency": speedup / n,
                "runs": runs[(mode, n)],
            }
            results.append(entry)
            rows.append([mode, n, entry["per_device_batch"], entry["global_batch"], sps, speedup, speedup / n])
        panels["samples/s"][mode] = (ns, [benchlib.median(measured[(mode, n)]) for n in ns])
        panels["efficiency"][mode] = (ns, [e["efficiency"] for e in results if e["mode"] == mode])
    panels["efficiency"]["ideal"] = (args.processes, [1.0] * len(args.processes))
    where = "GPUs" if benchlib.has_cuda() else "CPU processes"
    benchlib.plot(
        args.out / f"{NAME}.png",
        f"recipes/cifar.py scaling over {where} ({args.model})",
        "processes",
        list(panels.items()),
    )
    md = (
        f"### Scaling: recipes/cifar.py in 1..{top} {where}\n\n{args.model}, --data_on_device, {args.steps} "
        f"optimizer steps a run, samples/s at the median step, median of {args.repeats} runs. "
        f"Speedup = samples/s(N) / samples/s(1), "
        f"efficiency = speedup / N. Weak: per-device batch {b}; strong: global batch {b * top}.\n\n"
        + benchlib.markdown_table(
            ["mode", "processes", "per-device batch", "global batch", "samples/s", "speedup", "efficiency"], rows
        )
        + f"\n\n![scaling]({NAME}.png)\n"
    )
    benchlib.save(args.out, NAME, {"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}, md)


if __name__ == "__main__":
    main()
