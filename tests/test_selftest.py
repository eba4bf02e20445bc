"""`./launch.sh selftest`: what a user runs on new hardware, run here under DDP and ZeRO-3; and shown to fail when a
recipe breaks a promise."""

import re
import shutil

import pytest
from conftest import REPO, cpu_env, run

# DDP and ZeRO-3, the README's command: the selftest's code is the same under every config, and what it checks under
# ZeRO-2, ZeRO-3 with offload and FSDP2 the ZeRO and FSDP tests check with more (test_zero.py, test_fsdp.py)
CONFIGS = ["cpu", "zero3"]


def test_the_readmes_selftest_commands_are_run_here():
    lines = re.findall(r"^\./launch\.sh selftest (.*)$", (REPO / "README.md").read_text(), flags=re.M)
    assert lines and all(re.fullmatch(r"--config (\S+)", line)[1] in CONFIGS for line in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_selftest_passes_under_ddp_and_zero3(config):
    proc = run([REPO / "launch.sh", "selftest", "--config", config], env=cpu_env(), timeout=900)
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("  ")]
    names = {" ".join(row[:2]) for row in rows}
    assert {"one big", "exact eval", "save reloads", "exact resume"} <= names, proc.stdout
    assert all("pass" in row for row in rows) and proc.stdout.rstrip().endswith(f"{len(rows)} of {len(rows)} passed")
    assert ("images learn" in proc.stdout) == (config == "cpu")  # the image recipe is DDP's


@pytest.mark.slow
def test_selftest_fails_on_a_recipe_that_breaks_a_promise(tmp_path):
    """lm_finetune with its loss weighted per micro-batch again (the mean of each process's mean): 2 processes no
    longer make 1 process's update, and the selftest says so, with the distance, and exits 1."""
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
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("  one big batch")]
    assert "FAIL" in row and "distance" in row and "FAILED: one big batch" in proc.stdout
