"""Max-pool gradients from window slices, for replays under XLA.

XLA computes a max pool's gradient (``MaxPoolGrad``: a ``select-and-scatter``)
on the CPU by first making one ``iota`` per dimension of the pool's input, each
as large as the input in ``s32`` (``SelectAndScatterExpander``). The iotas
depend on nothing, so XLA's scheduler makes them at the start of the step and
holds them until the backward reaches the pool: in a checkpointed step they
were the largest buffers that checkpointing could not free (12 MiB of the
benchmark U-Net's 34 MiB least plan, 68-85 MiB of ResNet50's). While a replay's
backward is built under XLA, each max-pool gradient is therefore computed here
instead, from slices of the pool's input and output that exist only once the
replay runs (:func:`max_pool_gradients_from_windows`; see
docs/decisions/0005-max-pool-gradients-under-xla.md).

The gradient goes, in every window, to the first element (in row-major window
order) equal to the window's maximum, the one TensorFlow's CPU kernel for 2-D
pools picks. Where a window holds several equal maxima, XLA's expansion picks
one of them in an order of its own, and TensorFlow's 3-D CPU kernel gives each
the whole gradient; where its maximum is unique, all agree.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf

from tf_checkpointing.core._internals import control_flow_util, op_callbacks

__all__ = ["max_pool_grad", "max_pool_gradients_from_windows"]

_GRADIENTS = frozenset({"MaxPoolGrad", "MaxPool3DGrad"})


def max_pool_grad(orig_input: tf.Tensor, orig_output: tf.Tensor, grad: tf.Tensor,
                  ksize: Sequence[int], strides: Sequence[int], padding: str,
                  data_format: str = "NHWC",
                  explicit_paddings: Sequence[int] = ()) -> tf.Tensor:
    """The gradient of ``orig_output = max_pool(orig_input)`` for the output
    gradient ``grad``, as ``tf.raw_ops.MaxPoolGrad`` (or ``MaxPool3DGrad``)
    computes it, from strided slices, comparisons and pads that XLA fuses into
    one loop: each window's gradient goes to its first element equal to the
    window's maximum. The spatial dimensions must be known.

        >>> import tensorflow as tf
        >>> from tf_checkpointing.core._pool_gradients import max_pool_grad
        >>> x = tf.constant([[1., 3.], [3., 2.]])[None, :, :, None]
        >>> y = tf.nn.max_pool2d(x, 2, 2, "VALID")
        >>> max_pool_grad(x, y, tf.ones_like(y), [1, 2, 2, 1], [1, 2, 2, 1], "VALID")[0, :, :, 0]
        <tf.Tensor: shape=(2, 2), dtype=float32, numpy=
        array([[0., 1.],
               [0., 0.]], dtype=float32)>
    """
    rank = orig_input.shape.rank
    spatial = list(range(1, rank - 1)) if data_format.endswith("C") else list(range(2, rank))
    sizes = [orig_input.shape[a] for a in spatial]
    windows = [ksize[a] for a in spatial]
    steps = [strides[a] for a in spatial]
    pads = _pads(sizes, windows, steps, padding, explicit_paddings, spatial)
    outs = [(n + lo + hi - k) // s + 1 for n, k, s, (lo, hi) in zip(sizes, windows, steps, pads)]
    padded = orig_input
    if any(lo or hi for lo, hi in pads):
        widths = [[0, 0] for _ in range(rank)]
        for a, lo_hi in zip(spatial, pads):
            widths[a] = list(lo_hi)
        padded = tf.pad(orig_input, widths)  # never picked: `valid` masks the padding
    zeros = tf.zeros_like(grad)
    seen = None
    total = None
    for offset in itertools.product(*[range(k) for k in windows]):
        window = padded[tuple(_window_slice(rank, spatial, offset, outs, steps))]
        hit = tf.equal(window, orig_output)
        valid = _inside(rank, spatial, offset, outs, steps, pads, sizes)
        if valid is not None:
            hit = tf.logical_and(hit, valid)
        chosen = hit if seen is None else tf.logical_and(hit, tf.logical_not(seen))
        seen = hit if seen is None else tf.logical_or(seen, hit)
        part = tf.where(chosen, grad, zeros)
        for a, i, n, o, s, (lo, _) in zip(spatial, offset, sizes, outs, steps, pads):
            part = _spread(part, a, s, o, low=i - lo, length=n)
        total = part if total is None else total + part
    return total


@contextlib.contextmanager
def max_pool_gradients_from_windows() -> Iterator[None]:
    """Under XLA, each max-pool gradient built inside the block is computed by
    :func:`max_pool_grad` instead of XLA's ``select-and-scatter`` (the
    ``MaxPoolGrad`` op is left unused, and pruned). In eager mode and in graphs
    XLA does not compile, nothing changes."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if graph is None or not control_flow_util.GraphOrParentsInXlaContext(graph):
        yield
        return

    def from_windows(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if (op_type not in _GRADIENTS or len(outputs) != 1 or outputs[0].op.type != op_type
                or not all(a.shape[1:].is_fully_defined() for a in inputs[:2])):
            return outputs  # not None: that would drop an earlier callback's replacement
        op = outputs[0].op
        fmt = op.get_attr("data_format").decode()
        explicit = op.get_attr("explicit_paddings") if op_type == "MaxPoolGrad" else ()
        return [max_pool_grad(*inputs, op.get_attr("ksize"), op.get_attr("strides"),
                              op.get_attr("padding").decode(), fmt, explicit)]

    op_callbacks.add_op_callback(from_windows)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(from_windows)


def _pads(sizes, windows, steps, padding, explicit, spatial) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dimension, as TensorFlow's pools pad."""
    if padding == "VALID":
        return [(0, 0)] * len(sizes)
    if padding == "EXPLICIT":
        return [(explicit[2 * a], explicit[2 * a + 1]) for a in spatial]
    pads = []
    for n, k, s in zip(sizes, windows, steps):
        total = max((-(-n // s) - 1) * s + k - n, 0)
        pads.append((total // 2, total - total // 2))
    return pads


def _window_slice(rank, spatial, offset, outs, steps) -> list[slice]:
    """The elements at ``offset`` in every window: a strided slice of the padded input."""
    index = [slice(None)] * rank
    for a, i, o, s in zip(spatial, offset, outs, steps):
        index[a] = slice(i, i + (o - 1) * s + 1, s)
    return index


def _inside(rank, spatial, offset, outs, steps, pads, sizes):
    """Which windows' elements at ``offset`` lie inside the input (a small constant
    of the output's spatial shape), or None where all do."""
    mask = np.ones([1] * rank, dtype=bool)
    for a, i, o, s, (lo, _), n in zip(spatial, offset, outs, steps, pads, sizes):
        at = np.arange(o) * s + i - lo
        shape = [1] * rank
        shape[a] = o
        mask = mask & ((at >= 0) & (at < n)).reshape(shape)
    return None if mask.all() else tf.constant(mask)


def _spread(part: tf.Tensor, axis: int, stride: int, count: int, low: int,
            length: int) -> tf.Tensor:
    """``part``'s ``count`` entries along ``axis`` moved to ``low + k * stride`` in a
    dimension of ``length`` (zeros between; entries outside it dropped)."""
    if stride > 1:
        part = tf.expand_dims(part, axis + 1)
        widths = [[0, 0] for _ in range(part.shape.rank)]
        widths[axis + 1] = [0, stride - 1]
        part = tf.pad(part, widths)
        shape = tf.shape(part)
        part = tf.reshape(part, tf.concat([shape[:axis], [count * stride], shape[axis + 2:]], 0))
    high = length - low - count * stride
    if low < 0 or high < 0:
        begin = [0] * part.shape.rank
        size = [-1] * part.shape.rank
        begin[axis] = max(-low, 0)
        size[axis] = count * stride - max(-low, 0) - max(-high, 0)
        part = tf.slice(part, begin, size)
    if low > 0 or high > 0:
        widths = [[0, 0] for _ in range(part.shape.rank)]
        widths[axis] = [max(low, 0), max(high, 0)]
        part = tf.pad(part, widths)
    return part
