"""Preflight: find a broken multi-GPU or multi-node setup in a minute, before a job wastes hours.

    ./launch.sh doctor                        # this node: the report, then an all-reduce over its GPUs
    sbatch slurm/multi_node.sbatch doctor     # every node of a Slurm job, then one all-reduce over all
    python scripts/doctor.py --report          # the report alone, no launch

The report, per node: the GPUs visible (count, model, memory; mixed models are a warning), the
driver, CUDA, NCCL, torch, accelerate and deepspeed versions, CUDA_VISIBLE_DEVICES against the
processes requested, the GPU topology (`nvidia-smi topo -m`) with the peer-to-peer advice when
GPUs talk through the CPU interconnect (SYS), and host RAM per GPU. Started by a launcher (launch.sh
does it), every process then joins one group (NCCL on GPUs, gloo on CPU) and times an all-reduce;
rank 0 prints the bus bandwidth as nccl-tests computes it. A group that does not form, or a
collective that does not finish, within --timeout seconds ends with the likely causes, not a hang.

Then each process measures what would bound an image run here: the image recipe's ResNet-18 training on 32 px
images against its decoding loader (PNGs decoded, cropped and flipped in the recipes' default number of loader
workers), one line on rank 0 (with torchvision installed).

Imports only torch and the standard library (and torchvision for the image line, when installed), so the file can
be copied alone.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.args import TYPES, ArgumentParser  # noqa: E402  (imports no torch: a mistaken option is said at once)

MiB = 2**20
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"]
GPU_SIZES_MIB, CPU_SIZES_MIB = "1,16,64,256", "1,4,16"


# ---------------------------------------------------------------- the report


def parse_gpus(csv_text: str) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits`."""
    gpus = []
    for line in csv_text.strip().splitlines():
        index, name, memory, driver = (field.strip() for field in line.split(","))
        memory_gib = int(memory) / 1024 if memory.isdigit() else None  # "[N/A]" under MIG
        gpus.append({"index": int(index), "name": name, "memory_gib": memory_gib, "driver": driver})
    return gpus


def visible_gpus(gpus: list[dict], cuda_visible_devices: str | None) -> list[dict]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves to the processes (all of them when it is unset)."""
    if cuda_visible_devices is None:
        return gpus
    ids = []
    for entry in cuda_visible_devices.split(","):
        if entry.strip() in ("", "-1"):  # CUDA stops at the first invalid entry
            break
        ids.append(entry.strip())
    if all(i.isdigit() for i in ids):
        return [g for g in gpus if str(g["index"]) in ids]
    return gpus[: len(ids)]  # UUIDs or MIG devices: the count is what matters here


def gpu_warnings(gpus: list[dict]) -> list[str]:
    names = sorted({g["name"] for g in gpus})
    if len(names) > 1:
        return [
            f"mixed GPU models ({', '.join(names)}): the slowest sets the pace of every step and the "
            "smallest memory the batch size; give the job one model with CUDA_VISIBLE_DEVICES or --gres"
        ]
    return []


def sys_pairs(topo_text: str, only: set[int] | None = None) -> list[tuple[int, int]]:
    """GPU pairs that `nvidia-smi topo -m` shows linked through the CPU interconnect (SYS)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in topo_text.splitlines()]  # bold/underline codes
    header = next((line.split() for line in lines if re.match(r"\s+GPU0\b", line)), [])
    columns = [int(c.strip()[3:]) for c in header if re.fullmatch(r"GPU\d+", c.strip())]
    pairs = []
    for line in lines:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        row = int(cells[0][3:])
        for col, link in zip(columns, cells[1 : 1 + len(columns)]):
            if link == "SYS" and row < col and (only is None or {row, col} <= only):
                pairs.append((row, col))
    return pairs


def p2p_advice(pairs: list[tuple[int, int]]) -> list[str]:
    if not pairs:
        return []
    shown = ", ".join(f"GPU{a}-GPU{b}" for a, b in pairs[:6]) + (" ..." if len(pairs) > 6 else "")
    return [
        f"{shown} talk through the CPU interconnect (SYS): peer-to-peer over it hangs or corrupts data on "
        "some systems; if the all-reduce hangs or NCCL fails at start-up, run with NCCL_P2P_DISABLE=1"
    ]


def ram_warnings(ram_gib: float, gpus: list[dict]) -> list[str]:
    memory = max((g["memory_gib"] or 0 for g in gpus), default=0)
    if gpus and ram_gib / len(gpus) < memory:
        return [
            f"host RAM per GPU ({ram_gib / len(gpus):.0f} GiB) is less than one GPU's memory ({memory:.0f} GiB): "
            "gathering full weights for a save, or CPU offload, may run out of host memory"
        ]
    return []


def process_warnings(num_processes: int | None, visible: int) -> list[str]:
    if num_processes and visible and num_processes > visible:
        return [
            f"{num_processes} processes requested on this node but {visible} GPU(s) visible: pass "
            f"--num_processes {visible}, or check CUDA_VISIBLE_DEVICES"
        ]
    return []


def _output(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report(num_processes: int | None = None) -> tuple[list[str], list[str]]:
    """(lines, warnings) describing this node."""
    import torch

    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = _output(GPU_QUERY)
    all_gpus = parse_gpus(smi or "")
    gpus = visible_gpus(all_gpus, cvd)
    cvd_text = f"CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset"
    lines, warnings = [f"doctor: node {socket.gethostname()}"], []
    if gpus:
        memory = " / ".join(sorted({f"{g['memory_gib']:.1f} GiB" for g in gpus if g["memory_gib"]})) or "memory n/a"
        models = ", ".join(f"{sum(g['name'] == n for g in gpus)} x {n}" for n in sorted({g["name"] for g in gpus}))
        lines.append(f"  GPUs visible:  {len(gpus)} of {len(all_gpus)} ({models}; {memory} each; {cvd_text})")
    else:
        lines.append(f"  GPUs visible:  none ({cvd_text}): the processes run on CPU and talk through gloo")
    if smi is None and shutil.which("nvidia-smi"):
        warnings.append("nvidia-smi is installed but failed: is the NVIDIA driver loaded? (run nvidia-smi to see why)")
    warnings += gpu_warnings(gpus)
    if gpus and torch.cuda.device_count() == 0:
        warnings.append(
            f"nvidia-smi lists {len(gpus)} GPU(s) but torch sees none: a CPU-only torch build, or a "
            f"driver too old for torch's CUDA {torch.version.cuda}"
        )

    driver = None
    if gpus:  # the newest CUDA the driver runs, from nvidia-smi's banner
        banner = re.search(r"CUDA Version:\s*([\d.]+)", _output(["nvidia-smi"]) or "")
        driver = gpus[0]["driver"] + (f" (up to CUDA {banner.group(1)})" if banner else "")
    versions = {
        "driver": driver,
        "CUDA": torch.version.cuda,
        "NCCL": ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None,
        "torch": torch.__version__,
        "accelerate": _version("accelerate"),
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
    }
    lines.append("  versions:      " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    if num_processes:
        where = "one per GPU" if len(gpus) == num_processes else (f"{len(gpus)} GPU(s) visible" if gpus else "on CPU")
        lines.append(f"  processes:     {num_processes} on this node ({where})")
        warnings += process_warnings(num_processes, len(gpus))

    topo = _output(["nvidia-smi", "topo", "-m"]) if all_gpus else None
    if topo:
        matrix = topo.split("Legend")[0].rstrip()
        lines += ["  topology:      nvidia-smi topo -m", *("    " + line for line in matrix.splitlines())]
        only = {g["index"] for g in gpus} if cvd is not None else None
        warnings += p2p_advice(sys_pairs(topo, only))

    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    per = len(gpus) or num_processes or 1
    lines.append(
        f"  host RAM:      {ram_gib:.1f} GiB, {ram_gib / per:.1f} GiB per {'GPU' if gpus else 'process'}; "
        f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} CPUs"
    )
    warnings += ram_warnings(ram_gib, gpus)
    return lines, warnings


# ---------------------------------------------------------------- the all-reduce


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of an all-reduce of `nbytes` that took `seconds`, as nccl-tests
    computes them: algbw = bytes / time; busbw = algbw x 2(n-1)/n, what each link carries in a ring,
    comparable across process counts and with the hardware's link speed."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def likely_causes(backend: str) -> str:
    ifname = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    causes = [
        f"the port (MASTER_PORT {os.environ.get('MASTER_PORT')} on {os.environ.get('MASTER_ADDR')} taken by another "
        "job, or closed to the other nodes)",
        "a firewall between the nodes (after the rendezvous every pair of processes connects directly, on other "
        "ports)",
        f"the network interface (set {ifname} to the one the nodes share, e.g. eth0 or ib0"
        + ("; NCCL_IB_DISABLE=1 when InfiniBand is not set up)" if backend == "nccl" else ")"),
    ]
    if backend == "nccl":
        causes.append("GPU peer-to-peer (NCCL_P2P_DISABLE=1 when nvidia-smi topo -m shows SYS between GPUs)")
    return "likely causes: " + "; ".join(causes)


def _give_up(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)  # from any thread, also while the main thread is stuck inside a collective


def allreduce(sizes_mib: list[float], iters: int, timeout: float) -> None:
    """Every launched process times all_reduce over each size; rank 0 prints the table."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import parse_flag_from_env

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    on_cpu = parse_flag_from_env("ACCELERATE_USE_CPU")
    backend = "nccl" if torch.cuda.is_available() and not on_cpu else "gloo"
    group = f"{world} processes ({world // local_world} node(s) x {local_world})"
    what = f"the all-reduce across {group}"
    # One line per node: the node's first process gives up first, and its launcher then stops the rest.
    watchdog = threading.Timer(
        timeout + (0 if local_rank == 0 else 10),
        _give_up,
        [f"{what} did not complete within {timeout:g} s; {likely_causes(backend)}"],
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout), device_id=device if backend == "nccl" else None
        )

        def timed(x, n):
            dist.barrier()
            tic = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            slowest = torch.tensor([(time.perf_counter() - tic) / n], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its slowest member does
            return slowest.item()

        rows = []
        for mib in sizes_mib:
            x = torch.zeros(int(mib * MiB) // 4, device=device)
            timed(x, 2)  # warm-up: connections, buffers
            rows.append((x.numel() * 4, timed(x, iters)))
        # Each process's own speed, no collective inside: a slower one (a throttled GPU, a busy CPU) is a straggler,
        # which every gradient all-reduce of a run waits for (the recipes name one that waits for data).
        a = torch.randn(256, 256, device=device)
        tic = time.perf_counter()
        for _ in range(20):
            a = torch.tanh(a @ a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        speeds, hosts = [None] * world, [None] * world
        dist.all_gather_object(speeds, time.perf_counter() - tic)
        dist.all_gather_object(hosts, socket.gethostname())
        check = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(check)
        ok = torch.tensor([float(bool((check == world * (world + 1) / 2).all()))], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    except Exception as err:  # noqa: BLE001 - any failure here is a setup problem to explain
        _give_up(
            f"{what} failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"{likely_causes(backend)}"
        )
    watchdog.cancel()
    try:  # not the network's: a failure here is said as such, and every rank still meets the gather below
        measured = image_input(device, local_world)
    except Exception as err:  # noqa: BLE001
        measured = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    rates = [None] * world
    dist.all_gather_object(rates, measured)
    if rank == 0:
        print(f"all_reduce, float32 sum, {backend}, {group}; busbw = algbw x 2(n-1)/n as in nccl-tests")
        print(f"{'size':>10} {'time (ms)':>10} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
        for nbytes, seconds in rows:
            algbw, busbw = bus_bandwidth(nbytes, seconds, world)
            print(f"{nbytes / MiB:>6g} MiB {seconds * 1e3:>10.2f} {algbw:>13.2f} {busbw:>13.2f}")
        print(f"sums {'correct' if ok.item() == 1 else 'WRONG'} on all {world} processes", flush=True)
        slowest, median = max(range(world), key=speeds.__getitem__), sorted(speeds)[world // 2]
        print(f"local compute: slowest rank {slowest} ({hosts[slowest]}) {speeds[slowest] * 1e3:.1f} ms, median "
              f"{median * 1e3:.1f} ms")  # fmt: skip
        if world > 1 and speeds[slowest] > 1.2 * median:
            print(
                f"warning: rank {slowest} on {hosts[slowest]} computes {speeds[slowest] / median:.1f}x slower than "
                "the median: a straggler every step of a run would wait for (check its GPU clocks, load, temperature)",
                flush=True,
            )
        print(image_input_line(rates), flush=True)
    dist.destroy_process_group()
    if ok.item() != 1:
        sys.exit(1)


class DecodedPngs:
    """32 px PNG files' bytes decoded, cropped, flipped and normalized as the image recipe's loader does; a class, so
    that loader workers get it under any start method."""

    def __init__(self, pngs: list):
        self.pngs, self.augment = pngs, None

    def __len__(self) -> int:
        return len(self.pngs)

    def __getitem__(self, index: int):
        import io

        from PIL import Image
        from torchvision import transforms as T

        if self.augment is None:
            self.augment = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                                      T.Normalize([0.5] * 3, [0.25] * 3)])  # fmt: skip
        return self.augment(Image.open(io.BytesIO(self.pngs[index])).convert("RGB")), 0


def image_input(device, local_world: int) -> tuple | None:
    """(samples/s a process trains the image recipe's ResNet-18 on 32 px images, samples/s one process's DataLoader
    workers decode, crop, flip and normalize 32 px PNGs, the workers): which of the two would bound an image run that
    decodes its images here (recipes/cifar.py holds a small set on the device instead, by default). The PNGs are in
    memory: the filesystem is not measured. None without torchvision or PIL."""
    try:
        import io

        import numpy as np
        import torch
        import torchvision
        from PIL import Image
    except ImportError:
        return None
    batch = 128 if device.type == "cuda" else 16  # a CPU's rate per sample is nearly the same at 16
    model = torchvision.models.resnet18(num_classes=10)  # as the recipe's: a 3x3 stem and no max-pool for 32 px
    model.conv1, model.maxpool = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False), torch.nn.Identity()
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)

    def train(steps: int) -> float:
        tic = time.perf_counter()
        for _ in range(steps):
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        loss.item()  # the device's queue done
        return steps * batch / (time.perf_counter() - tic)

    train(1)  # kernel choice, the allocator
    model_rate = train(5 if device.type == "cuda" else 2)
    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(4 * batch):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
        pngs.append(buffer.getvalue())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(0, min(8, cpus // local_world - 1))  # the recipes' default: the node's CPUs less the training loop
    loader = torch.utils.data.DataLoader(
        DecodedPngs(pngs), batch_size=batch, num_workers=workers, persistent_workers=workers > 0
    )
    for _ in loader:  # the workers started
        pass
    tic = time.perf_counter()
    for _ in range(2):
        for _ in loader:
            pass
    return model_rate, 2 * len(pngs) / (time.perf_counter() - tic), workers


def image_input_line(rates: list) -> str:
    """What image_input measured on every rank, in one line: the median rank's model against the slowest loader."""
    if failed := [r for r in rates if isinstance(r, str)]:
        return f"image input: not measured ({failed[0]})"
    if any(r is None for r in rates):
        return "image input: not measured (torchvision is not installed)"
    model = sorted(r[0] for r in rates)[len(rates) // 2]
    loader, workers = min(r[1] for r in rates), rates[0][2]
    bound = (
        "input-bound: decoding loaders would keep the model waiting; hold the images on the device "
        "(cifar's default for sets that fit, --data_on_device) or give the loaders more CPUs"
        if loader < model
        else "compute-bound: the model sets the pace"
    )
    return (
        f"image input: the image recipe's ResNet-18 trains {model:,.0f} samples/s a process (32 px); its decoding "
        f"loader ({workers} worker(s) a process) delivers {loader:,.0f} ({loader / model:.2f}x): {bound}"
    )


MIN_MIB, MAX_MIB = 0.001, 65536  # from 1 KiB (less made an all-reduce of nothing) to more than any accelerator holds


def mib_list(text) -> list:
    """--sizes_mib: sizes from MIN_MIB to MAX_MIB separated by commas (nan, inf, 0 or less, or more than the memory
    holds would fail inside the all-reduce, blamed on the network)."""
    try:
        sizes = [TYPES["positive_float"](size) for size in text.split(",")]
    except argparse.ArgumentTypeError:
        sizes = []
    if not sizes or max(sizes) > MAX_MIB or min(sizes) < MIN_MIB:
        raise argparse.ArgumentTypeError(f"pass sizes from {MIN_MIB} to {MAX_MIB} separated by commas (1,16,64), got "
                                         f"{text!r}")  # fmt: skip
    return sizes


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", action="store_true", help="print this node's report and exit (no process group)")
    p.add_argument("--num_processes", type="positive_int", help="processes requested on this node, for the report")
    p.add_argument("--mesh", help="the device mesh this job would have, for the report (launch.sh passes it)")
    p.add_argument("--timeout", type="seconds", default=60, help="seconds before a group that does not form fails")
    p.add_argument(
        "--sizes_mib",
        type=mib_list,
        help=f"all-reduce sizes in MiB (default {GPU_SIZES_MIB} on GPUs, {CPU_SIZES_MIB} on CPU)",
    )
    p.add_argument("--iters", type="positive_int", default=10, help="timed all-reduces per size")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.report or "RANK" not in os.environ:
        lines, warnings = report(args.num_processes)
        lines += [f"  mesh:          {args.mesh}"] if args.mesh else []
        print("\n".join(lines + [f"warning: {w}" for w in warnings]), flush=True)
        return
    import torch
    from accelerate.utils import parse_flag_from_env

    on_gpu = torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")
    sizes = args.sizes_mib or [float(s) for s in (GPU_SIZES_MIB if on_gpu else CPU_SIZES_MIB).split(",")]
    allreduce(sizes, args.iters, args.timeout)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the user knows why it stopped
        sys.exit(130)
