"""Run every benchmark and write benchmarks/results/: <name>.json per benchmark, results.md (the
tables, the machine), scaling.png; then put results.md into benchmarks/README.md.

    .venv/bin/python benchmarks/run_all.py             # CPU: a few minutes; GPU variants when CUDA is present
    .venv/bin/python benchmarks/run_all.py --smoke --out /tmp/bench   # seconds: keeps the scripts working

Each benchmark runs in its own process, one after another (they would compete for the cores).
Options after `--` go to every benchmark (for example `-- --cifar_dir data`).
"""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib

from common.args import ArgumentParser  # benchlib put the repository on the path

BENCHMARKS = ("overhead", "scaling", "input_pipeline", "lm")
README = benchlib.REPO / "benchmarks" / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=benchlib.RESULTS)
    p.add_argument("--smoke", action="store_true", help="every benchmark in its smallest setting")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    p.add_argument(
        "--readme",
        action=argparse.BooleanOptionalAction,
        help="update benchmarks/README.md (default: on for a full run into benchmarks/results)",
    )
    return p


def main(argv=None):
    args, passed = build_parser().parse_known_args(argv)
    passed = [a for a in passed if a != "--"]
    for name in args.only:  # each takes what is passed on, or says so in one line now, not after the ones before it
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
        spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
        module.build_parser().parse_args(["--out", str(args.out), *passed])
    readme = args.readme if args.readme is not None else (not args.smoke and args.out.resolve() == benchlib.RESULTS)
    args.out.mkdir(parents=True, exist_ok=True)

    # Runs are shared within this invocation (scaling reuses overhead's recipe runs), never across.
    shutil.rmtree(args.out / "work" / "runs", ignore_errors=True)
    machine, tic, timings = benchlib.machine(), time.time(), {}
    for name in args.only:
        start = time.time()
        cmd = [
            sys.executable,
            str(Path(__file__).parent / f"{name}.py"),
            "--out",
            str(args.out),
            "--reuse_runs",
            *(["--smoke"] if args.smoke else []),
            *passed,
        ]
        print(f"+ {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, cwd=benchlib.REPO)
        if proc.returncode != 0:
            sys.exit(f"run_all: {name} failed (exit {proc.returncode})")
        timings[name] = round(time.time() - start, 1)
        print(f"{name}: {timings[name]} s", flush=True)

    gpu = machine["gpu"] is not None
    sections = [(args.out / f"{name}.md").read_text() for name in args.only]
    md = (
        f"Measured {time.strftime('%Y-%m-%d')} on {benchlib.describe(machine)}, "
        f"{round(os.getloadavg()[0], 2)} at the end, in {round(time.time() - tic)} s "
        f"({', '.join(f'{k} {v} s' for k, v in timings.items())}), "
        f"by `.venv/bin/python benchmarks/run_all.py{' --smoke' if args.smoke else ''}`"
        f"{' (smoke setting: too short to mean anything)' if args.smoke else ''}.\n\n"
        + (
            ""
            if gpu
            else "GPU numbers: not measured (no GPU in this run); the scripts pick CUDA, bf16, NCCL and "
            "the device-resident data path when a GPU is present.\n\n"
        )
        + "\n\n".join(s.strip() for s in sections)
        + "\n"
    )
    (args.out / "results.md").write_text(md)
    print(f"wrote {args.out / 'results.md'}")
    if readme:
        text = README.read_text()
        md = re.sub(r"\]\(([\w.-]+\.png)\)", r"](results/\1)", md)  # the README sits one folder up
        updated = re.sub(f"{re.escape(START)}.*?{re.escape(END)}", lambda _: f"{START}\n{md}{END}", text, flags=re.S)
        README.write_text(updated)
        print(f"updated {README}")


if __name__ == "__main__":
    main()
