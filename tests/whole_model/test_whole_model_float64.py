"""A checkpointed DenseNet-like model trains as the plain one, to float64 rounding.

In float32 a checkpointed ``fit`` drifts from plain's on DenseNet121 and
MobileNetV2 (after 3 steps the losses 0.2% and 0.5% apart, variables up to 2e-2 and
1e-1): the steps differ by float32 rounding only (a gradient's sum grouped otherwise
where a region's boundary splits a tensor's readers, or Grappler rewriting the two
graphs differently), which training amplifies by 10^2-10^4 per step, as it amplifies
plain's own rounding (docs/whole-model.md, "Exact, to rounding"). A comparison in float32 therefore
needs a tolerance that would also hide a replay computing something slightly else.
In float64 the same rounding is 1e-16, so here a replay that differs from the
forward by even a float32 rounding fails the comparison (the last test shows it).

The plan is fixed by hand, to cover what DenseNet121's least plan has: nested
regions, a region under ``reductions_saveable``, a region of one concatenation,
and boundaries between a tensor's BatchNorm and the concatenation that also reads
it.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_checkpointing as tc

L = keras.layers

# A BatchNorm inside a nested region whose concatenation (the input's other reader)
# is outside the region; a region under reductions_saveable; a lone concatenation.
REGIONS = [
    ["stem_conv", "stem_bn", "stem_relu", ["b0_0_bn0", "b0_0_relu0"], "b0_0_conv1"],
    ["b0_0_bn1", "b0_0_relu1", "b0_0_conv2", "b0_0_concat", "b0_1_bn0", "b0_1_relu0"],
    ["b0_2_concat"],
    ["t0_bn", "t0_relu", "t0_conv", "t0_pool", ["b1_0_bn0", "b1_0_relu0"], "b1_0_conv1"],
]
POLICIES = [None, tc.policies.reductions_saveable, None, None]


@pytest.fixture
def float64():
    # The dtype policy too: once a layer has made the global policy, floatx alone
    # no longer changes the layers' dtype.
    previous = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(previous[0])
    keras.config.set_dtype_policy(previous[1])


def dense_net(blocks=2, per_block=3, growth=4, image=8):
    """DenseNet's structure in small: each layer's output concatenated to its input,
    which the next layer's BatchNorm and the next concatenation both read."""
    inputs = keras.Input((image, image, 3))
    x = L.Conv2D(8, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(x))
    for b in range(blocks):
        for i in range(per_block):
            p = f"b{b}_{i}_"
            y = L.ReLU(name=p + "relu0")(L.BatchNormalization(name=p + "bn0")(x))
            y = L.Conv2D(2 * growth, 1, use_bias=False, name=p + "conv1")(y)
            y = L.ReLU(name=p + "relu1")(L.BatchNormalization(name=p + "bn1")(y))
            y = L.Conv2D(growth, 3, padding="same", use_bias=False, name=p + "conv2")(y)
            x = L.Concatenate(name=p + "concat")([x, y])
        if b < blocks - 1:
            x = L.ReLU(name=f"t{b}_relu")(L.BatchNormalization(name=f"t{b}_bn")(x))
            x = L.Conv2D(x.shape[-1] // 2, 1, use_bias=False, name=f"t{b}_conv")(x)
            x = L.AveragePooling2D(2, name=f"t{b}_pool")(x)
    x = L.ReLU(name="head_relu")(L.BatchNormalization(name="head_bn")(x))
    x = L.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, L.Dense(10, activation="softmax", name="predictions")(x))


@functools.cache  # the plain run serves both tests
def trained(checkpointed, replay_in_float32=False):
    """The model's variables (BatchNorm statistics included) and losses after three
    SGD steps of ``fit``, from the same seed and data (in the float64 fixture)."""
    keras.utils.set_random_seed(0)
    model = dense_net()
    if replay_in_float32:  # a replay that differs from its forward by float32 rounding
        layer = model.get_layer("b1_0_relu0")
        call = layer.call

        def call_rounded_in_replay(x):
            y = call(x)
            return tf.cast(tf.cast(y, tf.float32), y.dtype) if tc.is_recomputing() else y

        layer.call = call_rounded_in_replay
    if checkpointed:
        plan = tc.ModelPlan.from_regions(model, REGIONS, policies=POLICIES)
        tc.apply_checkpointing(model, plan=plan)
    rng = np.random.default_rng(0)
    x = rng.random((24, 8, 8, 3))
    y = rng.integers(0, 10, size=(24,))
    model.compile(keras.optimizers.SGD(), "sparse_categorical_crossentropy")
    losses = []
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(logs["loss"]))])
    assert len(losses) == 3
    return [(v.path, v.numpy()) for v in model.variables], losses


def assert_variables_close(ours, plain):
    for (path, a), (_, b) in zip(ours, plain):
        assert a.dtype == np.float64 or not np.issubdtype(a.dtype, np.floating), path  # not float32
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13, err_msg=path)


def test_checkpointed_fit_equals_plain_in_float64(float64):
    plain, plain_losses = trained(checkpointed=False)
    ours, losses = trained(checkpointed=True)
    assert [path for path, _ in ours] == [path for path, _ in plain]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-12)
    assert_variables_close(ours, plain)


def test_a_replay_off_by_float32_rounding_is_caught(float64):
    plain, _ = trained(checkpointed=False)
    ours, _ = trained(checkpointed=True, replay_in_float32=True)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        assert_variables_close(ours, plain)
