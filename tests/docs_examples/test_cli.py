"""`python -m tf_checkpointing`: the environment report users paste into bug reports."""

import os
import subprocess
import sys

import tensorflow as tf
from helpers import REPO

import tf_checkpointing
from tf_checkpointing.__main__ import report


def test_report_names_versions_devices_and_statistics():
    text = report()
    assert f"tf_checkpointing: {tf_checkpointing.__version__}" in text
    assert f"tensorflow: {tf.__version__}" in text
    assert "keras: " in text and "devices: " in text
    assert "memory statistics on CPU:0: available" in text  # conftest turns BFC on


def test_module_runs_and_says_when_statistics_are_missing():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "tf_checkpointing"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"tf_checkpointing: {tf_checkpointing.__version__}\n")
    assert "memory statistics on CPU:0: not available" in done.stdout


def test_version_has_one_source():
    from importlib.metadata import version

    from tf_checkpointing._version import __version__

    assert tf_checkpointing.__version__ == __version__
    assert version("tf_checkpointing") == __version__  # pyproject reads _version.py
    assert 'dynamic = ["version"]' in (REPO / "pyproject.toml").read_text()
