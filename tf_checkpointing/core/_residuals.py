"""What backprop keeps: the tensors a gradient reads from its forward pass.

JAX has ``print_saved_residuals``; TensorFlow has nothing to show what a
``GradientTape`` holds between the forward and the backward pass, which is what
checkpointing and save policies change. This module traces ``fn`` and its
gradient as one ``tf.function`` graph, splits the graph's ops into the forward
(created before ``tape.gradient``) and the backward (created by it), and lists
every forward tensor that a backward op which actually runs (the function's
pruning keeps only the ancestors of its outputs) reads: those are alive from the
forward until the backward reads them.

The listing is the ``tf.function`` / XLA view: what a graph keeps. (In eager
mode the tape keeps about the same tensors without checkpointing; a
checkpointed call keeps only its inputs there, whatever its save policy.)
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from tf_checkpointing.core._flags import checkpoint_scopes_entered
from tf_checkpointing.core._memory import _memory_info, default_memory_device

__all__ = ["Residual", "print_saved_residuals", "saved_residuals"]

# Per graph: names of the ops made by checkpoint_name, and of the identities a
# replay put in place of a kept op (see _save_policies).
checkpoint_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
substitutions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor kept from the forward pass for the backward pass.

    Attributes:
        producer: ``"<op type> <op name>"``, ``"checkpoint_name <name>"``,
            ``"argument <i>"`` or ``"variable <name>"``.
        shape: static shape (``None`` entries where unknown).
        dtype: the dtype's name.
        bytes: size in bytes (0 if the shape is not fully known).
        why: what keeps it: the backward ops that read it, named by the forward
            op whose gradient they compute and their kernels (``"read by the
            gradient of matmul (MatMul)"``), or ``"read by the replay of a
            checkpointed call"`` (which starts from its inputs), or ``"kept by the
            save policy"`` when a replay reuses it instead of recomputing it.
        kind: ``"activation"`` (allocated by the forward: counted in the
            total), ``"argument"`` or ``"variable"`` (allocated before the call).

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing.debug import saved_residuals
        >>> w = tf.Variable(tf.ones([4, 4]))
        >>> kept = saved_residuals(lambda x: tf.nn.relu(x @ w), tf.ones([2, 4]))
        >>> [(r.kind, r.producer, r.bytes) for r in kept if r.kind == "activation"]
        [('activation', 'Relu Relu', 32)]
    """

    producer: str
    shape: tuple
    dtype: str
    bytes: int
    why: str
    kind: str


def saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Lists what the gradient of ``fn(*args, **kwargs)`` keeps from its forward.

    The gradient is taken of every floating output with respect to the floating
    tensor arguments and the variables ``fn`` reads, in a ``tf.function`` graph.

    Args:
        fn: any function of tensors (a checkpointed one, a Keras layer or model).
        *args: its positional arguments (tensors become the graph's inputs).
        **kwargs: its keyword arguments (tensors among them too).

    Returns:
        One :class:`Residual` per kept tensor, in the order the forward made them.

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing.debug import saved_residuals
        >>> w = tf.Variable(tf.ones([4, 4]))
        >>> kept = saved_residuals(lambda x: tf.nn.gelu(x @ w), tf.ones([2, 4]))
        >>> sum(r.bytes for r in kept if r.kind == "activation")  # gelu reads 3 of [2, 4]
        96
    """
    leaves = tf.nest.flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if is_tensor(leaf)]
    boundary: dict[str, Any] = {}

    def traced(*tensors: tf.Tensor) -> Any:
        full = list(leaves)
        for i, tensor in zip(positions, tensors):
            full[i] = tensor
        call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), full)
        sources = [t for t in tensors if t.dtype.is_floating or t.dtype.is_complex]
        with tf.GradientTape() as tape:
            tape.watch(sources)
            out = fn(*call_args, **call_kwargs)
        targets = [t for t in tf.nest.flatten(out) if _is_float_tensor(t)]
        boundary["ops"] = len(tf.compat.v1.get_default_graph().get_operations())
        seeds = [tf.ones(tf.shape(t), t.dtype) for t in targets]
        boundary["seeds"] = [seed.op for seed in seeds]
        boundary["variables"] = {id(v.handle): v.name for v in tape.watched_variables()}
        entered = checkpoint_scopes_entered()
        grads = tape.gradient(targets, sources + list(tape.watched_variables()),
                              output_gradients=seeds)
        boundary["replayed"] = checkpoint_scopes_entered() > entered
        return [g for g in grads if g is not None]

    specs = [tf.TensorSpec.from_tensor(tf.convert_to_tensor(leaves[i])) for i in positions]
    graph = tf.function(traced, autograph=False).get_concrete_function(*specs).graph
    names = {internal.op.name: boundary["variables"][id(external)]
             for external, internal in graph.captures if id(external) in boundary["variables"]}
    return _residuals(graph, boundary["ops"], boundary["seeds"], len(positions), names,
                      boundary["replayed"])


def print_saved_residuals(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Prints :func:`saved_residuals` as a table with totals.

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing.debug import print_saved_residuals
        >>> print_saved_residuals(lambda x: tf.sin(x), tf.ones([4]))  # doctest: +ELLIPSIS
        producer ...
    """
    print(format_residuals(saved_residuals(fn, *args, **kwargs)))


def format_residuals(residuals: Sequence[Residual]) -> str:
    """The table :func:`print_saved_residuals` prints."""
    rows = [("producer", "shape", "dtype", "bytes", "kind", "why kept")]
    rows += [(r.producer, str(list(r.shape)), r.dtype, f"{r.bytes:,}", r.kind, r.why)
             for r in residuals]
    widths = [max(len(row[k]) for row in rows) for k in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5]
             for row in rows]
    activations = sum(r.bytes for r in residuals if r.kind == "activation")
    total = sum(r.bytes for r in residuals)
    lines.append(f"total: {activations:,} bytes of activations kept by the forward "
                 f"({_mib(activations)}), {total:,} bytes with arguments and variables")
    return "\n".join(lines)


def _residuals(graph: tf.Graph, boundary: int, seeds: list[tf.Operation],
               num_arguments: int, variable_names: dict[str, str],
               replayed: bool = False) -> list[Residual]:
    """Tensors made before the backward starts and read after. A backward op
    that does not depend on the incoming gradient (a transpose or shape of a
    forward tensor) can run during the forward, so it counts as forward."""
    ops = graph.get_operations()
    executed = _executed(graph)
    backward = _descendants(seeds)
    forward = {op: k for k, op in enumerate(ops) if op in executed and op not in backward}
    readers: dict[tf.Tensor, list[tf.Operation]] = {}
    for op in ops[boundary:]:
        if op not in executed or op not in backward:
            continue
        for tensor in op.inputs:
            if tensor.op in forward and tensor.op.type != "Const":
                readers.setdefault(tensor.ref(), []).append(op)
    inputs = list(graph.inputs)
    by_buffer: dict[Any, list[tf.Operation]] = {}
    labels: dict[Any, str] = {}  # buffer -> checkpoint_name of a view of it
    named = checkpoint_names.get(graph, {})
    variable_reads: dict[str, Any] = {}  # handle -> the first read of it listed
    for ref, ops_reading in readers.items():
        if ref.deref().dtype == tf.resource:
            continue  # a variable's handle is not its data
        chain = _views(ref.deref())
        owner = chain[-1]
        if owner.op.type == "ReadVariableOp":  # a replay reads the variable again
            owner = variable_reads.setdefault(owner.op.inputs[0].op.name, owner)
        by_buffer.setdefault(owner.ref(), []).extend(ops_reading)
        for view in chain:
            if view.op.name in named:
                labels[owner.ref()] = named[view.op.name]
    order = sorted(by_buffer, key=lambda r: (forward.get(r.deref().op, -1),
                                             r.deref().value_index))
    return [_record(graph, ref.deref(), by_buffer[ref], inputs, num_arguments, variable_names,
                    labels.get(ref), replayed) for ref in order]


# Ops whose output shares its input's buffer: counting both would count it twice.
_ALIASES = frozenset(("Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze",
                      "StopGradient", "Snapshot", "PreventGradient"))


def _views(tensor: tf.Tensor) -> list[tf.Tensor]:
    """``tensor`` and the tensors it is a view of, the last one owning the memory."""
    chain = [tensor]
    while tensor.op.type in _ALIASES and tensor.op.inputs:
        index = tensor.value_index if tensor.op.type == "IdentityN" else 0
        tensor = tensor.op.inputs[index]
        chain.append(tensor)
    return chain


def _descendants(roots: list[tf.Operation]) -> set[tf.Operation]:
    seen: set[tf.Operation] = set()
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(c for t in op.outputs for c in t.consumers())
            stack.extend(op._control_outputs)  # noqa: SLF001 (no public accessor)
    return seen


def _record(graph, tensor, readers, inputs, num_arguments, variable_names,
            label, replayed) -> Residual:
    op = tensor.op
    kind = "activation"
    # By identity: `in` and `index` would compare tensors with ==, an op of the graph.
    position = next((i for i, t in enumerate(inputs) if t is tensor), None)
    if op.type == "Placeholder" and position is not None and position < num_arguments:
        producer, kind = f"argument {position}", "argument"
    elif op.type == "ReadVariableOp":
        handle = op.inputs[0].op.name
        producer, kind = f"variable {variable_names.get(handle, handle)}", "variable"
    elif label is not None:
        producer = f"checkpoint_name {label}"
    else:
        producer = f"{op.type} {op.name}"
    substituted = substitutions.get(graph, set())
    if all(reader.name in substituted for reader in readers):
        why = "kept by the save policy"
    else:
        why = _why(readers, replayed)
    shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else ()
    size = int(np.prod(shape)) * tensor.dtype.size if tensor.shape.is_fully_defined() else 0
    return Residual(producer, shape, tensor.dtype.name, size, why, kind)


# A gradient op's name: "gradient_tape/<scope of the forward op>/<op>", the scope
# being the forward op's own name for most ops (``matmul``, ``Gelu/mul_2``) or the
# layer's (``embedding``); none for an op made outside any scope (``tf.nn.relu``,
# whose gradient kernel, ``ReluGrad``, names it).
_GRADIENT_OP = re.compile(r"(?:^|/)gradient_tape(?:_\d+)?/(?:(.+)/)?[^/]+$")


def _why(readers: Sequence[tf.Operation], replayed: bool) -> str:
    """Which backward computation reads a kept tensor, in words: the gradient of
    which forward op (the scope its gradient ops are made in, which is the forward
    op's name for most ops, then the backward kernels), or the replay of a
    checkpointed call, not the kernels a replay starts with: its own data edges
    (a zero added to each input, one element gathered from each variable it
    reads: see _ordering) would read as "read by AddV2" or "GatherV2"."""
    gradients: dict[str, set[str]] = {}
    other = False
    for reader in readers:
        match = _GRADIENT_OP.search(reader.name)
        if match:
            # Outside any scope, a "<Op>Grad" kernel still names its forward op's type.
            forward = match.group(1) or (reader.type[:-4] if reader.type.endswith("Grad")
                                         else "")
            gradients.setdefault(forward, set()).add(reader.type)
        else:
            other = True
    parts = []
    if gradients:
        shown = [f"{forward} ({', '.join(sorted(types))})".lstrip()
                 for forward, types in list(gradients.items())[:3]]
        more = ", ..." if len(gradients) > 3 else ""
        noun = "gradient" if len(gradients) == 1 else "gradients"
        of = " of" if any(gradients) else ""
        parts.append(f"the {noun}{of} {', '.join(shown)}{more}")
    if other:
        parts.append("the replay of a checkpointed call" if replayed else "a custom gradient")
    return "read by " + " and by ".join(parts)


def _executed(graph: tf.Graph) -> set[tf.Operation]:
    """The ops a tf.function runs: ancestors of its outputs and control outputs."""
    seen: set[tf.Operation] = set()
    stack = [t.op for t in graph.outputs] + list(graph.control_outputs)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


def is_tensor(leaf: Any) -> bool:
    return isinstance(leaf, (tf.Tensor, np.ndarray)) and not isinstance(leaf, tf.Variable)


def _is_float_tensor(leaf: Any) -> bool:
    return isinstance(leaf, tf.Tensor) and (leaf.dtype.is_floating or leaf.dtype.is_complex)


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def held_bytes(fn: Callable[..., Any], *args: Any, device: Optional[str] = None,
               steps: int = 3) -> int:
    """Measures, with the allocator, the bytes held between the forward and the
    backward of ``fn(*args)`` in a ``tf.function``: an op between the two passes
    (every backward op waits for it through the incoming gradient) reads the
    allocator's current bytes, minus the bytes in use before the step; the least
    of ``steps`` steps. Needs ``TF_CPU_ALLOCATOR_USE_BFC=true`` on CPU (see
    ``tf_checkpointing.debug.measure``).

    The least: forward ops that the reading does not wait for may still be
    running, with their temporaries, when it is taken, more so on a loaded
    machine (see docs/decisions/0029-held-bytes.md)."""

    device = device or default_memory_device()
    readings: list[int] = []

    def read(_: Any) -> np.float32:
        readings.append(_memory_info(device)["current"])
        return np.float32(0)

    @tf.function(autograph=False)
    def step(*tensors: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(list(tensors))
            out = fn(*tensors)
        targets = [t for t in tf.nest.flatten(out) if _is_float_tensor(t)]
        done = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in targets])
        zero = tf.py_function(read, [done], tf.float32)
        seeds = [tf.ones(t.shape, t.dtype) + tf.cast(zero, t.dtype) for t in targets]
        grads = tape.gradient(targets, list(tensors) + list(tape.watched_variables()),
                              output_gradients=seeds)
        return [g for g in grads if g is not None]

    tensors = [tf.convert_to_tensor(a) for a in args]
    step.get_concrete_function(*tensors)
    step(*tensors)  # warm up: kernels, constants, Grappler's rewrite
    held = []
    for _ in range(max(1, steps)):
        before = _memory_info(device)["current"]
        step(*tensors)
        held.append(readings[-1] - before)
    return min(held)
