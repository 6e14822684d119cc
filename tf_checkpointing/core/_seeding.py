"""``force_seed``: exact replay of TensorFlow's legacy stateful random ops.

``tf.random.uniform`` / ``tf.random.normal`` without a seed and ``tf.nn.dropout``
draw from a kernel's hidden state, which no variable exposes, so the replay
would draw new numbers. With ``force_seed`` the forward and its replay are made
to draw the same numbers, and each call still draws new ones:

* each legacy random op run inside the call is replaced by its stateless
  twin, seeded from one per-call seed (drawn in the forward, reused by the
  replay) folded with the op's index in the call;
* ``tf.function`` / XLA: the ops built while tracing are swapped by an op
  callback;
* eager: op callbacks cannot change an eager op's outputs, so the
  ``gen_random_ops`` functions that ``tf.random`` and ``tf.nn.dropout`` call
  are hooked once: while (and only while) the current thread runs a
  forced-seed call, they draw the stateless twin instead, and do not consume
  the user's global-seed sequence. Everything is per thread: two threads using
  ``force_seed`` at once never see each other's seeds (the process-wide global
  seed is never touched).

Keras random layers, ``keras.random`` with a ``SeedGenerator``,
``tf.random.Generator`` and stateless ops need none of this (see ``_state``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from tf_checkpointing.core._internals import (
    GLOBAL_SEED_GENERATOR,
    context,
    gen_random_ops,
    op_callbacks,
    random_seed,
)
from tf_checkpointing.core._internals import keras_global_state as global_state

__all__: list[str] = []

_MAX_SEED = 2**31 - 1
# Seeds for eager calls come from a private generator, re-seeded from the
# user's global seed whenever that changes, so runs with a global seed repeat.
_seed_source = random.Random()
_seed_source_origin: Optional[int] = None


def draw_call_seed() -> Any:
    """A fresh seed for one checkpointed call: an int32 tensor of shape [2]
    (inside a graph, drawn anew each time the graph runs)."""
    global _seed_source_origin
    if not tf.executing_eagerly():
        return tf.random.uniform([2], maxval=_MAX_SEED, dtype=tf.int32)
    user_seed = context.context()._seed  # noqa: SLF001 (TensorFlow has no public getter)
    if user_seed is not None and user_seed != _seed_source_origin:
        _seed_source.seed(user_seed)
        _seed_source_origin = user_seed
    return tf.constant([_seed_source.randrange(_MAX_SEED) for _ in range(2)], tf.int32)


@contextlib.contextmanager
def forced_seed(call_seed: tf.Tensor) -> Iterator[None]:
    """Makes legacy stateful random ops in the body draw from ``call_seed``."""
    rewriter = _StatelessRewriter(call_seed)
    if tf.executing_eagerly():
        _install_eager_hooks()
        saved, _local.rewriter = getattr(_local, "rewriter", None), rewriter
        # Registered once per thread: a nested forced call (a region inside a
        # region) would add the same callback again, which TensorFlow keeps once,
        # and its exit would remove it from under the outer call (a KeyError).
        outermost = getattr(_local, "refusing", 0) == 0
        if outermost:
            op_callbacks.add_op_callback(_refuse_random_ops_in_functions)
        _local.refusing = getattr(_local, "refusing", 0) + 1
        try:
            yield
        finally:
            _local.refusing -= 1
            if outermost:
                op_callbacks.remove_op_callback(_refuse_random_ops_in_functions)
            _local.rewriter = saved
        return
    op_callbacks.add_op_callback(rewriter)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(rewriter)


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Puts back the random state a plain step would draw from, after planning.

    Planning runs the layers (the profile, the measured plans), and an unseeded
    draw there would move the user's random sequence: Keras creates its global
    ``SeedGenerator`` at the first unseeded ``keras.random`` draw (seeding it
    from Python's ``random``) and advances it at each draw, and TensorFlow's
    unseeded ops take op seeds from the global seed's sequence. A plain model
    would not have made those draws, so with a plan made inside the first step,
    that step and every later one drew other numbers (ConvNeXt's
    ``StochasticDepth`` dropped other blocks). Python's and NumPy's generators,
    TensorFlow's op-seed sequence and this thread's Keras generator (made by
    planning: removed; there before: its state) are as they were afterwards.
    """
    python, numpy = random.getstate(), np.random.get_state()
    ops = getattr(context.context(), "_rng", None)  # set by tf.random.set_seed
    ops_state = ops.getstate() if ops is not None else None
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    with tf.init_scope():  # a step being traced: the value is read eagerly
        seed_state = generator.state.numpy() if generator is not None else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        current = getattr(context.context(), "_rng", None)
        if current is ops and current is not None:  # not re-seeded meanwhile
            current.setstate(ops_state)
        global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, generator)
        if generator is not None:
            with tf.init_scope():
                generator.state.assign(seed_state)


_local = threading.local()  # .rewriter: the eager forced-seed call this thread runs
_hooks_installed = threading.Lock()


def _active_rewriter() -> Optional[_StatelessRewriter]:
    rewriter = getattr(_local, "rewriter", None)
    return rewriter if rewriter is not None and tf.executing_eagerly() else None


def _install_eager_hooks() -> None:
    """Hooks the eager entry points of the legacy random ops, once per process.
    Outside a forced-seed call of the current thread they behave unchanged."""
    with _hooks_installed:
        if getattr(random_seed.get_seed, "_tf_checkpointing_hook", False):
            return
        for name, op_type in _GEN_FUNCTIONS.items():
            setattr(gen_random_ops, name, _hooked_random_op(getattr(gen_random_ops, name),
                                                            op_type))
        random_seed.get_seed = _hooked_get_seed(random_seed.get_seed)


def _refuse_random_ops_in_functions(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    """Eager op callback: a ``tf.function`` called from an eager forced-seed call
    runs its traced graph, whose legacy random ops keep their own kernel state
    (no hook reaches them): its replay would draw other numbers, so refuse."""
    if graph is None and _draws_legacy_random(op_type):
        raise ValueError(
            f"checkpointable: force_seed cannot replay the legacy random ops inside the "
            f"tf.function `{op_type}` that this eager checkpointed call runs: its traced "
            "graph draws from its own kernel state, so the replay would draw other "
            "numbers and the gradient would be wrong. Use stateless ops, "
            "tf.random.Generator or keras.random with a SeedGenerator inside it, or call "
            "the checkpointed function inside the tf.function (there force_seed rewrites "
            "each random op)."
        )
    return outputs


@functools.lru_cache(maxsize=1024)
def _draws_legacy_random(function_name: str) -> bool:
    """Whether the registered function (or one it calls) has a legacy random op."""
    ctx = context.context()
    if not ctx.has_function(function_name):
        return False
    for node in ctx.get_function_def(function_name).node_def:
        if node.op in _STATELESS_TWINS or _draws_legacy_random(node.op):
            return True
        for value in node.attr.values():  # functions called by name: bodies, branches
            names = [value.func.name] + [f.name for f in value.list.func]
            if any(name and _draws_legacy_random(name) for name in names):
                return True
    return False


def _hooked_random_op(original: Callable[..., Any], op_type: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def random_op(*args: Any, **kwargs: Any) -> Any:
        rewriter = _active_rewriter()
        if rewriter is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        if op_type == "RandomUniformInt":
            inputs = [bound["shape"], tf.convert_to_tensor(bound["minval"]), bound["maxval"]]
            dtype = inputs[1].dtype
        else:
            inputs, dtype = [bound["shape"]], tf.as_dtype(bound["dtype"])
        return rewriter.draw(op_type, inputs, dtype)

    return random_op


def _hooked_get_seed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_seed(op_seed: Any) -> Any:
        if _active_rewriter() is None:
            return original(op_seed)
        return None, None  # the draw is replaced: leave the user's seed sequence alone

    get_seed._tf_checkpointing_hook = True  # type: ignore[attr-defined]
    return get_seed


class _StatelessRewriter:
    """Op callback that swaps each legacy random op's output for a stateless
    draw seeded by (call seed, index of the op in the call)."""

    def __init__(self, call_seed: tf.Tensor) -> None:
        self._call_seed = call_seed
        self._count = 0

    def __call__(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if op_type not in _STATELESS_TWINS or graph is None or outputs is None:
            return outputs  # unchanged (see _state.StateRecorder._on_op)
        return [self.draw(op_type, inputs, outputs[0].dtype)]

    def draw(self, op_type: str, inputs: list[Any], dtype: tf.DType) -> tf.Tensor:
        """The stateless twin of the call's next legacy random op."""
        seed = tf.random.experimental.stateless_fold_in(self._call_seed, self._count)
        self._count += 1
        return _STATELESS_TWINS[op_type](inputs, dtype, seed)


_STATELESS_TWINS = {
    "RandomUniform": lambda i, dtype, seed: tf.random.stateless_uniform(i[0], seed, dtype=dtype),
    "RandomStandardNormal": lambda i, dtype, seed: tf.random.stateless_normal(
        i[0], seed, dtype=dtype
    ),
    "TruncatedNormal": lambda i, dtype, seed: tf.random.stateless_truncated_normal(
        i[0], seed, dtype=dtype
    ),
    "RandomUniformInt": lambda i, dtype, seed: tf.random.stateless_uniform(
        i[0], seed, minval=i[1], maxval=i[2], dtype=dtype
    ),
}

_GEN_FUNCTIONS = {
    "random_uniform": "RandomUniform",
    "random_standard_normal": "RandomStandardNormal",
    "truncated_normal": "TruncatedNormal",
    "random_uniform_int": "RandomUniformInt",
}


# Legacy stateful random ops: each op instance keeps its own kernel state, so a
# replay (new op instances) draws other numbers unless force_seed rewrites them.
_LEGACY_RANDOM_OPS = frozenset(_STATELESS_TWINS) | {
    "RandomShuffle", "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "ParameterizedTruncatedNormal",
}


@contextlib.contextmanager
def legacy_draws_noticed(name: str) -> Iterator[None]:
    """While the forward of checkpointed call ``name`` (without ``force_seed``)
    runs or is traced: warns (once per forward) if it runs a legacy stateful
    random op, whose replay would draw other numbers and so give wrong gradients."""
    warned: list[bool] = []

    def notice(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if op_type in _LEGACY_RANDOM_OPS and not warned:
            warned.append(True)
            warnings.warn(
                f"checkpointable: `{name}` runs the legacy random op {op_type} (tf.nn.dropout, "
                "tf.random.uniform and the like without a generator). Its replay in backprop "
                "draws other numbers than the forward did, so the gradients would be wrong. "
                "Fix: checkpointable(..., force_seed=True), or apply_checkpointing(model, ..., "
                "force_seed=True), which replays them exactly; or draw with keras.random and "
                "a keras.random.SeedGenerator, or a tf.random.Generator.",
                UserWarning, stacklevel=2)
        return outputs

    op_callbacks.add_op_callback(notice)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(notice)
