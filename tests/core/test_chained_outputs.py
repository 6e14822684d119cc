"""A block that returns ``h`` and ``y = f(h)``: gradients with respect to its
inputs and variables are exact; a gradient with respect to ``h`` itself cannot
be, so it is detected: an error in the check mode, a warning (once per
function) otherwise (issue 10, case 6)."""

import warnings

import keras
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close

from tf_checkpointing import checkpointable
from tf_checkpointing.core import _structure


def block(x, w):
    h = tf.sin(x * w)
    return h, h * h * 3.0


def _step(fn, mode, source):
    w = tf.Variable(1.5, name="w")

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            h, y = fn(x, w)
            loss = tf.reduce_sum(h + y)
        return loss, tape.gradient(loss, [x, w] if source == "inputs" else [h])

    return compile_step(step, mode)


def test_gradients_for_inputs_and_variables_are_exact(mode):
    x = tf.constant([0.3, 1.2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = _step(checkpointable(block, checkpoint=True), mode, "inputs")(x)
    assert_all_close(ours, _step(block, mode, "inputs")(x))


def test_the_check_mode_refuses_an_output_that_feeds_another(mode):
    wrapped = checkpointable(block, checkpoint=True, check=True)
    with pytest.raises(ValueError, match=r"output\(s\) \[0\].*tape\.gradient\(loss, output\).*"
                                         r"split the block into two checkpointed calls"):
        _step(wrapped, mode, "output")(tf.constant([0.3, 1.2]))


def test_a_warning_once_per_function(mode):
    _structure._warned_chained.discard("block")
    wrapped = checkpointable(block, checkpoint=True)
    with pytest.warns(UserWarning, match="would miss the path through the outputs"):
        _step(wrapped, mode, "output")(tf.constant([0.3, 1.2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(wrapped, mode, "output")(tf.constant([0.3, 1.2]))  # run again, no warning


def test_independent_outputs_are_not_flagged(mode):
    def two_heads(x, w):
        h = tf.sin(x * w)
        return tf.cos(h), h * 2.0  # h itself is not returned

    x = tf.constant([0.3, 1.2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = _step(checkpointable(two_heads, checkpoint=True, check=True), mode, "inputs")(x)
    assert_all_close(ours, _step(two_heads, mode, "inputs")(x))


def test_an_output_feeding_only_integer_ops_is_not_flagged(mode):
    """``h`` feeds the other output only through ``argmax`` (Keras' does a float
    ``where`` first, which leads nowhere but the argmax): no gradient path from
    ``h`` to it exists, so none can be missed (the prober's issue, section 6)."""
    table = tf.Variable(tf.reshape(tf.range(4, dtype=tf.float32), [2, 2]), name="table")

    def looks_up(x, w):
        h = tf.sin(x * w)
        index = keras.ops.argmax(h, axis=-1)  # integer: ends every gradient path
        return h, tf.gather(table, tf.cast(index, tf.int32) % 2) * 2.0

    x = tf.constant([[0.3, 1.2], [0.9, -0.4]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ChainedOutputWarning either
        _structure._warned_chained.discard("looks_up")
        ours = _step(checkpointable(looks_up, checkpoint=True), mode, "output")(x)
        checked = _step(checkpointable(looks_up, checkpoint=True, check=True), mode,
                        "output")(x)
    assert_all_close(ours, _step(looks_up, mode, "output")(x))
    assert_all_close(checked, _step(looks_up, mode, "output")(x))


def test_a_path_through_float_ops_not_returned_is_still_flagged(mode):
    """Conservative: ``h`` reaches ``y`` through intermediates the call does not
    return; that path is followed."""
    def via_intermediates(x, w):
        h = tf.sin(x * w)
        t = tf.where(h > 0, h, -h)  # a float where, then float ops
        return h, tf.cos(t * 2.0)

    with pytest.raises(ValueError, match=r"output\(s\) \[0\]"):
        _step(checkpointable(via_intermediates, checkpoint=True, check=True), mode,
              "output")(tf.constant([0.3, 1.2]))


@pytest.mark.parametrize("mode", ["eager", "graph"])  # ragged ops do not compile with XLA
def test_a_ragged_output_is_not_flagged_by_its_shape_checks(mode):
    splits = tf.constant([0, 1, 3], tf.int64)
    body = lambda x: tf.RaggedTensor.from_row_splits(tf.sin(x), splits)  # noqa: E731

    def step(fn):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x).flat_values ** 2)
            return loss, tape.gradient(loss, x)
        return compile_step(run, mode)

    x = tf.constant([0.2, 0.7, 0.1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = step(checkpointable(body, checkpoint=True, check=True))(x)
    assert_all_close(ours, step(body)(x))


def passes_x_through(x, w):
    return x, tf.sin(x * w) * x


def test_an_argument_returned_as_it_is_gets_the_plain_gradient(mode):
    """The returned argument stays that tensor, so a gradient with respect to it
    includes the path through the other output, exactly as without checkpointing;
    nothing is flagged."""
    calls = []

    def counted(x, w):
        calls.append(1)
        return passes_x_through(x, w)

    def make_step(fn):
        w = tf.Variable(1.5, name="w")

        def step(x):
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                x_out, y = fn(x, w)
                loss = tf.reduce_sum(x_out * 2.0 + y)
            return loss, tape.gradient(loss, [x, w]), tape.gradient(loss, x_out)

        return compile_step(step, mode)

    x = tf.constant([0.3, 1.2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = make_step(checkpointable(counted, checkpoint=True, check=True))(x)
    assert_all_close(ours, make_step(passes_x_through)(x))
    assert len(calls) == 3  # the forward, and one replay per tape.gradient call
