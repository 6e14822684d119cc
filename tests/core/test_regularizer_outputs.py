"""An output of a checkpointed call from which a layer inside it computes an added
loss (an ``activity_regularizer`` on the block's last layer, a model output in a
whole-model region).

The call returns the loss as an output too (so that it gets its gradient,
``_losses``), so for the outer tape the output and the loss are independent:
gradients with respect to the inputs and variables, ``model.losses`` included,
are exact, but ``tape.gradient(loss, output)`` misses the path through the
regularizer. The chained-output check flags it (an error in the check mode, a
warning otherwise) and says it is an added loss, which the caller never returned.
``checkpointable(layer)`` adds the regularizer's loss outside the checkpointed call:
exact, and nothing is flagged.
"""

import warnings

import keras
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close, with_spans

import tf_checkpointing as tc
from tf_checkpointing.core import _structure

X = tf.random.stateless_normal([4, 3], [5, 6])


def _dense():
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.5))
    dense(X)
    return dense


def _grads(fn, owner, variables, mode):
    """The total loss (outputs plus ``owner.losses``), its gradients with respect to
    the input and ``variables``, and with respect to the output."""

    def step(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y) + tf.add_n(owner.losses)
        return loss, tape.gradient(loss, [x, *variables]), tape.gradient(loss, y)

    return compile_step(step, mode)(X)


def regularized_block(dense, **options):
    def regularized(x):
        return dense(x)  # the regularizer's loss is computed from this output

    return tc.checkpointable(regularized, checkpoint=True, **options)


def test_a_function_returning_a_regularized_output_is_flagged_as_feeding_its_loss(mode):
    dense = _dense()
    block = regularized_block(dense)
    plain = _grads(dense, dense, dense.trainable_variables, mode)
    _structure._warned_chained.discard("regularized_block.<locals>.regularized")
    with pytest.warns(tc.debug.ChainedOutputWarning, match=r"output\(s\) \[0\].*computed a loss "
                      r"it added.*would miss the path through the added loss.*"
                      r"checkpointable\(layer\)"):
        ours = _grads(block, dense, dense.trainable_variables, mode)
    assert_all_close(ours[0], plain[0])
    assert_all_close(ours[1], plain[1], atol=1e-5)  # inputs and variables: exact
    checked = regularized_block(dense, check=True)
    with pytest.raises(ValueError, match="would miss the path through the added loss"):
        _grads(checked, dense, dense.trainable_variables, mode)


def test_a_checkpointed_regularized_layer_is_exact_and_not_flagged(mode):
    dense = _dense()
    plain = _grads(dense, dense, dense.trainable_variables, mode)
    wrapped = tc.checkpointable(dense, checkpoint=True, check=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = _grads(wrapped, wrapped, dense.trainable_variables, mode)
    assert_all_close(ours, plain, atol=1e-5)  # also the gradient for the output


def _two_outputs():
    keras.utils.set_random_seed(0)
    x = keras.Input((3,))
    h = keras.layers.Dense(4, activity_regularizer="l2", name="reg")(x)
    y = keras.layers.Dense(2, name="head")(keras.layers.Dense(4, activation="tanh")(h))
    return keras.Model(x, [h, y])


@pytest.mark.parametrize("stop, message", [
    (1, "would miss the path through the added loss"),
    (3, "would miss the path through the outputs computed from it"),
])
def test_a_region_whose_model_output_feeds_its_loss_says_so(stop, message):
    """A region of the regularized layer alone returns its model output and the loss
    computed from it; one that also makes the model's other output from it is
    flagged for that output."""
    model = _two_outputs()
    least = tc.plan_model(model, X, budget="min", mode="eager")
    assert least.names[0] == "reg"
    plan = with_spans(least, ((0, stop, ()),))
    tc.apply_checkpointing(model, plan=plan, check=True)
    with pytest.raises(ValueError, match=message), tf.GradientTape():
        model(X, training=True)
