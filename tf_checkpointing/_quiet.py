"""TensorFlow's start-up noise, hidden: what its native libraries print to stderr
while they load and create their devices, whatever ``TF_CPP_MIN_LOG_LEVEL`` says.

TensorFlow 2.21 prints three lines twice while its libraries load, before its
logging reads ``TF_CPP_MIN_LOG_LEVEL`` ("All log messages before
absl::InitializeLog() ...", "oneDNN custom operations are on ...", "Could not
find cuda drivers ..."), and, unless that level is 3 at import, more when it
creates its devices ("failed call to cuInit", "This TensorFlow binary is
optimized to use available CPU instructions ..."). They go to file descriptor 2
from C++, past ``sys.stderr``: :func:`start_up_noise_hidden` captures that
descriptor and passes on every other line.

This module imports nothing of TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["START_UP_NOISE", "start_up_noise_hidden"]

START_UP_NOISE = re.compile(
    r"All log messages before absl::InitializeLog|oneDNN custom operations|cudart_stub\.cc|"
    r"cuda_platform\.cc|failed call to cuInit|cpu_feature_guard\.cc|"
    r"To enable the following instructions|Unable to register cu(DNN|FFT|BLAS) factory|"
    r"computation placer already registered|TF-TRT Warning")


@contextlib.contextmanager
def start_up_noise_hidden() -> Iterator[None]:
    """Captures what the block writes to file descriptor 2 and, after it, writes
    back every line that is not TensorFlow's start-up noise.

    Example:
        >>> from tf_checkpointing._quiet import start_up_noise_hidden
        >>> with start_up_noise_hidden():
        ...     import tensorflow as tf   # already imported here: nothing to hide
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (a detached process): nothing to hide
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines():
                if line.strip() and not START_UP_NOISE.search(line):
                    print(line, file=sys.stderr)
