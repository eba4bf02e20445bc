"""pyflakes over everything Python: an undefined name in a rarely-run branch (a DeepSpeed-only
path, an error message) fails here, not in a user's job hours in."""

import subprocess
import sys

from conftest import REPO


def test_pyflakes_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "pyflakes", "recipes", "common", "tests", "scripts"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
