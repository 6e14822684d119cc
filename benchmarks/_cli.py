"""What every benchmark script does before and around its run: a quiet TensorFlow
start-up, and where results go (an ignored directory unless asked otherwise).

Import this module before TensorFlow: it sets the environment TensorFlow reads
once, when it starts. A script in a family's folder (`benchmarks/chain/core.py`)
puts the repository on `sys.path` first, so that it runs as `python
benchmarks/chain/core.py` as well as `python -m benchmarks.chain.core`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from argparse import ArgumentParser, Namespace
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results"
LATEST = COMMITTED / "latest"  # in .gitignore: a user's run never dirties the checkout

# Exact CPU memory statistics need the BFC allocator, chosen when TensorFlow starts.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # no INFO/WARNING/ERROR C++ logs
# TensorFlow 2.21 on Linux turns oneDNN on by default only on CPUs with AVX-512 VNNI/BF16,
# AVX-VNNI or AMX, and oneDNN's convolution and BatchNorm kernels use far less memory than
# Eigen's (the U-Net's peaks: benchmarks/results/notes/main-job.md#environment). Pinned, so
# peaks do not depend on the host's CPU; the committed results were measured with oneDNN on.
# TF_ENABLE_ONEDNN_OPTS=0 turns it off.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

@contextlib.contextmanager
def quiet_start_up() -> Iterator[None]:
    """Hides TensorFlow's start-up noise printed to the process's stderr (file
    descriptor 2) while the block imports TensorFlow and Keras; every other line
    written meanwhile is passed on."""
    if "tensorflow" in sys.modules:
        yield
        return
    # The package's own filter, read from its file: imported as tf_checkpointing._quiet
    # it would run the package's __init__, which imports TensorFlow unfiltered.
    spec = importlib.util.spec_from_file_location(
        "tf_checkpointing_quiet", REPO / "tf_checkpointing" / "_quiet.py")
    quiet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quiet)
    with quiet.start_up_noise_hidden():
        yield


def add_output_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--out", type=Path,
                        help=f"output directory (default: {LATEST.relative_to(REPO)}, "
                             "ignored by git)")
    parser.add_argument("--update-results", action="store_true",
                        help=f"write to {COMMITTED.relative_to(REPO)}/, the committed "
                             "results README.md and docs/ quote (maintainers, after a change)")


def add_rerender_argument(parser: ArgumentParser) -> None:
    parser.add_argument("--rerender", type=Path, metavar="JSON",
                        help="write the Markdown table (and plot) of a finished run again "
                             "from its JSON, beside it, without measuring (after a change "
                             "to how results are presented)")


def output_dir(args: Namespace) -> Path:
    if args.out is not None and args.update_results:
        raise SystemExit("error: give either --out or --update-results, not both")
    if args.update_results:
        return COMMITTED
    return args.out if args.out is not None else LATEST


def worker_result(command: list[str]) -> dict:
    """Runs a benchmark's worker process: the JSON of its last stdout line, or, where
    it failed, ``{"error": ...}`` holding the error's own line (Keras prints the
    arguments a layer was called with after it)."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    lines = done.stderr.strip().splitlines() or ["?"]
    said = [line for line in lines if "argument `" in line or line.endswith("Error")]
    return {"error": (said or lines)[-1].strip()[:400]}
