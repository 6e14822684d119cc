"""Reading XLA's own account of a training step: its buffer assignment and optimised HLO.

A test script compiles two steps named ``plain_step`` and ``checkpointed_step`` under
``tf.function(jit_compile=True)``; XLA dumps each module (``XLA_FLAGS=--xla_dump_to``),
and these helpers read, per step, the temporaries' buffer, every buffer's total and
the matrix products left in the optimised HLO.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
from helpers import REPO

# The end of a test script: its plain and checkpointed steps, compiled once (named
# so that XLA's dumps name them), from its `blocks`, `variables`, `x` and `loss_of`.
STEPS = textwrap.dedent("""
    def step_of(checkpoint):
        def step(x):
            with tf.GradientTape() as tape:
                h = x
                for block in blocks:
                    h = block(h, _checkpoint=checkpoint)
                loss = loss_of(h)
            return tape.gradient(loss, variables)
        return step

    def plain_step(x):
        return step_of(False)(x)

    def checkpointed_step(x):
        return step_of(True)(x)

    for fn in (plain_step, checkpointed_step):
        tf.function(fn, jit_compile=True)(x)
""")

# Matrix products as dots or, where XLA:CPU hands them to oneDNN (TF 2.16), custom calls.
MATMUL = r' dot\(|custom_call_target="__onednn\$matmul"'


def compile_dumped(tmp_path: Path, flags: str, script: str) -> Optional[str]:
    """Runs ``script`` with XLA dumping to ``tmp_path``; its stdout, or None if this
    XLA does not know ``flags``."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO),
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text {flags}")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    if "Unknown flags in XLA_FLAGS" in done.stderr:
        return None
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def buffer_report(tmp_path: Path, step: str) -> str:
    # The buffer assignment: TF 2.16 writes no memory-usage report.
    (report,) = tmp_path.glob(f"*{step}_step*cpu_after_optimizations-buffer-assignment.txt")
    return report.read_text()


def temporaries(tmp_path: Path, step: str) -> int:
    """Bytes of XLA's buffer for ``step``'s temporaries."""
    return int(re.search(r"size (\d+), preallocated-temp",
                         buffer_report(tmp_path, step)).group(1))


def total_bytes(tmp_path: Path, step: str) -> int:
    """Bytes of every buffer of ``step`` (parameters and outputs too)."""
    return int(re.search(r"Total bytes used: (\d+)", buffer_report(tmp_path, step)).group(1))


def matmuls(tmp_path: Path, step: str) -> int:
    """Matrix products in ``step``'s optimised HLO."""
    (hlo,) = tmp_path.glob(f"*{step}_step*cpu_after_optimizations.txt")
    return len(re.findall(MATMUL, hlo.read_text()))


def under_scheduler(tmp_path: Path, concurrent: bool, script: str) -> tuple[int, int, bool]:
    """(plain, checkpointed) temporaries of ``script`` under the XLA:CPU scheduler
    ``concurrent`` picks, and whether it was the concurrency-optimised one. An XLA
    with one CPU scheduler (TensorFlow 2.16's) is checked once, under the default
    id: the other id skips."""
    flag = f"--xla_cpu_enable_concurrency_optimized_scheduler={str(concurrent).lower()}"
    if compile_dumped(tmp_path, flag, script) is None:
        if not concurrent:
            pytest.skip("this TensorFlow's XLA has one CPU scheduler (checked as the default)")
        tmp_path, concurrent = tmp_path / "one-scheduler", False
        compile_dumped(tmp_path, "", script)
    return temporaries(tmp_path, "plain"), temporaries(tmp_path, "checkpointed"), concurrent
