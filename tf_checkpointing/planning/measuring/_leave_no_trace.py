"""Planning leaves no trace: every piece of state it could touch is put back.

Planning measures a model or chain by running it: profiles, timed steps, XLA
steps of candidate plans. Those runs update BatchNorm statistics, Keras
metrics, seed generators and ``tf.random.Generator`` states, advance the
global random sequences, and set the ``training`` flag of the Keras call
context they run in. A plain model would have done none of that, so after
planning, :func:`nothing_left` puts back:

* every variable alive in the process whose value planning changed. Not only
  the model's: a layer may draw from a module-level generator or count in a
  closed-over ``tf.Variable`` that no tracking reaches, and planning's traced
  steps advance those too. A variable planning did not change is not written,
  so nothing another thread does to it is undone;
* the random sequences a plain step draws from (see
  ``core._seeding.random_state_kept``), and no global generator where there
  was none;
* Keras' call context: planning runs outside the caller's, so a profile's
  ``training=True`` does not become the flag of the user's own call.

It also leaves the device's memory pool as it found it, so that the steps after
planning are cut from the pool as in a process that never planned (see
docs/design.md#planning-leaves-the-pool-as-it-found-it). Two things planning
made would otherwise outlive it, at addresses above the ones its measurements
used, and split the free pool there (the BFC allocator then hands an XLA
step's buffer a whole free chunk up to twice its size):

* the graphs it traced with a ``tf.custom_gradient`` (every checkpointed
  call): TensorFlow registers each one's gradient function globally and never
  drops it, and the function holds its graph, whose constants (evaluated when
  the graph was built) stay allocated. The registrations planning made for its
  own graphs are dropped;
* the buffers of variables it wrote (BatchNorm statistics, seed states): a
  write adopts a new buffer, allocated among the measurements' tensors. Every
  variable but the trainable ones (which planning updates in place, and whose
  update would then copy them) keeps its buffer from before planning held, and
  gets that buffer back.

Example:
    >>> import keras, tensorflow as tf
    >>> from tf_checkpointing.planning.measuring._leave_no_trace import nothing_left
    >>> layer = keras.layers.BatchNormalization()
    >>> _ = layer(tf.ones([2, 3]))
    >>> counter = tf.Variable(0)  # tracked by nothing
    >>> with nothing_left():
    ...     _ = layer(tf.random.normal([2, 3]), training=True)  # moves the statistics
    ...     _ = counter.assign_add(1)
    >>> float(tf.reduce_sum(layer.moving_mean)), int(counter.numpy())
    (0.0, 0)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_checkpointing.core import _keras_context
from tf_checkpointing.core._internals import (
    gen_resource_variable_ops,
    resource_variable_ops,
    stateful_random_ops,
    tf_ops,
)
from tf_checkpointing.core._seeding import random_state_kept

__all__ = ["nothing_left", "live_variables", "planning_thread"]

# The outermost graph of each thread planning runs in (see planning_thread): the
# graphs traced there are planning's own.
_planning_roots: weakref.WeakSet[Any] = weakref.WeakSet()


@contextlib.contextmanager
def nothing_left() -> Iterator[None]:
    """Runs the block outside the caller's Keras call context, then drops the
    custom gradients of the graphs it traced, gives each non-trainable variable
    its buffer from before, and puts back every variable whose value it changed,
    the random sequences, and the global generator's absence."""
    had_generator = stateful_random_ops.global_generator is not None
    registered = set(_custom_gradients())
    building = _graphs_being_built()
    # Outside the caller's Keras call: its autocast scope (mixed precision) reads
    # a float32 variable as float16, which would be put back rounded.
    with tf.init_scope(), _keras_context.outside():  # a step being traced: read eagerly
        saved = [(variable, value) for variable in live_variables()
                 if (value := _value(variable)) is not None]
        # Each variable's buffer, held: a write then adopts (or copies to) another
        # one and leaves this one as it was, to be put back. Not the trainable
        # ones: planning's steps update those in place, which a held buffer would
        # turn into a copy of every weight.
        buffers = [(variable, _buffer(variable)) for variable, _ in saved
                   if not getattr(variable, "trainable", True)]
    try:
        with random_state_kept(), _keras_context.outside():
            yield
    finally:
        # First what planning's graphs hold, so that the buffers put back below
        # are the only ones left where planning measured.
        _forget_custom_gradients(registered, building)
        with tf.init_scope(), _keras_context.outside():
            _give_back(buffers)
            for variable, value in saved:
                now = _value(variable)
                if now is not None and not _same(now, value):
                    variable.assign(value)
            if not had_generator:  # planning made one: a plain step would not have
                stateful_random_ops.global_generator = None


def planning_thread() -> None:
    """Notes that the calling thread runs planning: the graphs it traces are
    planning's own (:func:`nothing_left` drops their custom gradients). Called
    by each thread planning starts (``_allocator.in_fresh_thread``)."""
    with tf.init_scope():
        _planning_roots.add(tf.compat.v1.get_default_graph())


def _custom_gradients() -> dict[str, Any]:
    """TensorFlow's registrations of ``tf.custom_gradient`` functions of graphs,
    by name (``CustomGradient-<uid>``)."""
    registry = tf_ops._gradient_registry._registry  # noqa: SLF001 - no public listing
    return {name: entry for name, entry in registry.items()
            if name.startswith("CustomGradient-")}


def _graphs_being_built() -> list[Any]:
    """The graphs the caller is building now (a step being traced and the
    graphs around it): their custom gradients are the caller's."""
    graphs = []
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and graph not in graphs:
        graphs.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return graphs


def _forget_custom_gradients(registered: set[str], building: list[Any]) -> None:
    """Drops the custom gradients registered since ``registered`` was read for
    graphs planning traced (in a planning thread, or in the caller's thread but
    not among the graphs it was ``building``), then frees those graphs.

    ``tf.custom_gradient`` in a graph registers its gradient function under a
    new name, for ``tf.gradients`` to find, and never drops it; the function
    holds the graph, and the graph the constants it evaluated while being built
    (small tensors in the device's pool). A graph planning traced is never
    differentiated again, so its registrations are dead weight that would stay
    in the pool above planning's measurements. Another thread's graphs, and the
    caller's own, keep theirs."""
    own_root = _root(building[-1]) if building else None
    registry = tf_ops._gradient_registry._registry  # noqa: SLF001
    dropped = 0
    for name, entry in _custom_gradients().items():
        if name in registered:
            continue
        graph = _graph_of(entry.get("type"))
        if graph is None or any(graph is g for g in building):
            continue
        root = _root(graph)
        if root in _planning_roots or (own_root is not None and root is own_root):
            registry.pop(name, None)
            dropped += 1
    if dropped:
        gc.collect()  # the graphs are in reference cycles


def _root(graph: Any) -> Any:
    while getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    return graph


def _graph_of(function: Any, depth: int = 2) -> Optional[Any]:
    """The graph whose tensors a registered gradient function closes over (the
    outputs of the call ``tf.custom_gradient`` wrapped, which its inner
    ``tape_grad_fn`` holds), or None."""
    contents = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for content in contents:  # the tensors this function holds itself first
        if callable(content):
            continue
        try:
            leaves = tf.nest.flatten(content)
        except (TypeError, ValueError):
            continue
        for leaf in leaves:
            if isinstance(leaf, tf.Tensor) and tf.is_symbolic_tensor(leaf):
                return leaf.graph
    for content in contents:  # then those of the functions it calls
        if callable(content) and depth > 0:
            graph = _graph_of(content, depth - 1)
            if graph is not None:
                return graph
    return None


def _give_back(buffers: list[tuple[Any, Optional[tf.Tensor]]]) -> None:
    """Gives each variable its held buffer back if it left it, then lets go of
    them all: the variables' buffers are theirs alone again (a write to a buffer
    still held would copy it)."""
    for variable, buffer in buffers:
        if buffer is not None and _moved(variable, buffer):
            _adopt(variable, buffer)
    buffers.clear()


def _buffer(variable: Any) -> Optional[tf.Tensor]:
    """The variable's value as a tensor sharing its buffer (a read), or None."""
    try:
        return gen_resource_variable_ops.read_variable_op(variable.handle, variable.dtype)
    except (tf.errors.OpError, TypeError, ValueError):
        return None


def _moved(variable: Any, buffer: tf.Tensor) -> bool:
    """Whether ``variable`` is no longer in ``buffer`` (its value's storage)."""
    now = _buffer(variable)
    if now is None:
        return False
    before, after = _address(buffer), _address(now)
    return before is not None and after is not None and before != after


def _adopt(variable: Any, buffer: tf.Tensor) -> None:
    """Gives ``variable`` ``buffer`` back: an assignment adopts its value's
    buffer (variables are copied on write), so the variable is where it was."""
    try:
        gen_resource_variable_ops.assign_variable_op(variable.handle, buffer)
    except (tf.errors.OpError, TypeError, ValueError):
        pass  # deleted meanwhile: nothing to put back


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _address(tensor: tf.Tensor) -> Optional[int]:
    """Where ``tensor``'s data is (read through DLPack, whose tensor starts with
    the data pointer), or None where DLPack cannot export it (strings, some devices)."""
    try:
        capsule = tf.experimental.dlpack.to_dlpack(tensor)
        pointer = _capsule_pointer(capsule, b"dltensor")
    except Exception:  # noqa: BLE001 - any export failure: unknown
        return None
    if not pointer:
        return None
    return ctypes.cast(pointer, ctypes.POINTER(ctypes.c_void_p))[0]


def live_variables() -> list[Any]:
    """Every resource variable alive in the process: the storage under Keras
    variables, mirrored variables' components, generators' states."""
    return [obj for obj in gc.get_objects() if _is_variable(type(obj))]


@functools.cache
def _is_variable(kind: type) -> bool:
    # Cached per type: the heap holds ~10^5 objects of a few thousand types.
    return issubclass(kind, resource_variable_ops.BaseResourceVariable)


def _value(variable: Any) -> np.ndarray | None:
    """A copy of the variable's value, or None for one planning cannot have read:
    made inside a traced function, not yet initialized, or already deleted."""
    if tf.is_symbolic_tensor(variable.handle):
        return None
    try:
        if not variable.is_initialized():  # reads as an empty array, not its shape
            return None
        # A copy (np.array): a view of the buffer would make the variable's next
        # update copy it, in the pool the profile measures.
        return np.array(variable.numpy())
    except (tf.errors.FailedPreconditionError, tf.errors.NotFoundError,
            tf.errors.InvalidArgumentError):
        return None


def _same(now: np.ndarray, before: np.ndarray) -> bool:
    """Bit for bit, so that -0.0 against 0.0 and NaN payloads count as changes."""
    if now.shape != before.shape or now.dtype != before.dtype:
        return False
    if before.dtype == object:  # string variables
        return bool(np.array_equal(now, before))
    return now.tobytes() == before.tobytes()
