"""``Model.fit`` on data whose batch size its traced step cannot know: a
``tf.data.Dataset`` batched without ``drop_remainder``, arrays whose length is not a
multiple of ``batch_size``. ``apply_checkpointing(model, budget=...)`` plans for the
data's batch size, read from the data (nothing consumed), and trains as plain does."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_checkpointing as tc
from tf_checkpointing._fit_batches import largest_batch


def _model(jit):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    for _ in range(3):
        y = keras.layers.Conv2D(8, 3, padding="same")(h)
        y = keras.layers.Dropout(0.2)(keras.layers.ReLU()(keras.layers.BatchNormalization()(y)))
        h = keras.layers.Add()([h, y])
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(keras.optimizers.SGD(0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    return model


def _data():
    rng = np.random.RandomState(0)
    return rng.rand(20, 8, 8, 3).astype("float32"), rng.randint(0, 3, 20)


# Arrays reach the step through a tf.data pipeline Keras builds, as a dataset does:
# under XLA, the dataset alone (an XLA case is the file's costliest).
@pytest.mark.parametrize("feed, jit", [("dataset", False), ("dataset", True), ("arrays", False)],
                         ids=["dataset-graph", "dataset-xla", "arrays-graph"])
def test_fit_with_a_partial_last_batch_plans_for_the_full_batch_and_equals_plain(jit, feed):
    x, y = _data()

    def fit(model):
        if feed == "dataset":  # 8, 8, 4: traced with a None batch dimension
            return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2,
                             verbose=0)
        return model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)

    plain = fit(_model(jit)).history["loss"]
    model = _model(jit)
    tc.apply_checkpointing(model, budget="min")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = fit(model).history["loss"]
    np.testing.assert_allclose(ours, plain, rtol=1e-5)
    mode = "xla" if jit else "graph"
    plans = model.call.maker.plans.plans(mode)
    assert len(plans) == 1 and plans[0].regions, plans  # one plan, checkpointing regions
    # Planned for batches of 8 (no warning that the budget holds only for smaller ones).
    assert not [w for w in caught if "unknown batch size" in str(w.message)]
    assert model.call.maker.batch_hint == 8


def test_the_largest_batch_is_read_from_the_data_without_consuming_it():
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(20, seed=1).batch(6).map(
        lambda a, b: (a * 2, b)).prefetch(1)
    assert largest_batch((dataset,), {}) == 6
    assert largest_batch((x, y), {"batch_size": 8}) == 8
    assert largest_batch((x[:5], y[:5]), {"batch_size": 8}) == 5  # fewer samples than that
    assert largest_batch((x, y), {}) == 20  # Keras' default of 32, capped by the samples
    assert largest_batch((x,), {"y": y, "batch_size": 4}) == 4
    generator = tf.data.Dataset.from_generator(lambda: iter([(x[:4], y[:4])]), output_signature=(
        tf.TensorSpec([None, 8, 8, 3]), tf.TensorSpec([None], tf.int64)))
    assert largest_batch((generator,), {}) is None  # nothing says: planning then names the fixes
    assert largest_batch((lambda: None,), {}) is None
