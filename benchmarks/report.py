"""How every benchmark writes its results: Markdown tables, the run's environment,
JSON files and plots.

Each family formats its own rows (`run_report.py` for `run.py`, `chain/core.py`,
`chain/sequential.py`, `chain/efficientnet_chain.py`, `whole_model/report.py`,
`whole_model/applications_sweep.py`); this module is what they share. It imports
neither TensorFlow nor matplotlib at the top: `environment()` and `pyplot()` load
them when called, so a process that only starts workers and writes their tables
never loads TensorFlow.

Example:
    >>> print(table(["model", "peak MiB"], [["mlp", cell(1.5, "{:.1f}")], ["gpt2", cell(None)]]))
    | model | peak MiB |
    | --- | --- |
    | mlp | 1.5 |
    | gpt2 | - |
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

from benchmarks import _cli

MIB = 2**20


def cell(value: Any, fmt: str = "{}") -> str:
    """`value` formatted with `fmt`; "-" for None or NaN (not measured)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def row(cells: Iterable[Any]) -> str:
    """One Markdown table row ("|" inside a cell is shown as "/")."""
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def table(head: Sequence[str], rows: Iterable[Iterable[Any]],
          align: Optional[Sequence[str]] = None) -> str:
    """A Markdown table; `align` gives each column's separator ("---", "---:")."""
    return "\n".join([row(head), row(align or ["---"] * len(head)), *(row(r) for r in rows)])


def environment() -> dict[str, Any]:
    """Versions, machine, load and git state: what a reader needs to trust the numbers.

    Imports TensorFlow (for its version and devices), quietly, in the environment
    `benchmarks/_cli.py` sets."""
    with _cli.quiet_start_up():
        import keras
        import numpy
        import tensorflow as tf

        import tf_checkpointing

    return dict(
        python=sys.version.split()[0], tensorflow=tf.__version__, keras=keras.__version__,
        numpy=numpy.__version__, tf_checkpointing=getattr(tf_checkpointing, "__version__", "?"),
        platform=platform.platform(), cpu=_cpu_name(), cpu_count=os.cpu_count(),
        gpus=[d.name for d in tf.config.list_logical_devices("GPU")],
        load_average=list(os.getloadavg()),
        TF_CPU_ALLOCATOR_USE_BFC=os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
        onednn=_onednn_enabled(),
        git_commit=_git("rev-parse", "HEAD"), git_dirty=bool(_git("status", "--porcelain")))


def write_json(path: Path, payload: Any, indent: int = 2) -> Path:
    """`payload` as JSON (NumPy scalars and paths included), with a final newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=_json_default) + "\n")
    return path


def pyplot() -> Any:
    """`matplotlib.pyplot` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Writes `fig` as a PNG and closes it."""
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def _onednn_enabled() -> Any:
    """Whether TensorFlow runs oneDNN kernels: CPU peaks depend on it (see _cli.py)."""
    try:
        from tensorflow.python.util import _pywrap_util_port  # no public API says it
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
        return done.stdout.strip() if done.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
