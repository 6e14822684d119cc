"""Keep what a save policy chooses in the forward; reuse it in the replay.

Forward (inside a graph): an op callback sees every op the checkpointed function
creates, in order, asks the policy about each floating output, and records the
kept tensors. Replay: the same callback position sees the replayed op and
returns the kept forward tensor (see ``_Substitute``) in place of its outputs. The
generated op wrappers (``gen_*_ops``) hand the callback's tensors, not the op's
own outputs, both to the code that follows and to the tape
(``record_gradient(op_type, op.inputs, attrs, outputs)``), and the tape computes
the gradient with the op's registered gradient function on a mock op made of
those inputs and outputs. So downstream ops read the kept value, gradients still
flow through the op to its inputs and the variables they read (a ``MatMul``'s
gradient needs only its inputs), and the replayed op itself has no consumer:
``tf.function`` prunes it and XLA drops it. Its work is gone from the backward.

Two refinements at the end of the forward (``_Record.finish``): results of
random draws alone (a dropout mask) are offered to the policy only where the
rest of the call reads them (``OpOutput.random``), so keeping a mask lets the
replay skip the draw; and a kept tensor read only by a ``Transpose`` or
``BiasAdd`` is kept after it instead (same bytes, one pass fewer in the replay).

Replayed ops are matched to recorded ones by position, op type and output
shapes; a mismatch (a function that builds another graph when replayed) stops
the substitution for the rest of that replay, which then recomputes: slower,
never wrong. Ops a replay makes that its forward has no counterpart of are
built under :func:`unmatched` and skipped: the value of a write a replay
keeps out of its variable (``_state.WritesKeptOut``: a BatchNormalization's
moving statistics), which the forward assigned with an op no policy sees.

Eager execution runs each op before any callback sees it and cannot take a
replacement value, so in eager mode nothing extra is kept and the replay
recomputes everything (the policy changes neither memory nor time there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_checkpointing import policies
from tf_checkpointing.core import _draws, _residuals
from tf_checkpointing.core._flags import checkpoint_scope, is_checkpointing
from tf_checkpointing.core._internals import control_flow_util, op_callbacks

__all__ = ["checkpoint_name"]

# Ops whose outputs must not be replaced (TensorFlow's op-callback limitation for
# functional control flow) or that are themselves calls of other graphs.
_NOT_REPLACEABLE = frozenset((
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "Placeholder", "Const",
))

# Ops after a kept tensor that need neither their input's value nor its shape in
# their gradient (see _Record._keep_after_layout_ops).
_PASS_OVER = frozenset(("Transpose", "BiasAdd"))

_pending = threading.local()
_unmatched = threading.local()


@contextlib.contextmanager
def unmatched() -> Iterator[None]:
    """Ops built inside are not matched by a replay's save policy: what a
    replay adds that its forward does not have (no forward runs inside)."""
    previous = getattr(_unmatched, "on", False)
    _unmatched.on = True
    try:
        yield
    finally:
        _unmatched.on = previous


def checkpoint_name(x: Any, name: str) -> Any:
    """Names a tensor inside a checkpointed function, so that a policy such as
    :func:`~tf_checkpointing.policies.save_only_these_names` can keep it.

    Outside a checkpointed call it returns ``x`` itself (no op is added).

    Args:
        x: a tensor (or any nest of tensors) computed inside the function.
        name: the name policies see (``OpOutput.name``).

    Returns:
        ``x`` (inside a checkpointed call: an identity of it carrying the name).

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing import checkpoint_name
        >>> x = tf.ones([2])
        >>> checkpoint_name(x, "q") is x
        True
    """
    if not isinstance(name, str):
        raise TypeError(
            "checkpoint_name: argument `name` must be a str; received "
            f"{name!r} of type {type(name).__name__}. Pass e.g. checkpoint_name(q, 'q_proj')."
        )
    if not is_checkpointing():
        return x
    previous = getattr(_pending, "name", None)
    _pending.name = name
    try:
        return tf.nest.map_structure(lambda t: _named(t, name), x)
    finally:
        _pending.name = previous


def _named(x: Any, name: str) -> Any:
    if not isinstance(x, tf.Tensor):
        return x
    y = tf.identity(x)
    if not tf.executing_eagerly():  # for saved_residuals' listing
        _residuals.checkpoint_names.setdefault(y.graph, {})[y.op.name] = name
    return y


def candidate_outputs(op_type: str, inputs: Any, outputs: Any, op_name: Optional[str],
                      graph: Any) -> Optional[list[policies.OpOutput]]:
    """The records a policy is asked about for one op, or None if the op can
    neither be kept nor replaced (control flow, variable access, no outputs)."""
    if not outputs or op_type in _NOT_REPLACEABLE:
        return None
    if any(getattr(t, "dtype", None) in (tf.resource, tf.variant) for t in inputs):
        return None
    name = getattr(_pending, "name", None) if op_type == "Identity" else None
    attrs = {}
    if op_type == "Einsum" and graph is not None and op_name is not None:
        attrs["equation"] = graph.get_operation_by_name(op_name).get_attr("equation")
    input_shapes = tuple(t.shape for t in inputs)
    return [
        policies.OpOutput(op_type, op_name, name, t.shape, t.dtype, input_shapes, i, attrs)
        for i, t in enumerate(outputs)
    ]


def keeps(policy: Callable[[policies.OpOutput], Any], record: policies.OpOutput) -> bool:
    """Asks the policy about one floating tensor, or one drawn at random (a
    dropout mask). Other integer and boolean results, such as shapes, are never
    kept: they are cheap to recompute."""
    if not (record.dtype.is_floating or record.dtype.is_complex or record.random):
        return False
    return bool(policy(record))


class Saver:
    """The kept tensors of one checkpointed call, used by its forward and replays.

    ``active()`` around the function body records on the first (forward) call
    and substitutes on the following (replay) calls.
    """

    def __init__(self, policy: Callable[[policies.OpOutput], Any]) -> None:
        self.policy = policy
        # Per candidate op, in creation order: (op type, output shapes, kept
        # outputs by index). Tensors of a graph: they cost nothing here, the
        # graph keeps the ones the backward reads.
        self.ops: list[tuple[str, tuple, dict[int, tf.Tensor]]] = []
        self.recorded = False

    @contextlib.contextmanager
    def active(self, inputs: Sequence[tf.Tensor] = ()) -> Iterator[None]:
        """Records in the forward, substitutes in a replay. ``inputs``: the
        call's tensor inputs; in a replay they depend on the incoming gradient,
        and so will the substituted values (see ``_Substitute``)."""
        if tf.executing_eagerly():
            yield  # eager: see the module docstring
            return
        callback = _Substitute(self, inputs) if self.recorded else _Record(self)
        self.recorded = True
        op_callbacks.add_op_callback(callback)
        try:
            yield
        finally:
            op_callbacks.remove_op_callback(callback)
        if isinstance(callback, _Record):
            callback.finish()

    @property
    def kept(self) -> list[tf.Tensor]:
        return [t for _, _, kept in self.ops for t in kept.values()]


class _Record:
    """Asks the policy about each op of the forward as it is created; about ops
    computed from random draws alone (the draws, ``uniform >= rate``) only at
    the end (``finish``), and only about their results that the rest of the
    call reads: a dropout mask, not the uniform numbers it was made from."""

    def __init__(self, saver: Saver) -> None:
        self.saver = saver
        self.graph = tf.compat.v1.get_default_graph()
        self.drawn_ops: set[str] = set()
        # (position in saver.ops, record, tensor) of each candidate drawn output
        self.drawn: list[tuple[int, policies.OpOutput, tf.Tensor]] = []
        self.positions: dict[str, int] = {}  # op name -> position in saver.ops

    def __call__(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not self.graph:
            return outputs
        drawn = op_name is not None and self._drawn(op_type, inputs)
        if drawn:
            self.drawn_ops.add(op_name)
        records = candidate_outputs(op_type, inputs, outputs, op_name, graph)
        if records is None:
            return outputs
        position, kept = len(self.saver.ops), {}
        self.positions[op_name] = position
        if drawn:
            self.drawn.extend((position, dataclasses.replace(r, random=True), outputs[r.index])
                              for r in records)
        else:
            kept = {r.index: outputs[r.index] for r in records if keeps(self.saver.policy, r)}
        self.saver.ops.append((op_type, tuple(tuple(t.shape) for t in outputs), kept))
        return outputs

    def _drawn(self, op_type: str, inputs: Sequence[tf.Tensor]) -> bool:
        return _draws.computed_from_draws(op_type, inputs, self.drawn_ops)

    def finish(self) -> None:
        for position, record, tensor in self.drawn:
            read_outside = any(op.name not in self.drawn_ops for op in tensor.consumers())
            if read_outside and keeps(self.saver.policy, record):
                self.saver.ops[position][2][record.index] = tensor
        for _, _, kept in list(self.saver.ops):
            for index, tensor in list(kept.items()):
                self._keep_after_layout_ops(kept, index, tensor)

    def _keep_after_layout_ops(self, kept: dict[int, tf.Tensor], index: int,
                               tensor: tf.Tensor) -> None:
        """A kept tensor whose only reader is a ``Transpose`` or ``BiasAdd`` is
        kept after it instead: the same bytes, and the replay skips that pass
        over it (whose gradient reads neither its input nor its output)."""
        readers = tensor.consumers()
        while (len(readers) == 1 and readers[0].type in _PASS_OVER
               and readers[0].inputs[0].name == tensor.name
               and readers[0].name in self.positions):
            del kept[index]
            kept = self.saver.ops[self.positions[readers[0].name]][2]
            index, tensor = 0, readers[0].outputs[0]
            kept[index] = tensor
            readers = tensor.consumers()


class _Substitute:
    """Replaces kept ops' outputs in a replay by the kept tensors, made to wait
    for the replay's inputs, which depend on the incoming gradient
    (``_ordering.fresh_copies``). Without that wait the ops downstream of a
    kept tensor would depend on forward tensors only, and the executor or XLA
    would run them during the forward and hold their results until the
    backward: more memory than no checkpointing at all.

    The wait costs no pass over the kept tensor where it can: in a graph run by
    TensorFlow's executor it is a control edge (``Identity`` with a control
    input; Grappler moves the edge to the consumers and drops the identity). XLA
    ignores control edges between pure ops, so there the kept tensor gets an
    opaque ``+ 0`` (``and True`` for a mask), which XLA fuses into its
    consumers: no extra pass either."""

    def __init__(self, saver: Saver, inputs: Sequence[tf.Tensor]) -> None:
        self.saver = saver
        self.graph = tf.compat.v1.get_default_graph()
        self.xla = control_flow_util.GraphOrParentsInXlaContext(self.graph)
        self.position = 0
        self.broken = False
        self.anchor = next((t for t in inputs if t.shape.num_elements() != 0), None)
        self.true: Optional[tf.Tensor] = None

    def _after_gradient(self, kept: tf.Tensor) -> tf.Tensor:
        if self.anchor is None:
            return tf.identity(kept)
        if not self.xla:
            with tf.control_dependencies([self.anchor]):
                return tf.identity(kept)
        if self.true is None:
            first = tf.reshape(self.anchor, [-1])[:1]
            as_bool = tf.cast(tf.reduce_max(tf.cast(first, tf.float32)), tf.bool)
            # Always true (a bool equals itself), but no optimizer can prove it.
            self.true = tf.equal(as_bool, as_bool)
        if kept.dtype == tf.bool:
            return tf.logical_and(kept, self.true)
        return kept + tf.cast(tf.where(self.true, 0.0, float("nan")), kept.dtype)

    def __call__(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if self.broken or graph is not self.graph or getattr(_unmatched, "on", False):
            return outputs
        if candidate_outputs(op_type, inputs, outputs, op_name, graph) is None:
            return outputs
        ops = self.saver.ops
        if self.position >= len(ops):
            self.broken = True
            return outputs
        recorded_type, shapes, kept = ops[self.position]
        self.position += 1
        if recorded_type != op_type or shapes != tuple(tuple(t.shape) for t in outputs):
            self.broken = True  # another graph than the forward's: recompute
            return outputs
        if not kept:
            return outputs
        replaced = [self._after_gradient(kept[i]) if i in kept else t
                    for i, t in enumerate(outputs)]
        names = _residuals.substitutions.setdefault(self.graph, set())
        names.update(replaced[i].op.name for i in kept)
        return replaced


def forward_kept_bytes(candidates: Sequence[Callable[[policies.OpOutput], Any]],
                       fn: Callable[..., Any], *args: Any) -> list[Optional[int]]:
    """Per policy of ``candidates``, the bytes of the tensors it keeps of
    ``fn(*args)`` checkpointed in a graph (None where a kept tensor's shape is
    not fully known).

    Only the forward is traced, once for all the policies, each asked as a
    checkpointed call's forward asks it: a fraction of the work of listing the
    kept bytes with :func:`~tf_checkpointing.debug.saved_residuals`, which traces the
    replay and the gradient too, per policy. What a policy keeps here is a
    superset of what that listing counts (a kept tensor no replay reads is
    pruned), so 0 means nothing kept, and the bytes are an upper bound.

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing import policies
        >>> from tf_checkpointing.core._save_policies import forward_kept_bytes
        >>> w = tf.Variable(tf.ones([3, 3]))
        >>> forward_kept_bytes([policies.dots_saveable, policies.reductions_saveable],
        ...                    lambda x: tf.nn.relu(x @ w), tf.ones([2, 3]))
        [24, 0]
    """
    leaves = tf.nest.flatten(args)
    positions = [i for i, leaf in enumerate(leaves) if _residuals.is_tensor(leaf)]
    savers = [Saver(policy) for policy in candidates]

    def forward(*tensors: tf.Tensor) -> list:
        full = list(leaves)
        for i, tensor in zip(positions, tensors):
            full[i] = tensor
        with checkpoint_scope(recomputing=False), contextlib.ExitStack() as stack:
            for saver in savers:  # each records beside the others: one trace for all
                stack.enter_context(saver.active())
            fn(*tf.nest.pack_sequence_as(args, full))
        return []

    specs = [tf.TensorSpec.from_tensor(tf.convert_to_tensor(leaves[i])) for i in positions]
    tf.function(forward, autograph=False).get_concrete_function(*specs)
    return [_bytes_of(saver.kept) for saver in savers]


def _bytes_of(tensors: Sequence[tf.Tensor]) -> Optional[int]:
    sizes = [t.shape.num_elements() for t in tensors]
    if any(size is None for size in sizes):
        return None
    return sum(size * t.dtype.size for size, t in zip(sizes, tensors))


NO_SAVER: Any = type("_NoSaver", (), {"active": staticmethod(contextlib.nullcontext)})()
