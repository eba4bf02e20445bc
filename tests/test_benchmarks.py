"""The benchmark scripts in their smallest setting (`benchmarks/run_all.py --smoke`), so they keep
working: each runs, and what it wrote holds the numbers its runs measured, combined as the tables
say. No speed is asserted here; benchmarks/README.md holds the measurements."""

import json
import re
import statistics
from pathlib import Path

import pytest
from conftest import BIN, REPO, results, run, user_env

pytestmark = pytest.mark.slow  # every test here launches recipes (pytest -m 'not slow' skips them)

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    readme = (REPO / "benchmarks/README.md").read_text()
    run([BIN / "python", REPO / "benchmarks/run_all.py", "--smoke", "--out", out], env=user_env(), timeout=600)
    assert (REPO / "benchmarks/README.md").read_text() == readme, "a smoke run must not touch the README"
    return out


def load(out, name):
    return json.loads((out / f"{name}.json").read_text())


def test_results_md_names_the_machine_and_holds_every_table(smoke):
    md = (smoke / "results.md").read_text()
    machine = load(smoke, "overhead")["machine"]
    assert machine["cpu"] in md and f"{machine['cores']} cores" in md and f"torch {machine['torch']}" in md
    for title in ("### Overhead", "### Scaling", "### Input pipeline", "### LM"):
        assert md.count(title) == 1, title
    if machine["gpu"] is None:
        assert "GPU numbers: not measured" in md
    assert "smoke setting" in md


def test_overhead_ratio_is_the_recipe_run_over_the_hand_written_loop(smoke):
    (entry,) = load(smoke, "overhead")["results"]
    assert (entry["processes"], entry["accumulation"], entry["baseline"]) == (1, 1, "ddp")
    (run_dir,), (loop_file,) = entry["recipe_runs"], entry["loop_runs"]
    recipe, loop = results(run_dir), json.loads(Path(loop_file).read_text())
    assert recipe["steps"] == 3 and recipe["world_size"] == loop["world_size"] == 1
    assert recipe["distributed_type"] == "NO"  # one CPU process: no DistributedDataParallel of one
    rate, loop_rate = median_step_rate(recipe), loop["median_step_samples_per_second"]["ddp"]
    assert entry["recipe_samples_per_second"] == [pytest.approx(rate)]
    assert entry["baseline_samples_per_second"] == [loop_rate] and loop_rate > 0
    assert entry["median_ratio"] == pytest.approx(rate / loop_rate)
    md = (smoke / "overhead.md").read_text()
    assert f"{entry['median_ratio']:.3g}" in md


def median_step_rate(res):
    """Samples/s at the median step after the first, from a run that logged every step."""
    assert [h["step"] for h in res["log_history"]] == list(range(1, res["steps"] + 1))
    ends = [h["train_seconds"] for h in res["log_history"]]
    return res["effective_batch_size"] / statistics.median(b - a for a, b in zip(ends[:-1], ends[1:]))


def test_step_cost_is_the_recipe_loop_over_the_bare_loop(smoke):
    cost = load(smoke, "overhead")["step_cost"]
    differences = [r - b for r, b in zip(cost["recipe_us_per_step"], cost["bare_us_per_step"], strict=True)]
    assert cost["machinery_us_per_step"] == pytest.approx(statistics.median(differences))
    ours = [r - a for r, a in zip(cost["recipe_us_per_step"], cost["bare_accelerate_us_per_step"], strict=True)]
    assert cost["recipes_own_us_per_step"] == pytest.approx(statistics.median(ours))
    assert min(cost["bare_us_per_step"]) > 0
    assert f"adds **{cost['machinery_us_per_step']:.0f} us per optimizer step**" in (smoke / "overhead.md").read_text()


def test_scaling_speedup_and_efficiency_come_from_the_runs_throughputs(smoke):
    rows = {(r["mode"], r["processes"]): r for r in load(smoke, "scaling")["results"]}
    assert set(rows) == {("weak", 1), ("weak", 2)}
    one, two = rows[("weak", 1)], rows[("weak", 2)]
    assert one["per_device_batch"] == two["per_device_batch"] == 32 and two["global_batch"] == 64
    # run_all shares runs: the 1-process point is overhead's recipe run, not a second launch
    assert one["runs"] == load(smoke, "overhead")["results"][0]["recipe_runs"]
    for n, row in ((1, one), (2, two)):
        (run_dir,) = row["runs"]
        res = results(run_dir)
        assert res["world_size"] == n and res["args"]["per_device_train_batch_size"] == 32
        assert row["samples_per_second"] == pytest.approx(median_step_rate(res)) and row["samples_per_second"] > 0
    assert one["speedup"] == pytest.approx(1.0)
    assert two["speedup"] == pytest.approx(two["samples_per_second"] / one["samples_per_second"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    png = (smoke / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "![scaling](scaling.png)" in (smoke / "scaling.md").read_text()


def test_input_pipeline_compares_every_loader_setting_with_the_model(smoke):
    record = load(smoke, "input_pipeline")
    model = record["model_samples_per_second"]
    assert model > 0
    seen = {(r["path"], r["num_workers"], r["persistent_workers"]) for r in record["results"]}
    assert seen == {
        ("DataLoader", 0, False),
        ("DataLoader", 1, False),
        ("DataLoader", 1, True),
        ("--data_on_device", 0, False),
    }
    for row in record["results"]:
        assert len(row["samples_per_second_per_epoch"]) == 2 and min(row["samples_per_second_per_epoch"]) > 0
        assert row["loader_over_model"] == pytest.approx(row["samples_per_second"] / model)
        assert row["verdict"] == ("input-bound" if row["samples_per_second"] < model else "compute-bound")
    # the digits fit: the recipe holds them on the device by default, and each path's recipe runs say their wait
    assert [r["path"] for r in record["results"] if r["default"]] == ["--data_on_device"]
    runs = record["recipe_runs"]
    assert [r["default"] for r in runs] == [True, False] and runs[0]["path"] == "--data_on_device"
    for r in runs:
        assert r["data_wait_share"] == r["all"][0]["data_wait_share"] and 0 <= r["data_wait_share"] < 1, r
        assert r["samples_per_second"] > 0


def test_lm_reports_the_runs_tokens_per_second_and_memory(smoke):
    (entry,) = load(smoke, "lm")["results"]
    (run_dir,) = entry["runs"]
    res = results(run_dir)
    assert entry["config"] == "ddp" and entry["processes"] == res["world_size"] == 2
    assert entry["tokens_per_second"] == res["steady_tokens_per_second"] > 0
    assert entry["mfu"] is None  # CPU: no known peak
    assert (
        entry["peak_memory_gb_per_process"] == res["peak_memory_gb_per_process"]
        and min(res["peak_memory_gb_per_process"]) > 0
    )
    assert entry["parameters_per_process"] == [entry["parameters"]] * 2


def test_readme_shows_the_results_of_the_last_full_run():
    """benchmarks/README.md holds results/results.md as run_all.py wrote it, on the machine it names."""
    readme = (REPO / "benchmarks/README.md").read_text()
    shown = re.search(r"<!-- results:start -->\n(.*?)<!-- results:end -->", readme, flags=re.S).group(1)
    written = (REPO / "benchmarks/results/results.md").read_text()
    assert shown == re.sub(r"\]\(([\w.-]+\.png)\)", r"](results/\1)", written)
    assert "--smoke" not in shown
    machine = json.loads((REPO / "benchmarks/results/overhead.json").read_text())["machine"]
    assert machine["cpu"] in shown and f"torch {machine['torch']}" in shown
