"""Gradient checkpointing for TensorFlow 2 and Keras 3 that saves memory and
gives exact gradients.

    from tf_checkpointing import checkpointable

    @checkpointable(checkpoint=True)
    def block(x, training=None): ...

The public API is ``__all__`` below, with two submodules of its own:
:mod:`tf_checkpointing.plans` (plans and the planners that make them) and
:mod:`tf_checkpointing.debug` (measuring memory, listing what a gradient keeps).

The package has three floors, each importing only the ones below it: the replay
core (:mod:`tf_checkpointing.core`: one checkpointed call and what keeps its
replay exact), planning (:mod:`tf_checkpointing.planning`: profiles in, a plan
out), and the API in this folder (the decorator, the Keras integration, and the
runners of chains and models), which uses both.

Importing it turns on TensorFlow's CPU memory statistics when that can still
take effect (see :mod:`tf_checkpointing._cpu_statistics`).
"""

import sys
import warnings
from typing import Any

__version__ = "0.1.0"  # the one place it is written (pyproject.toml reads it)

from tf_checkpointing import _cpu_statistics

_cpu_statistics.arrange()  # before TensorFlow creates its devices

if getattr(sys, "orig_argv", [])[-2:] == ["-m", "tf_checkpointing"] and (
        "tensorflow" not in sys.modules):
    # The report (python -m tf_checkpointing) is read by people pasting it into bug
    # reports: TensorFlow's start-up lines, printed while it loads, are not part of it.
    from tf_checkpointing._quiet import start_up_noise_hidden

    with start_up_noise_hidden():
        import tensorflow  # noqa: F401

# ruff: noqa: E402 - the allocator is arranged before TensorFlow is used

from tf_checkpointing import debug, plans, policies
from tf_checkpointing._decorator import checkpointable
from tf_checkpointing._keras import apply_checkpointing
from tf_checkpointing._remat_scope import RematScope
from tf_checkpointing._sequential import checkpoint_sequential
from tf_checkpointing._sequential_layer import CheckpointedSequential
from tf_checkpointing._whole_model import plan_model
from tf_checkpointing.core._errors import ReplayMismatchError
from tf_checkpointing.core._flags import is_checkpointing, is_recomputing
from tf_checkpointing.core._save_policies import checkpoint_name
from tf_checkpointing.planning.plans._plan import ModelPlan

__all__ = [
    "CheckpointedSequential",
    "ModelPlan",
    "RematScope",
    "ReplayMismatchError",
    "apply_checkpointing",
    "checkpoint_name",
    "checkpoint_sequential",
    "checkpointable",
    "debug",
    "is_checkpointing",
    "is_recomputing",
    "plan_model",
    "plans",
    "policies",
]

# Names that moved to a submodule in 0.2: importable from here until 0.3, with a warning.
_MOVED = {
    **dict.fromkeys(["Plan", "Segment", "SequentialPlan", "plan_sequential"], plans),
    **dict.fromkeys(["ChainedOutputWarning", "MemoryStats", "Residual", "measure",
                     "print_saved_residuals", "saved_residuals"], debug),
}


def __getattr__(name: str) -> Any:
    """The names that moved to :mod:`tf_checkpointing.plans` and
    :mod:`tf_checkpointing.debug`, and ``peak_memory``, with a ``DeprecationWarning``
    that names their new place (PEP 562)."""
    if name == "peak_memory":
        advice = ("`tf_checkpointing.peak_memory(fn)` is deprecated and will be removed in "
                  "tf_checkpointing 0.3: use `tf_checkpointing.debug.measure(fn).peak_bytes`, "
                  "which returns the same number.")
        module = debug
    elif name in _MOVED:
        module = _MOVED[name]
        advice = (f"`tf_checkpointing.{name}` moved to `{module.__name__}.{name}`; import it "
                  f"from there (`from {module.__name__} import {name}`). The old place "
                  "will be removed in tf_checkpointing 0.3.")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # `from tf_checkpointing import name` asks twice: importlib's hasattr, then the
    # import itself; warn once, at the second.
    if sys._getframe(1).f_code.co_name != "_handle_fromlist":
        warnings.warn(advice, DeprecationWarning, stacklevel=2)
    return getattr(module, name)
