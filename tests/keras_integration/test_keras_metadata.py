"""Keras metadata survives checkpointing: masks, ``training`` inheritance and
autocast behave as without it, for ``checkpointable(layer)`` and
``apply_checkpointing`` alike (issue 10, case 2)."""

import keras
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close

from tf_checkpointing import apply_checkpointing, checkpointable, is_recomputing


class MaskedNet(keras.Model):
    """Embedding(mask_zero) -> block -> GlobalAveragePooling1D: the pooling
    averages only the unmasked steps, so a lost mask changes the output."""

    def __init__(self, how=None, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(10, 4, mask_zero=True)
        dense = keras.layers.Dense(4, name="inner")
        self.inner = checkpointable(dense, checkpoint=True) if how == "proxy" else dense
        self.drop = keras.layers.Dropout(0.5, seed=3)
        self.pool = keras.layers.GlobalAveragePooling1D()

    def call(self, ids, training=None):
        return self.pool(self.drop(self.inner(self.embed(ids))))


def _twins(how):
    keras.utils.set_random_seed(1)
    plain, ours = MaskedNet(), MaskedNet(how)
    ids = tf.constant([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 7]])
    plain(ids)
    ours(ids)
    ours.set_weights(plain.get_weights())
    if how == "apply":
        apply_checkpointing(ours, ["inner"])
    return plain, ours, ids


@pytest.mark.parametrize("how", ["proxy", "apply"])
def test_masks_survive_checkpointing(how, mode):
    plain, ours, ids = _twins(how)

    def step(model):
        with tf.GradientTape() as tape:
            hidden = model.inner(model.embed(ids))
            out = model(ids, training=True)
            loss = tf.reduce_sum(out ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        return out, [tf.convert_to_tensor(g) for g in grads], hidden._keras_mask

    for model in (plain, ours):
        model.drop.seed_generator.state.assign([5, 0])
    expected = compile_step(step, mode)(plain)
    actual = compile_step(step, mode)(ours)
    assert_all_close(actual, expected)


def test_checkpointable_layer_inherits_training_and_runs_keras_call_once_per_call():
    log = []

    class Logged(keras.layers.Layer):
        def call(self, x, training=None):
            log.append((training, is_recomputing()))
            return x * 2.0

    class Net(keras.Model):
        def __init__(self, checkpoint):
            super().__init__()
            self.block = checkpointable(Logged(), checkpoint=checkpoint)

        def call(self, x):
            return self.block(x)

    logs = []
    for checkpoint in (False, True):
        log.clear()
        net, x = Net(checkpoint), tf.ones([2, 3])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = net(x, training=True)
        tape.gradient(y, x)
        logs.append(list(log))
    plain, ours = logs
    assert (True, False) in plain
    assert ours == plain + [(True, True)]  # the same calls, plus the replay


def test_checkpointable_layer_autocasts_like_the_plain_layer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        dense = keras.layers.Dense(3)
        wrapped = checkpointable(dense, checkpoint=True)
        x = tf.random.stateless_normal([2, 4], seed=[1, 1])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            plain_out, ours_out = dense(x), wrapped(x)
        assert ours_out.dtype == plain_out.dtype == tf.float16
        assert_all_close(tape.gradient(ours_out, [x, dense.kernel]),
                         tape.gradient(plain_out, [x, dense.kernel]), rtol=1e-3, atol=1e-3)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_proxy_output_masks_match_in_a_functional_model(mode):
    embed, dense = keras.layers.Embedding(10, 4, mask_zero=True), keras.layers.Dense(4)
    pool = keras.layers.GlobalAveragePooling1D()
    ids = keras.Input((4,), dtype="int32")
    plain = keras.Model(ids, pool(dense(embed(ids))))
    ours = keras.Model(ids, pool(checkpointable(dense, checkpoint=True)(embed(ids))))
    batch = tf.constant([[1, 2, 0, 0], [3, 0, 0, 0]])

    def step(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(batch) ** 2)
        return loss, [tf.convert_to_tensor(g)
                      for g in tape.gradient(loss, model.trainable_variables)]

    assert_all_close(compile_step(step, mode)(ours), compile_step(step, mode)(plain))


def test_call_time_options_reach_the_checkpointed_call_of_a_proxy():
    log = []

    class Logged(keras.layers.Layer):
        def call(self, x):
            log.append(is_recomputing())
            return tf.sin(x)

    layer = checkpointable(Logged())  # off unless the call says otherwise
    x = tf.ones([2])
    for option, expected in ((None, [False]), (True, [False, True]), (False, [False])):
        log.clear()
        kwargs = {} if option is None else {"_checkpoint": option}
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, **kwargs)
        assert_all_close(tape.gradient(y, x), tf.cos(x))
        assert log == expected, (option, log)
    with pytest.raises(TypeError, match="`_checkpoint` must be a Python bool"):
        with tf.GradientTape():
            layer(x, _checkpoint="yes")
