"""What every benchmark script does before and around its run: a quiet TensorFlow
start-up, and where results go (an ignored directory unless asked otherwise).

Import this module before TensorFlow: it sets the environment TensorFlow reads
once, when it starts. A script in a family's folder (`benchmarks/chain/core.py`)
puts the repository on `sys.path` first, so that it runs as `python
benchmarks/chain/core.py` as well as `python -m benchmarks.chain.core`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
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
# Eigen's (the U-Net's peaks: docs/benchmarks.md, Environment). Pinned, so peaks do not
# depend on the host's CPU; the committed results were measured with oneDNN on.
# TF_ENABLE_ONEDNN_OPTS=0 turns it off.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

# Lines TensorFlow's native libraries print while they load, before their logging is
# set up, so that TF_CPP_MIN_LOG_LEVEL cannot hide them (measured on TF 2.21, CPU).
_START_UP_NOISE = re.compile(
    r"All log messages before absl::InitializeLog|cudart_stub\.cc|cuda_platform\.cc|"
    r"cpu_feature_guard\.cc|To enable the following instructions|oneDNN custom operations|"
    r"failed call to cuInit|Unable to register cu(DNN|FFT|BLAS) factory|"
    r"computation placer already registered|TF-TRT Warning")


@contextlib.contextmanager
def quiet_start_up() -> Iterator[None]:
    """Hides TensorFlow's start-up noise printed to the process's stderr (file
    descriptor 2) while the block imports TensorFlow and Keras; every other line
    written meanwhile is passed on."""
    if "tensorflow" in sys.modules:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines():
                if line.strip() and not _START_UP_NOISE.search(line):
                    print(line, file=sys.stderr)


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
