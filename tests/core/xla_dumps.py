"""Reading XLA's own account of a training step: its buffer assignment and optimised HLO.

A test script compiles two steps named ``plain_step`` and ``checkpointed_step`` under
``tf.function(jit_compile=True)``; XLA dumps each module (``XLA_FLAGS=--xla_dump_to``),
and these helpers read, per step, the temporaries' buffer, every buffer's total and
the matrix products left in the optimised HLO. A test file's scripts are compiled
in one process per XLA:CPU scheduler (:func:`compile_scripts`: the scheduler is a
process-wide flag, and each process pays TensorFlow's start-up), each script in
globals of its own and its steps named after it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Optional

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

# Without LLVM's expensive passes, as the suite's own processes (conftest): the buffer
# assignment these tests read is made on the HLO, before LLVM runs.
_FAST = "--xla_llvm_disable_expensive_passes=true"

# Matrix products as dots or, where XLA:CPU hands them to oneDNN (TF 2.16), custom calls.
MATMUL = r' dot\(|custom_call_target="__onednn\$matmul"'


def compile_dumped(tmp_path: Path, flags: str, script: str,
                   stdin: Optional[str] = None) -> Optional[str]:
    """Runs ``script`` with XLA dumping to ``tmp_path``; its stdout, or None if this
    XLA does not know ``flags``."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO),
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text {_FAST} {flags}")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600, cwd=REPO, input=stdin)
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


# Runs the scripts given as JSON on stdin ({name: script}), each in globals of its own;
# prints, per name, the traceback of its failure ("" if it ran).
_DRIVER = textwrap.dedent("""
    import json, sys, traceback
    failures = {}
    for name, script in json.loads(sys.stdin.read()).items():
        try:
            exec(compile(script, f"<{name}>", "exec"), {"__name__": "__main__"})
            failures[name] = ""
        except Exception:
            failures[name] = traceback.format_exc()
    print("FAILURES", json.dumps(failures))
""")


def compile_scripts(folder: Path, concurrent: bool, scripts: dict[str, str]) -> CompiledScripts:
    """Compiles the steps of each of ``scripts`` (name: script, each as
    :func:`compile_dumped` runs one) in one process, under the XLA:CPU scheduler
    ``concurrent`` picks, XLA dumping to ``folder``; a script's steps are named
    ``<name>_plain_step`` and ``<name>_checkpointed_step`` (read them with
    ``step=f"{name}_plain"``). An XLA with one CPU scheduler (TensorFlow 2.16's)
    compiles under the default id, without the flag; the other id skips."""
    renamed = {name: script.replace("plain_step", f"{name}_plain_step")
               .replace("checkpointed_step", f"{name}_checkpointed_step")
               for name, script in scripts.items()}
    flag = f"--xla_cpu_enable_concurrency_optimized_scheduler={str(concurrent).lower()}"
    stdout = compile_dumped(folder, flag, _DRIVER, stdin=json.dumps(renamed))
    if stdout is None:
        if not concurrent:
            pytest.skip("this TensorFlow's XLA has one CPU scheduler (checked as the default)")
        folder, concurrent = folder / "one-scheduler", False
        stdout = compile_dumped(folder, "", _DRIVER, stdin=json.dumps(renamed))
    failures = json.loads(stdout.split("FAILURES", 1)[1])
    return CompiledScripts(folder, concurrent, failures)


class CompiledScripts:
    """What :func:`compile_scripts` compiled: where, under which scheduler, and
    per script the traceback of its failure ("" if it ran)."""

    def __init__(self, folder: Path, concurrent: bool, failures: dict[str, str]) -> None:
        self.folder, self.concurrent, self.failures = folder, concurrent, failures

    def temporaries(self, name: str) -> tuple[int, int]:
        """(plain, checkpointed) temporaries of script ``name``'s steps."""
        assert self.failures[name] == "", self.failures[name][-3000:]
        return (temporaries(self.folder, f"{name}_plain"),
                temporaries(self.folder, f"{name}_checkpointed"))

    def found(self, name: str, read: Callable[[Path, str], int]) -> dict[str, int]:
        """``read`` (total_bytes, matmuls, ...) of script ``name``'s two steps."""
        assert self.failures[name] == "", self.failures[name][-3000:]
        return {step: read(self.folder, f"{name}_{step}") for step in ("plain", "checkpointed")}
