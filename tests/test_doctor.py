"""The doctor (scripts/doctor.py, ./launch.sh doctor): its reading of nvidia-smi's output, checked on
captured samples; the nccl-tests bandwidth formula; a real gloo all-reduce on CPU; and a group that
cannot form ending with the likely causes instead of hanging."""

import os
import re
import stat
import time

import doctor
import pytest
from conftest import BIN, REPO, free_port, run, user_env

# A two-socket PCIe server: GPU0-1 hang off CPU 0, GPU2-3 off CPU 1, so pairs across the sockets
# go through the CPU interconnect (UPI) and show as SYS. Tabs as nvidia-smi prints them.
TOPO_TWO_SOCKETS = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNODE\tSYS\tSYS\tNODE\t0-23,48-71\t0\t\tN/A
GPU1\tNODE\t X \tSYS\tSYS\tNODE\t0-23,48-71\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tNODE\tSYS\t24-47,72-95\t1\t\tN/A
GPU3\tSYS\tSYS\tNODE\t X \tSYS\t24-47,72-95\t1\t\tN/A
NIC0\tNODE\tNODE\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
"""

# An NVLink box (HGX-style, cut to 4 GPUs): every GPU pair on NVLink; only the NICs are SYS to the
# GPUs of the other socket. The header is underlined with escape codes, as some drivers print it.
TOPO_NVLINK = """\
\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tNV18\tPIX\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tPIX\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tPIX\t56-111,168-223\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\tPIX\t56-111,168-223\t1\t\tN/A
NIC0\tPIX\tPIX\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tSYS\tPIX\tPIX\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""

GPUS_MIXED = """\
0, NVIDIA A100-SXM4-80GB, 81920, 535.129.03
1, NVIDIA A100-SXM4-80GB, 81920, 535.129.03
2, NVIDIA A100-PCIE-40GB, 40960, 535.129.03
3, NVIDIA A100-PCIE-40GB, 40960, 535.129.03
"""


@pytest.mark.parametrize("n, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (16, 1.875)])
def test_bus_bandwidth_is_nccl_tests_formula(n, factor):
    # 2 GB in 0.1 s: algbw = bytes / time = 20 GB/s; busbw = algbw x 2(n-1)/n
    algbw, busbw = doctor.bus_bandwidth(2_000_000_000, 0.1, n)
    assert algbw == pytest.approx(20.0) and busbw == pytest.approx(20.0 * factor)


def test_gpus_are_parsed_and_mixed_models_warned():
    gpus = doctor.parse_gpus(GPUS_MIXED)
    assert [g["index"] for g in gpus] == [0, 1, 2, 3] and gpus[2]["memory_gib"] == 40.0
    assert gpus[0]["name"] == "NVIDIA A100-SXM4-80GB" and gpus[0]["driver"] == "535.129.03"
    (warning,) = doctor.gpu_warnings(gpus)
    assert warning.startswith("mixed GPU models (NVIDIA A100-PCIE-40GB, NVIDIA A100-SXM4-80GB)")
    assert doctor.gpu_warnings(gpus[:2]) == []
    assert doctor.parse_gpus("0, NVIDIA A100, [N/A], 535")[0]["memory_gib"] is None  # MIG


def test_cuda_visible_devices_narrows_the_gpus():
    gpus = doctor.parse_gpus(GPUS_MIXED)
    assert doctor.visible_gpus(gpus, None) == gpus
    assert [g["index"] for g in doctor.visible_gpus(gpus, "0,1")] == [0, 1]
    assert doctor.visible_gpus(gpus, "") == [] and doctor.visible_gpus(gpus, "-1") == []
    assert len(doctor.visible_gpus(gpus, "GPU-8a3c1f2e,GPU-77b0d9a1")) == 2
    assert doctor.process_warnings(8, 4)[0].startswith("8 processes requested on this node but 4 GPU(s) visible")
    assert doctor.process_warnings(4, 4) == [] and doctor.process_warnings(2, 0) == []


def test_sys_links_between_gpus_get_the_p2p_advice():
    pairs = doctor.sys_pairs(TOPO_TWO_SOCKETS)
    assert pairs == [(0, 2), (0, 3), (1, 2), (1, 3)]
    (advice,) = doctor.p2p_advice(pairs)
    assert advice.startswith("GPU0-GPU2, GPU0-GPU3, GPU1-GPU2, GPU1-GPU3 talk through the CPU interconnect (SYS)")
    assert "NCCL_P2P_DISABLE=1" in advice
    assert doctor.sys_pairs(TOPO_TWO_SOCKETS, only={0, 1}) == [], "CUDA_VISIBLE_DEVICES=0,1 stays on one socket"


def test_nvlink_box_gets_no_p2p_advice():
    assert doctor.sys_pairs(TOPO_NVLINK) == [], "SYS between a GPU and a NIC is not a GPU pair"
    assert doctor.p2p_advice([]) == []


def test_host_ram_per_gpu():
    gpus = doctor.parse_gpus(GPUS_MIXED)
    (warning,) = doctor.ram_warnings(256, gpus)  # 64 GiB per GPU, less than 80 GiB
    assert "host RAM per GPU (64 GiB) is less than one GPU's memory (80 GiB)" in warning
    assert doctor.ram_warnings(1024, gpus) == [] and doctor.ram_warnings(8, []) == []


def test_report_reads_nvidia_smi(tmp_path, monkeypatch, capsys):
    """The whole report (doctor.main, as `python scripts/doctor.py --report` runs it: no process group) on a node whose
    nvidia-smi (faked, with the samples above) shows four GPUs of two models on two sockets, and whose torch (this
    CPU build) sees none of them."""
    (tmp_path / "gpus.csv").write_text(GPUS_MIXED)
    (tmp_path / "topo.txt").write_text(TOPO_TWO_SOCKETS)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
case "$1" in
  --query-gpu=*) cat {tmp_path}/gpus.csv ;;
  topo) cat {tmp_path}/topo.txt ;;
  "") echo "| NVIDIA-SMI 535.129.03    Driver Version: 535.129.03    CUDA Version: 12.2     |" ;;
  *) exit 1 ;;
esac
""")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    capsys.readouterr()
    doctor.main(["--report", "--num_processes", "8"])
    out = capsys.readouterr().out
    assert re.search(
        r"GPUs visible: +4 of 4 \(2 x NVIDIA A100-PCIE-40GB, 2 x NVIDIA A100-SXM4-80GB; "
        r"40.0 GiB / 80.0 GiB each; CUDA_VISIBLE_DEVICES unset\)",
        out,
    ), out
    assert "driver 535.129.03 (up to CUDA 12.2), CUDA " in out
    assert ", NCCL " in out and ", torch " in out and ", accelerate " in out and ", deepspeed " in out
    assert "topology:      nvidia-smi topo -m" in out and "GPU2\tSYS\tSYS\t X" in out and "Legend" not in out
    warnings = [line for line in out.splitlines() if line.startswith("warning: ") and "host RAM" not in line]
    assert len(warnings) == 4, out  # (and host RAM per GPU, where this machine has less than 4 x 80 GiB)
    assert "mixed GPU models" in warnings[0] and "torch sees none" in warnings[1]
    assert "8 processes requested on this node but 4 GPU(s) visible" in warnings[2]
    assert "NCCL_P2P_DISABLE=1" in warnings[3]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    doctor.main(["--report"])
    out = capsys.readouterr().out
    assert "2 of 4 (2 x NVIDIA A100-PCIE-40GB" in out and "mixed" not in out and "NCCL_P2P_DISABLE" not in out


@pytest.mark.slow
def test_doctor_on_cpu_times_a_gloo_allreduce():
    """The README's `./launch.sh doctor` (tests/test_readme.py checks that it is the README's only doctor line) on a
    node without GPUs: 2 processes, a gloo all-reduce of each size, timed and checked."""
    proc = run([REPO / "launch.sh", "doctor"], env=user_env())
    (command,) = [line for line in proc.stderr.splitlines() if line.startswith("+ ")]
    assert command.startswith("+ ACCELERATE_USE_CPU=true ") and command.endswith("scripts/doctor.py")
    out = proc.stdout
    assert "GPUs visible:  none" in out and "processes:     2 on this node (on CPU)" in out
    assert "all_reduce, float32 sum, gloo, 2 processes (1 node(s) x 2)" in out
    rows = re.findall(r"^ +(\S+) MiB +(\S+) +(\S+) +(\S+)$", out, flags=re.M)
    assert [r[0] for r in rows] == ["1", "4", "16"], out
    for _, ms, algbw, busbw in rows:  # two processes: 2(n-1)/n = 1
        assert float(ms) > 0 and float(algbw) > 0 and busbw == algbw
    assert "sums correct on all 2 processes" in out
    image = re.search(
        r"^image input: the image recipe's ResNet-18 trains (\S+) samples/s a process \(32 px\); its decoding loader "
        r"\(0 worker\(s\) a process\) delivers (\S+) \((\S+)x\): (input|compute)-bound", out, flags=re.M
    )  # fmt: skip
    assert image, out  # 2 processes on 2 cores: no CPU left for a loader worker
    model, loader, ratio = (float(v.replace(",", "")) for v in image.groups()[:3])
    assert model > 0 and loader > 0 and image[4] == ("input" if loader < model else "compute")
    assert loader / (model + 0.5) - 0.01 <= ratio <= loader / max(model - 0.5, 0.5) + 0.01, out  # rates as rounded


@pytest.mark.slow
def test_a_group_that_cannot_form_fails_with_the_causes():
    """Rank 0 of 2 whose peer never comes: it gives up after --timeout seconds and names the
    likely causes; it does not wait for torch's 30-minute default."""
    env = user_env(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    tic = time.monotonic()
    proc = run([BIN / "python", REPO / "scripts/doctor.py", "--timeout", "5"], env=env, check=False, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - tic < 30
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: the all-reduce across 2 processes (2 node(s) x 1) did not complete within 5 s")
    for cause in ("the port (MASTER_PORT", "a firewall", "GLOO_SOCKET_IFNAME"):
        assert cause in line


BAD_ARGUMENTS = [  # nan, inf, 0 and negative numbers failed inside the all-reduce, blamed on the network
    ["--sizes_mib", "big"],
    ["--sizes_mib", "1,2e9"],  # a petabyte: the allocator's error, said after the processes started
    ["--timeout", "nan"],
    ["--timeout", "1e30"],  # an OverflowError in torch's timer, blamed on the port
    ["--iters", "2.5"],
]


@pytest.mark.parametrize("args", BAD_ARGUMENTS)
def test_bad_arguments_are_one_error_line_naming_the_option(capsys, args):
    """doctor.py's parser (which imports no torch) refuses each: exit 2, one `error:` line naming the option, the
    refusal's subject."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        doctor.parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert exit_.value.__cause__.subject == args[0] and args[0] in err


def test_launch_sh_doctor_says_a_bad_argument_before_any_process_starts(capsys):
    """Through launch.sh: the parser's line alone (launch.sh's command aside), exit 2, no report printed."""
    with pytest.raises(SystemExit):
        doctor.parse_args(["--timeout", "nan"])
    said = capsys.readouterr().err.strip()
    proc = run([REPO / "launch.sh", "doctor", "--timeout", "nan"], check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert [line for line in proc.stderr.splitlines() if not line.startswith("+ ")] == [said], proc.stderr
