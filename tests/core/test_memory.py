"""Tests for tf_checkpointing.core._memory: peak memory of a function, and the error that
says how to turn memory statistics on.

conftest.py sets TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported, so the
in-process tests measure with exact CPU statistics; the paths without it run in a
subprocess or with TensorFlow's reader replaced.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf
from helpers import REPO

from tf_checkpointing.core import _memory
from tf_checkpointing.core._memory import MemoryStats, default_memory_device, measure

MIB = 2**20


def _allocate_64_mib():
    x = tf.zeros([16 * MIB], tf.float32)  # 64 MiB
    return tf.reduce_sum(x)


def test_peak_of_a_known_allocation():
    peak = measure(_allocate_64_mib).peak_bytes
    assert 64 * MIB <= peak < 2 * 64 * MIB


def test_peak_is_above_the_starting_level():
    alive = tf.zeros([8 * MIB])  # 32 MiB already allocated: not part of the peak
    stats = measure(_allocate_64_mib)
    assert stats.start_bytes >= 32 * MIB
    assert 64 * MIB <= stats.peak_bytes < 2 * 64 * MIB
    del alive


def test_measure_returns_result_and_passes_arguments():
    stats = measure(lambda n, scale=1.0: tf.reduce_sum(tf.ones([n, 1024]) * scale), 1024,
                    scale=2.0)
    assert isinstance(stats, MemoryStats)
    assert float(stats.result) == 2.0 * 1024 * 1024
    assert stats.device == default_memory_device()
    assert stats.peak_mib == stats.peak_bytes / MIB
    assert stats.peak_bytes >= 4 * MIB


def test_peak_of_a_tf_function():
    @tf.function
    def step(x):
        return tf.reduce_sum(tf.matmul(x, x) + 1.0)

    x = tf.random.uniform([1024, 1024])  # each temporary: 4 MiB
    step(x)  # trace outside the measurement
    assert 4 * MIB <= measure(step, x).peak_bytes < 3 * 4 * MIB


def test_nested_measurements_keep_the_outer_peak():
    def outer():
        big = tf.zeros([16 * MIB])  # 64 MiB, freed before the inner measurement ends
        total = tf.reduce_sum(big)
        del big
        inner = measure(lambda: tf.reduce_sum(tf.zeros([4 * MIB])))  # 16 MiB
        return total, inner

    stats = measure(outer)
    inner = stats.result[1]
    assert 16 * MIB <= inner.peak_bytes < 32 * MIB
    assert stats.peak_bytes >= 64 * MIB


def test_function_that_allocates_nothing_measures_zero():
    assert measure(lambda: None).peak_bytes == 0


def test_explicit_device():
    assert measure(_allocate_64_mib, device="CPU:0").peak_bytes >= 64 * MIB


def test_unknown_device_names_the_argument():
    with pytest.raises(ValueError, match=r"argument `device`.*'CPU:0'.*received 'TPU:7'"):
        measure(_allocate_64_mib, device="TPU:7")


def test_device_must_be_a_string():
    with pytest.raises(TypeError, match=r"argument `device`.*received 0 of type int"):
        measure(_allocate_64_mib, device=0)


def test_untracked_statistics_say_how_to_enable_them(monkeypatch):
    def untracked(device):
        raise ValueError("Memory statistics not tracked for this device")

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", untracked)
    with pytest.raises(RuntimeError) as info:
        measure(_allocate_64_mib, device="CPU:0")
    message = str(info.value)
    assert "'CPU:0'" in message
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in message
    assert "before TensorFlow is imported" in message
    assert 'os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"' in message
    assert "TF_CPU_ALLOCATOR_USE_BFC=true python train.py" in message


def test_statistics_stuck_at_zero_say_how_to_enable_them(monkeypatch):
    monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                        lambda device: {"current": 0, "peak": 0})
    with pytest.raises(RuntimeError, match=r"reports 0 bytes.*TF_CPU_ALLOCATOR_USE_BFC=true"):
        measure(_allocate_64_mib, device="CPU:0")


def test_partial_cpu_statistics_raise(monkeypatch):
    """An allocator that misses small allocations (TensorFlow's default CPU one) gives
    peaks that are too low: an error, not a number."""
    monkeypatch.setattr(_memory, "_complete_stats_devices", set())
    monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                        lambda device: {"current": 1 << 20, "peak": 1 << 20})
    with pytest.raises(RuntimeError, match=r"64 KiB allocation was counted as 0 bytes.*"
                                           r"TF_CPU_ALLOCATOR_USE_BFC=true"):
        measure(_allocate_64_mib, device="CPU:0")
    assert _memory.statistics_status("CPU:0").startswith("not available: a 64 KiB")


def test_complete_statistics_are_reported_available():
    assert _memory.statistics_status("CPU:0") == "available"


@pytest.mark.slow
def test_without_bfc_measure_raises_and_says_how_to_enable():
    """Without TF_CPU_ALLOCATOR_USE_BFC, TensorFlow refuses CPU statistics or tracks only
    large allocations; either way measuring raises and tells the fix. TensorFlow runs
    first: imported before it makes its devices, the package turns the allocator on."""
    code = textwrap.dedent("""
        import tensorflow as tf
        tf.zeros([16 * 2**20]) + 1.0     # a large allocation: TF 2.21 then tracks large ones
        from tf_checkpointing.debug import measure
        try:
            peak = measure(lambda: tf.reduce_sum(tf.zeros([16 * 2**20]))).peak_bytes
        except RuntimeError as error:
            print("ERROR", error)
        else:
            print("PEAK", peak)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("ERROR Memory statistics are not available for device 'CPU:0'"), out
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in out, out
