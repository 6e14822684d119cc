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


def _run_module(**env_changes):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPP_MIN_LOG_LEVEL")}
    env.update(env_changes)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "tf_checkpointing"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"tf_checkpointing: {tf_checkpointing.__version__}\n")
    return done


def test_module_says_how_to_turn_missing_statistics_on():
    done = _run_module(TF_CPU_ALLOCATOR_USE_BFC="false")
    assert "memory statistics on CPU:0: not available: " in done.stdout, done.stdout
    assert ("  to turn them on: TF_CPU_ALLOCATOR_USE_BFC is 'false' here; set it to true "
            "before TensorFlow starts (`TF_CPU_ALLOCATOR_USE_BFC=true python train.py`)"
            in done.stdout), done.stdout


def test_module_prints_no_device_start_up_noise():
    """Creating the devices logs a failed cuInit on a machine without a GPU unless
    TF_CPP_MIN_LOG_LEVEL was 3 when TensorFlow was imported: the report hides it."""
    done = _run_module()
    for noise in ("cuInit", "cuda_platform"):
        assert noise not in done.stderr + done.stdout, done.stderr
    # Nor the lines TensorFlow prints while it loads: the report's stderr is empty.
    assert done.stderr.strip() == "", done.stderr


def test_advice_names_the_variable_and_the_import():
    from tf_checkpointing.__main__ import _how_to_enable_cpu_statistics

    os.environ.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    try:
        advice = _how_to_enable_cpu_statistics()
    finally:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # as conftest set it
    assert advice.startswith("start TensorFlow with TF_CPU_ALLOCATOR_USE_BFC=true")
    assert "import tf_checkpointing before TensorFlow runs its first op" in advice


def test_version_has_one_source():
    from importlib.metadata import version

    assert version("tf_checkpointing") == tf_checkpointing.__version__  # pyproject reads it
    assert 'attr = "tf_checkpointing.__version__"' in (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in (REPO / "pyproject.toml").read_text()
