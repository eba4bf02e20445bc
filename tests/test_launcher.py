"""scripts/launcher.py, in-process and with plain Python processes (no training): credentials masked
by the same rules as results.json, accelerate configs read and checked, the parent-death signal,
and which exit code a failed or stopped launch ends with. launch.sh
through real launches: tests/test_launch_sh.py."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import launcher
import pytest
from conftest import REPO

from common import args as metrics_rules

LAUNCHER = REPO / "scripts" / "launcher.py"
TOKEN = "hf_" + "Zx9" * 10


def test_secret_rules_are_those_of_results_json():
    for name in ("SECRET_NAMES", "SECRET_VALUES"):
        ours, theirs = getattr(launcher, name), getattr(metrics_rules, name)
        assert (ours.pattern, ours.flags) == (theirs.pattern, theirs.flags), f"{name} differs from common/args.py"


@pytest.mark.parametrize(
    "words, shown",
    [
        (["--hub_token", TOKEN, "--lr", "1"], ["--hub_token", "***", "--lr", "1"]),
        ([f"--hub_token={TOKEN}"], ["--hub_token=***"]),
        (["--wandb-api-key", "0123abcd", "--x"], ["--wandb-api-key", "***", "--x"]),
        (
            ["--api_key", "k", "--client_secret", "s", "--db_password", "p"],
            ["--api_key", "***", "--client_secret", "***", "--db_password", "***"],
        ),
        (["--model_name_or_path", TOKEN], ["--model_name_or_path", "***"]),  # a hub token as any value
        (["--dataset_name", "https://user:pa55@host.org/d"], ["--dataset_name", "https://***@host.org/d"]),
        (["HF_TOKEN=" + TOKEN, "accelerate"], ["HF_TOKEN=***", "accelerate"]),
        # named like, but not, credentials; a flag without a value before the next flag
        (["--tokenizer_name", "gpt2", "--max_tokens", "512"], ["--tokenizer_name", "gpt2", "--max_tokens", "512"]),
        (["--use_auth_token", "--push_to_hub"], ["--use_auth_token", "--push_to_hub"]),
        (["--hub_token"], ["--hub_token"]),
    ],
)
def test_mask(words, shown):
    assert launcher.mask(words) == shown


def test_show_quotes_for_the_shell():
    line = launcher.show(
        [
            "ACCELERATE_USE_CPU=true",
            "/a b/accelerate",
            "launch",
            "--rdzv_conf",
            "is_host=1,join_timeout=60",
            "--hub_token",
            TOKEN,
        ]
    )
    assert line == (
        "+ ACCELERATE_USE_CPU=true '/a b/accelerate' launch --rdzv_conf is_host=1,join_timeout=60 --hub_token '***'"
    )


@pytest.mark.parametrize("path", sorted((REPO / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_configs_read_as_yaml(path):
    import yaml

    raw = yaml.safe_load(path.read_text())
    machines, processes, distributed_type, use_cpu = launcher.read_config(str(path))
    assert (int(machines), int(processes), distributed_type, use_cpu) == (
        raw["num_machines"],
        raw["num_processes"],
        raw["distributed_type"],
        str(raw["use_cpu"]).lower(),
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("num_processes: two\n", "num_processes must be a whole number from 1, got 'two'"),
        ("num_processes: 0\n", "num_processes must be a whole number from 1, got 0"),
        ("num_machines: true\n", "num_machines must be a whole number from 1, got True"),
        ("num_processes:\n", "num_processes must be a whole number from 1, got None"),
        ("use_cpu: 'yes'\n", "use_cpu must be true or false, got 'yes'"),
        ("distributed_type: multi gpu; rm -rf /\n", "distributed_type must be a name such as MULTI_GPU"),
        ("- a list\n", "not an accelerate config"),
        ("", "not an accelerate config"),
        ("num_processes: [2\n", "not a readable YAML file (expected ',' or ']', but got '<stream end>' at line 2)"),
        ("a: 1\n\tb: 2\n", "not a readable YAML file (found character '\\t' that cannot start any token at line 2)"),
    ],
)
def test_bad_configs_are_named(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        launcher.read_config(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_config_command_is_one_error_line(tmp_path):
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run([sys.executable, LAUNCHER, "config", missing], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"launch.sh: error: {missing}: not a readable YAML file (No such file or directory)\n"


# ---------------------------------------------------------------- the parent-death signal

CHILD = """
import pathlib, signal, sys, time
sys.path.insert(0, {scripts!r})
from launcher import die_with_parent
done = pathlib.Path({done!r})
signal.signal(signal.SIGTERM, lambda *_: (done.write_text("SIGTERM"), sys.exit(0)))
assert die_with_parent(signal.SIGTERM, {parent})
pathlib.Path({ready!r}).write_text("ready")
time.sleep(60)
"""


def wait_for(path: Path, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_process_gets_sigterm_when_its_parent_is_killed(tmp_path):
    done, ready = tmp_path / "done", tmp_path / "ready"
    child = CHILD.format(scripts=str(REPO / "scripts"), done=str(done), ready=str(ready), parent=None)
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(60)",
        ]
    )
    try:
        assert wait_for(ready), "the child did not start"
        assert not done.exists()
        parent.kill()  # SIGKILL: nothing the parent does on its way out
        assert wait_for(done, 10), "the child outlived its parent"
        assert done.read_text() == "SIGTERM"
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_parent_already_gone_sends_the_signal_at_once(tmp_path):
    """The race: the parent died before the child asked for the signal (the child is reparented)."""
    done, ready = tmp_path / "done", tmp_path / "ready"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that is no process's parent now
    child = CHILD.format(scripts=str(REPO / "scripts"), done=str(done), ready=str(ready), parent=gone.pid)
    proc = subprocess.run([sys.executable, "-c", child], timeout=30)
    assert proc.returncode == 0 and done.read_text() == "SIGTERM" and not ready.exists()


# ---------------------------------------------------------------- exit codes


def failure(exitcode, timestamp, pid=100):
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, pid=pid)


def test_the_first_failure_is_the_cause():
    assert launcher._first_failure({0: failure(-15, 11), 1: failure(2, 10)})[0] == 1
    # torch stamps whole seconds: a peer cut off in the same second is not the cause
    assert launcher._first_failure({0: failure(1, 10), 1: failure(2, 10)})[0] == 1
    assert launcher._first_failure({0: failure(-15, 10), 1: failure(75, 10), 2: failure(1, 10)})[0] == 1
    assert launcher._first_failure({0: failure(-9, 10), 1: failure(1, 10)})[0] == 1
    assert launcher._first_failure({3: failure(1, 10), 2: failure(1, 10)})[0] == 2


def test_exit_codes(capsys):
    assert launcher._exit_code(2, "rank 0") == 2 and launcher._exit_code(75, "rank 0") == 75
    assert capsys.readouterr().err == ""  # the process said why itself
    assert launcher._exit_code(-signal.SIGKILL, "process rank 1 (pid 7)") == 137
    said = capsys.readouterr().err
    assert said == "launch.sh: process rank 1 (pid 7) was killed by SIGKILL (out of memory? see dmesg)\n"


@pytest.mark.parametrize(
    "codes, expected",
    [
        ({0: 0, 1: 0}, 0),  # the processes finished (the signal came during the final save)
        ({0: 75, 1: 75}, 75),
        ({0: 2, 1: -15}, 2),
        ({0: -15, 1: -15}, 143),
        ({}, 143),
        ({0: 1, 1: -15}, 1),
    ],
)
def test_a_stopped_launch_ends_with_what_its_processes_did(monkeypatch, codes, expected):
    monkeypatch.setattr(launcher, "_exit_codes", codes)
    assert launcher._stopped_code(signal.SIGTERM) == expected


def test_only_the_first_stop_signal_interrupts_the_agent(monkeypatch):
    from torch.distributed.elastic.multiprocessing import SignalException, api

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # restored afterwards
    launcher._stop_once()
    with pytest.raises(SignalException):
        api._terminate_process_handler(signal.SIGTERM, None)
    assert api._terminate_process_handler(signal.SIGTERM, None) is None
    assert api._terminate_process_handler(signal.SIGINT, None) is None


def test_quiet_elastic_log():
    import logging

    quiet = launcher._QuietElastic()

    def record(msg, *args):
        name = "torch.distributed.elastic.multiprocessing.api"
        return logging.LogRecord(name, logging.WARNING, "", 0, msg, args, None)

    assert not quiet.filter(record("Sending process %s closing signal %s", 12, "SIGTERM"))
    assert not quiet.filter(record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 12, "python"))
    killed = record(
        "Unable to shutdown process %s via %s, forcefully exiting via %s", 12, signal.SIGTERM, signal.SIGKILL
    )
    assert quiet.filter(killed)
    assert re.fullmatch(
        r"launch\.sh: process 12 had not exited \d+ s after SIGTERM "
        r"\(TORCH_ELASTIC_SHUTDOWN_TIMEOUT\): killed it; .*",
        killed.getMessage(),
    )
    other = record("something %s in %s", "new", f"https://u:{TOKEN}@host/")
    assert quiet.filter(other) and other.getMessage() == "launcher: warning: something new in https://***@host/"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_processes_the_agent_did_not_close_end_with_the_launcher(tmp_path):
    """A training process that torch's agent started as a stop signal came is not among those it
    stops; before its parent-death signal is set it would outlive the launcher. `run` ends them:
    SIGTERM, then SIGKILL for one that ignores it. Started in sessions of their own, as the agent does."""
    script = tmp_path / "strays.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        f"sys.path.insert(0, {str(REPO / 'scripts')!r})\n"
        "import launcher\n"
        "plain = subprocess.Popen(['sleep', '100'], start_new_session=True)\n"
        "stubborn = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(100)'],"
        " start_new_session=True, stdout=subprocess.PIPE)\n"
        "stubborn.stdout.readline()\n"
        "assert sorted(launcher._children()) == sorted([plain.pid, stubborn.pid])\n"
        "start = time.monotonic()\n"
        "launcher._end_strays(grace=1)\n"
        "print(plain.wait(), stubborn.wait(), launcher._children(), time.monotonic() - start)\n"
    )
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    *codes, took = proc.stdout.split()
    assert codes == [str(-signal.SIGTERM), str(-signal.SIGKILL), "[]"], proc.stderr
    assert 1 <= float(took) < 30  # the stubborn one had its grace second
