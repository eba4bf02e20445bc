"""`./launch.sh selftest`: what a user runs on new hardware, run here under DDP and ZeRO-3; and shown to fail when a
recipe breaks a promise."""

import re
import shutil

import pytest
import selftest
from conftest import REPO, cpu_env, run

# ZeRO-3, the README's command, here; DDP with a broken recipe below. The selftest's code is the same under every
# config, and what it checks under ZeRO-2, ZeRO-3 with offload and FSDP2 the ZeRO and FSDP tests check with more.
CONFIGS = ["zero3"]


def test_the_readmes_selftest_commands_are_run_here():
    lines = re.findall(r"^\./launch\.sh selftest (.*)$", (REPO / "README.md").read_text(), flags=re.M)
    assert lines and all(re.fullmatch(r"--config (\S+)", line)[1] in CONFIGS for line in lines), lines


def rows(stdout: str) -> dict:
    """The selftest's rows by name: '  one big batch  pass  distance ...' -> {'one big batch': 'pass distance ...'}."""
    found = (re.match(r"  (\S+(?: \S+)*?) +(pass|FAIL) +(.*)", line) for line in stdout.splitlines())
    return {m[1]: f"{m[2]} {m[3]}" for m in found if m}


@pytest.mark.slow
@pytest.mark.parametrize("config", [*CONFIGS, "tp"])  # tp: a TP group shares a batch, and checkpoints are DCP's
def test_selftest_passes_under_zero3_and_tensor_parallelism(config):
    proc = run([REPO / "launch.sh", "selftest", "--config", config], env=cpu_env(), timeout=900)
    said = rows(proc.stdout)
    assert set(said) == {"one big batch", "exact eval", "save reloads", "exact resume"}, proc.stdout
    assert all(row.startswith("pass") for row in said.values()) and proc.stdout.rstrip().endswith("4 of 4 passed")


@pytest.mark.slow
def test_selftest_under_ddp_fails_just_the_promise_a_recipe_breaks(tmp_path):
    """lm_finetune with its loss weighted per micro-batch again (the mean of each process's mean): 2 processes no
    longer make 1 process's update, and the selftest says so, with the distance, and exits 1; what the recipe still
    keeps passes, and the image recipe (DDP's) learns."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("launch.sh", "scripts", "recipes", "accelerate_configs", "common"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, tree / name)
    recipe = tree / "recipes" / "lm_finetune.py"
    text = recipe.read_text()
    assert "num_items_in_batch=tokens" in text
    recipe.write_text(text.replace("num_items_in_batch=tokens", "num_items_in_batch=None"))
    proc = run([tree / "launch.sh", "selftest", "--config", "cpu"], env=cpu_env(), timeout=900, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    said = rows(proc.stdout)
    assert said.pop("one big batch").startswith("FAIL distance"), proc.stdout
    assert set(said) == {"exact eval", "save reloads", "exact resume", "images learn"}, proc.stdout
    assert all(row.startswith("pass") for row in said.values()), proc.stdout
    assert re.search(
        r"input held on the device, \d+% of each step waiting for it: (compute|input)-bound", said["images learn"]
    ), said  # the default input path, and which of loader and model sets the pace
    assert proc.stdout.rstrip().endswith("4 of 5 passed; FAILED: one big batch")


def test_a_mistake_every_check_would_meet_is_one_line_and_exit_2(tmp_path):
    """fp16 asked on a CPU (a cache variable that is a file, ...) is wrong for every check alike: its line, once, and
    exit 2, not five FAIL rows each with the same line after minutes. launch.sh's plan, which the selftest reads
    first, refuses fp16 on a CPU (common.preflight's rule): nothing is launched."""
    fp16 = ["--config", "cpu", "--num_processes", "1", "--mixed_precision", "fp16"]
    proc = run([REPO / "launch.sh", "selftest", *fp16], env=cpu_env(), check=False)
    assert proc.returncode == 2 and rows(proc.stdout) == {}, proc.stdout + proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if "error" in line]  # once, not once a check
    assert line.startswith("launch.sh: error: ") and "--mixed_precision" in line, proc.stderr  # what to change


@pytest.mark.slow
def test_a_mistake_the_first_check_meets_ends_the_selftest_in_its_one_line(tmp_path):
    """A cache variable that is a file passes launch.sh's plan; the first check's run refuses it (exit 2), and the
    selftest ends there with that line, once, not a FAIL row for each check."""
    cache = tmp_path / "file"
    cache.write_text("")
    proc = run([REPO / "launch.sh", "selftest", "--config", "cpu", "--num_processes", "1"],
               env=cpu_env(HF_DATASETS_CACHE=str(cache)), check=False)  # fmt: skip
    assert proc.returncode == 2 and rows(proc.stdout) == {}, proc.stdout + proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if "error" in line]
    assert line.startswith("error: ") and "$HF_DATASETS_CACHE" in line, proc.stderr


def test_an_option_out_of_range_is_refused_by_the_parser_before_anything_starts(capsys):
    """0 processes ran the whole selftest as the config's number: the selftest's parser (scripts/selftest.py, which
    `./launch.sh selftest` runs first, before any launch) refuses it, exit 2, one line naming the option."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        selftest.main(["--num_processes", "0"])
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == "", captured.out
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    assert exit_.value.__cause__.subject == "--num_processes" and "--num_processes" in captured.err
