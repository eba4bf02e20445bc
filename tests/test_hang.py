"""A stalled process is named, not waited on (--hang_timeout), and a rank that keeps the others waiting for its data
is named in a warning. Real 2-process launches on CPU: a process frozen with SIGSTOP, a data loader stuck reading a
named pipe (as on a dead network mount), in training and in a mid-run evaluation; a rank whose images are slow."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import psutil
import pytest
from conftest import ACCELERATE_LAUNCH, BIN, FAST_MODEL, REPO, digits_args, error_lines, rank_process, user_env
from PIL import Image

from common import checkpoint as ckpt

CIFAR = REPO / "recipes" / "cifar.py"


def test_the_phase_is_read_from_the_stack_and_a_save_waits_longer(tmp_path):
    """What the main thread is doing, from its stack: a checkpoint save (which gets --ddp_timeout less the time to
    report, not --hang_timeout), an evaluation reading its data, a wait in a collective; --hang_timeout 0 watches
    nothing; an earlier hang's report in the folder (a resumed run's) is not taken for this one's."""
    import traceback
    from argparse import Namespace

    from accelerate import Accelerator

    from common.preemption import StopOnSignal
    from common.watchdog import SLOW_PHASES, Watchdog, phase_of, start_watchdog

    def save_checkpoint():
        return phase_of(traceback.extract_stack())

    def evaluate():
        def __next__():
            return phase_of(traceback.extract_stack())

        return __next__()

    assert save_checkpoint() == ("checkpoint save", False) and "checkpoint save" in SLOW_PHASES
    assert evaluate() == ("evaluation (data loading)", False)
    assert start_watchdog(Accelerator(cpu=True), Namespace(hang_timeout=0, ddp_timeout=600, output_dir="x")) is None
    assert StopOnSignal(Accelerator(cpu=True)).requested(3) is None
    dog = Watchdog(Accelerator(cpu=True), hang_timeout=3000, ddp_timeout=6000, output_dir=tmp_path)
    assert dog.slow_timeout == 6000 - 40
    (tmp_path / "hang").mkdir()
    earlier = {"rank": 0, "host": dog.ranks[0][0], "pid": 1, "step": 7, "phase": "data loading", "waiting": False}
    (tmp_path / "hang" / "rank-0.txt").write_text(json.dumps(earlier) + "\n")
    assert dog._reports() == {}
    (tmp_path / "hang" / "rank-0.txt").write_text(json.dumps({**earlier, "pid": os.getpid()}) + "\n")
    assert list(dog._reports()) == [0]


@pytest.mark.slow
def test_the_time_a_slow_save_took_is_not_counted_against_the_step_after_it(tmp_path):
    """A save gets --ddp_timeout less the time to report; the step after it gets --hang_timeout of its own, not what
    is left of it after the save (a save of 6 s, then a step of 2 s, --hang_timeout 4: no hang)."""
    script = """if True:
        import sys, time
        from accelerate import Accelerator
        from common.watchdog import Watchdog
        dog = Watchdog(Accelerator(cpu=True), hang_timeout=4, ddp_timeout=100, output_dir=sys.argv[1])
        dog.beat(1)
        def save_checkpoint():
            time.sleep(6)
        def forward():
            time.sleep(2)
        save_checkpoint()
        forward()
        dog.beat(2)
        print("no hang")
    """
    proc = subprocess.run(
        [BIN / "python", "-c", script, tmp_path], cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (0, "no hang\n"), proc.stderr[-2000:]


@pytest.mark.slow
def test_a_step_is_not_a_stall_before_it_has_taken_three_of_the_runs_median_steps(tmp_path):
    """--ddp_timeout 10 gives --hang_timeout 5: a run whose steps take 4 s had one take 6 under load, and the watch
    ended it as a hang (exit 124, which a scheduler does not requeue). Steps of 1.2 s against --hang_timeout 2: one
    of 3 s goes on; no progress for longer than 3 median steps is a stall, said with that limit."""
    script = """if True:
        import sys, time
        from accelerate import Accelerator
        from common.watchdog import Watchdog
        dog = Watchdog(Accelerator(cpu=True), hang_timeout=2, ddp_timeout=100, output_dir=sys.argv[1])
        dog.beat(1)  # the first step: slow by nature
        for step in range(2, 6):
            time.sleep(1.2)
            dog.beat(step)
        def forward():
            time.sleep(3)
        forward()
        dog.beat(6)
        print("no hang", flush=True)
        forward(), forward()
    """
    proc = subprocess.run(
        [BIN / "python", "-c", script, tmp_path], cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (124, "no hang\n"), proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert re.match(r"error: no progress for \d s \(3 of the run's median steps, above --hang_timeout\): ", line), line


def launch(args, out, until=None, then=None, timeout=240, **env_extra):
    """2 CPU processes of cifar.py; `until(out)` polled, then `then(proc)`. Returns the exit code, stderr, the seconds
    from `then` to the end, and any process of the run left behind."""
    env = user_env(ACCELERATE_USE_CPU="true", **env_extra)
    cmd = [ACCELERATE_LAUNCH, "--config_file", REPO / "accelerate_configs/cpu.yaml", "--num_processes", "2"]
    cmd += ["--main_process_port", env["MASTER_PORT"], CIFAR, *args]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stderr=err, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while until is not None and not until(out):
                assert proc.poll() is None and time.monotonic() < deadline, "ended before the moment to act"
                time.sleep(0.05)
            if then is not None:
                then(proc)
            tic = time.monotonic()
            code = proc.wait(timeout=timeout)
            took = time.monotonic() - tic
        finally:
            if proc.poll() is None:
                proc.kill()
            left = [p for p in psutil.process_iter() if str(out) in " ".join(_cmdline(p))]
            for p in left:
                p.kill()
        err.seek(0)
        return code, err.read(), took, left


def _cmdline(p):
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.slow
def test_a_frozen_process_is_named_and_the_job_ends(digits, tmp_path):
    out = tmp_path / "run"
    args = digits_args(digits, out, *FAST_MODEL, "--max_train_steps", "1000", "--checkpointing_steps", "2")
    args += ["--hang_timeout", "8", "--ddp_timeout", "60", "--dataloader_num_workers", "0"]
    code, stderr, took, left = launch(
        args,
        out,
        until=lambda o: (o / "checkpoint-2" / ckpt.STATE_FILE).exists(),
        then=lambda p: rank_process(p, 1).suspend(),
    )
    lines = error_lines(stderr)
    assert code != 0 and len(lines) == 1, stderr[-3000:]
    pid = lines[0].split("rank 1 (")[1].split("pid ")[1].split(")")[0]
    assert "no progress for" in lines[0] and "rank 1 (" in lines[0] and "stalled without answering" in lines[0]
    assert "rank 0 waits for it" in lines[0] and f"{out}/hang/" in lines[0] and "(exit 124)" in lines[0], lines[0]
    # Frozen within checkpoint-2's save (its marker is written before the save's last barrier), rank 0 waits in the
    # save, whose limit is --ddp_timeout less 40 s: the job ends within the limit its line names, and 40 s
    limit = 60 - 40 if "for a checkpoint save" in lines[0] else 8
    assert pid.isdigit() and not left and took < limit + 40, (took, lines[0])
    assert (out / "hang" / "rank-0.txt").is_file() and not (out / "hang" / "rank-1.txt").exists()
    report = json.loads((out / "hang" / "rank-0.txt").read_text().splitlines()[0])
    assert report["waiting"] and report["step"] >= 2
    assert "Thread" in (out / "hang" / "rank-0.txt").read_text()  # faulthandler's dump of every thread
    assert ckpt.checkpoint_damage(out / "checkpoint-2") is None


@pytest.mark.slow
def test_a_job_suspended_and_continued_is_not_taken_for_a_hung_one_and_finishes(digits, tmp_path):
    """Every process of the job stopped for 12 s (SIGSTOP, as Slurm's `scontrol suspend` does to a job), then
    continued: 12 s without a step is twice --hang_timeout 6, but the watch knows that it did not run either (its
    own clock jumped), so the job trains on and finishes, exit 0 (it ended with exit 124, blamed on a stalled rank)."""
    out = tmp_path / "run"
    args = digits_args(digits, out, *FAST_MODEL, "--max_train_steps", "12", "--checkpointing_steps", "4")
    args += ["--hang_timeout", "6", "--ddp_timeout", "120", "--dataloader_num_workers", "0"]

    def suspend_the_job(proc):
        time.sleep(1)  # past checkpoint-4's save (a save may take --ddp_timeout): in the steps after it
        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in job:
            p.suspend()
        time.sleep(12)
        for p in job:
            p.resume()

    code, stderr, _, left = launch(
        args, out, until=lambda o: (o / "checkpoint-4" / ckpt.STATE_FILE).exists(), then=suspend_the_job
    )
    assert code == 0 and not error_lines(stderr) and not left, stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["steps"] == 12 and not (out / "hang").exists()


# Put on rank 1's path as sitecustomize.py: its checkpoint saves never return, as on a filesystem that stopped
# answering (common.checkpoint's write_checkpoint replaced once the module has defined it).
STALLED_SAVE = """
import os, sys, threading, time

def write_checkpoint(*args, **kwargs):
    time.sleep(3600)

def stall():
    while not hasattr(sys.modules.get("common.checkpoint"), "write_checkpoint"):
        time.sleep(0.01)
    sys.modules["common.checkpoint"].write_checkpoint = write_checkpoint

if os.environ.get("RANK") == "1":
    threading.Thread(target=stall, daemon=True).start()
"""


@pytest.mark.slow
def test_a_stalled_checkpoint_save_is_named_before_the_collective_would_fail(digits, tmp_path):
    """A save may be slow by nature, so it is given --ddp_timeout less the time to report (here 60 - 40 s), not
    --hang_timeout; then the rank stalled in it is named, with its phase, before rank 0's collective fails unnamed.
    The stalled save leaves no checkpoint of its step."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALLED_SAVE)
    out = tmp_path / "run"
    args = digits_args(digits, out, *FAST_MODEL, "--max_train_steps", "1000", "--checkpointing_steps", "3")
    args += ["--hang_timeout", "5", "--ddp_timeout", "60", "--dataloader_num_workers", "0"]
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    code, stderr, took, left = launch(args, out, PYTHONPATH=path)
    lines = error_lines(stderr)
    assert code != 0 and len(lines) == 1, stderr[-3000:]
    assert "(--ddp_timeout less 40 s, for a checkpoint save): rank 1 (" in lines[0], lines[0]
    assert "stalled after step 3 in checkpoint save" in lines[0], lines[0]
    assert "rank 0 waits for it in checkpoint save" in lines[0], lines[0]
    assert "write_checkpoint" in (out / "hang" / "rank-1.txt").read_text()
    assert not left and not (out / "checkpoint-3").exists() and took < 120, took


def stuck_copy(digits, tmp_path, split):
    """The digits' ImageFolder with one image of `split` replaced by a named pipe no one writes: reading it blocks,
    as a file on a dead network mount does. In training, the image of step 5 (by the sampler's order for seed
    42, 2 processes x 32), once the watch is armed; in evaluation, one of the first batch."""
    from common.data import EpochSampler

    root = tmp_path / "digits"
    shutil.copytree(digits["train"].parent, root)
    images = sorted((root / split).rglob("*.png"))  # ImageFolder's order: class folders, then names
    # (an evaluation reads the first batch of 256 on rank 0, and rank 1 pads its last one with the first 115)
    target = images[EpochSampler(len(images), 42).order(0)[4 * 64].item() if split == "train" else 200]
    target.unlink()
    os.mkfifo(target)
    return {**digits, "train": root / "train", "val": root / "val"}


@pytest.mark.slow
@pytest.mark.parametrize("split, phase", [("train", "data loading"), ("val", "evaluation (data loading)")])
def test_a_loader_stuck_on_a_file_is_named_with_its_phase_and_stack(digits, tmp_path, split, phase):
    """The pipe is read by one rank only: that rank is named as stalled in data loading (in an evaluation, the one
    --eval_steps 2 starts mid-epoch: named so), the other as waiting; the stalled rank's stack file shows the read."""
    data = stuck_copy(digits, tmp_path, split)
    out = tmp_path / "run"
    args = digits_args(
        data, out, *FAST_MODEL, "--num_train_epochs", "2", "--hang_timeout", "8", "--ddp_timeout", "120"
    )
    args += ["--dataloader_num_workers", "0", "--logging_steps", "1"]
    if split == "val":  # a mid-run evaluation at step 2, not after epoch 0's 21 steps
        args += ["--eval_steps", "2"]
    code, stderr, _, left = launch(args, out)
    lines = error_lines(stderr)
    assert code != 0 and len(lines) == 1, stderr[-3000:]
    stalled = lines[0].split("stalled after step ")[1]
    rank = int(lines[0].split(" stalled after step")[0].rsplit("rank ", 1)[1].split(" ")[0])
    assert f"in {phase};" in stalled and f"rank {1 - rank} waits for it" in lines[0], lines[0]
    stack = (out / "hang" / f"rank-{rank}.txt").read_text()
    assert "load_image" in stack and "Image.py" in stack, stack[-2000:]
    assert not left


@pytest.mark.slow
def test_a_rank_slow_to_read_its_data_is_named_a_straggler_a_slow_loader_is_named_and_an_even_run_is_not(
    digits, tmp_path
):
    """Rank 1's images are large (slow to decode, as on a slow disk; each a copy of its class's first, enlarged):
    after three logs one warning names it and the data phase; results.json holds every rank's step and data time.
    Every image large (a loader too slow for the model on every rank): one warning with the share and the fixes.
    The plain digits with the recipe's defaults (held in memory): no warning."""
    from common.data import EpochSampler

    root = tmp_path / "digits"
    shutil.copytree(digits["train"].parent, root)
    images = sorted((root / "train").rglob("*.png"))
    order, batch = EpochSampler(len(images), 42).order(0).tolist(), 32
    large = {}  # a class's image, enlarged once (a 1400x1400 PNG takes a second to write); its bytes for the rest
    for round_ in range(8):  # rank 1's batch of each round: the second of the two dealt
        for index in order[(2 * round_ + 1) * batch : (2 * round_ + 2) * batch]:
            label = images[index].parent.name
            if label not in large:
                Image.open(images[index]).convert("RGB").resize((1400, 1400)).save(images[index])
                large[label] = images[index]
            else:
                shutil.copyfile(large[label], images[index])
    data = {**digits, "train": root / "train", "val": root / "val"}
    every = tmp_path / "all-large"  # each image large, on every rank
    shutil.copytree(root, every)
    for image in (every / "train").rglob("*.png"):
        shutil.copyfile(large.get(image.parent.name, next(iter(large.values()))), image)
    results = {}
    # every rank waiting is said at the second log (step 4) or never: 4 steps of large images on both ranks, not 8
    runs = (("slow", data, 8), ("every", {**digits, "train": every / "train"}, 4), ("even", digits, 8))
    for name, folders, steps in runs:
        out = tmp_path / name
        args = digits_args(folders, out, *FAST_MODEL, "--max_train_steps", str(steps), "--logging_steps", "2")
        code, stderr, _, _ = launch([*args, *(["--dataloader_num_workers", "0"] if name != "even" else [])], out)
        assert code == 0, stderr[-3000:]
        warnings = [line for line in stderr.splitlines() if "is a straggler" in line or "wait for their data" in line]
        results[name] = (warnings, json.loads((out / "results.json").read_text()))
    warnings, res = results["slow"]
    # one rank's data: a straggler, not a loader too slow for the model on every rank (the median rank's wait)
    assert len(warnings) == 1 and "rank 1 (" in warnings[0] and "is a straggler" in warnings[0], warnings
    assert res["data_wait_share"] < 0.2 < res["per_rank"][1]["data_seconds"] / res["per_rank"][1]["step_seconds"]
    assert [r["rank"] for r in res["per_rank"]] == [0, 1]
    assert res["per_rank"][1]["data_seconds"] > 2 * res["per_rank"][0]["data_seconds"]
    assert res["log_history"][-1]["data_seconds_slowest_rank"] == 1
    (warning,), res = results["every"]  # every rank waits: the loader, not one rank
    share = re.search(r"the steps wait for their data: (\d+)% of each step", warning)
    assert share and int(share[1]) > 20 and res["data_wait_share"] > 0.2, warning
    assert "--dataloader_num_workers, now 0" in warning and "--data_on_device" in warning, warning
    warnings, res = results["even"]
    assert warnings == [] and res["data_wait_share"] < 0.2 and res["args"]["data_on_device"] is True, warnings
