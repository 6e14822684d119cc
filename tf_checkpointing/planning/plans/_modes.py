"""The kinds of training step a plan is made for, by one name each.

What backprop keeps depends on how the step runs: an eager step keeps what the
tape recorded, a ``tf.function`` graph (``Model.fit``) frees what its executor
can prove unused, and XLA (``jit_compile=True``) assigns one buffer of its own.
The names are the same in the API, the plans, the docs, the tests and the
benchmarks: ``"eager"``, ``"graph"`` and ``"xla"``; ``"auto"`` picks the step
being traced.
"""

from __future__ import annotations

import tensorflow as tf

from tf_checkpointing.planning.measuring._allocator import in_xla_context

__all__ = ["AUTO", "MODES", "expect_mode", "step_mode"]

MODES = ("eager", "graph", "xla")
AUTO = "auto"


def expect_mode(mode: object, api: str) -> str:
    """``mode=`` validated (``"auto"`` or one of :data:`MODES`), naming ``api``."""
    if mode == AUTO or mode in MODES:
        return str(mode)
    choices = ", ".join(map(repr, (AUTO, *MODES)))
    raise ValueError(
        f"{api}: argument `mode` must be one of {choices}; received mode={mode!r}. "
        "Pass mode='graph' for a tf.function or Model.fit step, mode='xla' for "
        "jit_compile=True, mode='eager' for an eager step."
    )


def step_mode(mode: str) -> str:
    """``"auto"`` resolved: ``"xla"`` while a ``jit_compile=True`` function is
    traced, ``"graph"`` while another ``tf.function`` is, else ``"eager"``."""
    if mode != AUTO:
        return mode
    if not tf.inside_function():
        return "eager"
    return "xla" if in_xla_context() else "graph"
