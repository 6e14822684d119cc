"""Saving and loading models with checkpointed layers.

* ``model.save("x.keras")`` / ``keras.models.load_model``: a registered
  serializable layer whose ``call`` is ``@checkpointable`` comes back
  checkpointed and predicts the same; a model checkpointed with
  ``apply_checkpointing`` saves the plain architecture and is checkpointed again
  by calling it on the loaded model.
* ``tf.saved_model.save`` / ``model.export`` and reload serve the same
  predictions.
* ``tf.train.Checkpoint`` and ``.weights.h5`` files are the same with and
  without checkpointing: written by one, restored into the other, and back.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import BlockNet, ResidualBlock

from tf_checkpointing import apply_checkpointing, checkpointable, is_recomputing

RUNS: list = []


@keras.saving.register_keras_serializable(package="tf_checkpointing_tests")
class PlainBlock(ResidualBlock):
    def record(self, hidden):
        RUNS.append(is_recomputing())


@keras.saving.register_keras_serializable(package="tf_checkpointing_tests")
class CheckpointedBlock(PlainBlock):
    @checkpointable(checkpoint=True)
    def call(self, x, training=None):
        return super().call(x, training=training)


def functional(block_class=PlainBlock):
    x = keras.Input((8,))
    h = block_class(name="block")(keras.layers.Dense(8, name="pre")(x))
    return keras.Model(x, keras.layers.Dense(1, name="head")(h), name="net")


def as_json(config):
    return json.loads(json.dumps(config, default=str))  # tuples and lists alike


def data(n=16):
    return np.random.default_rng(0).normal(size=(n, 8)).astype("float32")


def trained(model):
    """One step of fit, so that BatchNorm statistics and seeds have moved."""
    x = data()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    return model


def replays(model):
    x = data(4)
    RUNS.clear()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    assert all(g is not None for g in grads)
    return RUNS.count(True)


def test_keras_file_round_trip_keeps_a_checkpointed_layer_class(tmp_path):
    model = trained(functional(CheckpointedBlock))
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.get_layer("block")) is CheckpointedBlock
    np.testing.assert_allclose(loaded.predict(data(), verbose=0), model.predict(data(), verbose=0),
                               rtol=1e-6, atol=1e-6)
    assert replays(loaded) == 1  # still checkpointed
    trained(loaded)  # and still trains


def test_keras_file_of_apply_checkpointing_model_is_the_plain_model(tmp_path):
    plain = trained(functional())
    model = functional()
    model.set_weights(plain.get_weights())
    config = model.get_config()
    apply_checkpointing(model, ["block"])
    model.save(str(tmp_path / "checkpointed.keras"))

    loaded = keras.models.load_model(str(tmp_path / "checkpointed.keras"))
    assert as_json(loaded.get_config()) == as_json(config)  # the plain architecture
    np.testing.assert_allclose(loaded.predict(data(), verbose=0), plain.predict(data(), verbose=0),
                               rtol=1e-6, atol=1e-6)
    assert replays(loaded) == 0  # checkpointing is not part of the file...
    apply_checkpointing(loaded, ["block"])
    assert replays(loaded) == 1  # ...and is applied again in one line


def test_checkpointable_proxy_round_trips_as_its_layer(tmp_path):
    block = PlainBlock(name="block")
    model = keras.Sequential(
        [keras.Input((8,)), checkpointable(block, checkpoint=True), keras.layers.Dense(1)],
        name="net",
    )
    trained(model)
    assert replays(model) == 1
    path = str(tmp_path / "proxy.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.layers[0]) is PlainBlock
    np.testing.assert_allclose(loaded.predict(data(), verbose=0), model.predict(data(), verbose=0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", ["decorated", "apply_checkpointing"])
def test_saved_model_serves_the_same_predictions(tmp_path, how):
    if how == "decorated":
        model = trained(functional(CheckpointedBlock))
    else:
        model = functional()
        apply_checkpointing(model, ["block"])
        trained(model)
    expected = model.predict(data(), verbose=0)

    module = tf.Module()
    module.model = model
    module.serve = tf.function(
        lambda x: model(x, training=False), input_signature=[tf.TensorSpec([None, 8], tf.float32)]
    )
    tf.saved_model.save(module, str(tmp_path / "saved_model"))
    reloaded = tf.saved_model.load(str(tmp_path / "saved_model"))  # keep: it owns the variables
    np.testing.assert_allclose(reloaded.serve(data()).numpy(), expected, rtol=1e-6, atol=1e-6)

    model.export(str(tmp_path / "exported"), verbose=False)
    exported = tf.saved_model.load(str(tmp_path / "exported"))
    np.testing.assert_allclose(exported.serve(data()).numpy(), expected, rtol=1e-6, atol=1e-6)


def _functional_applied():
    model = functional()
    apply_checkpointing(model, ["block"])
    return model


@pytest.mark.parametrize("pair", [
    (_functional_applied, functional),
    (lambda: BlockNet(PlainBlock(name="block"), checkpoint=True),
     lambda: BlockNet(PlainBlock(name="block"), checkpoint=False)),
], ids=["apply_checkpointing", "checkpointable_proxy"])
def test_tf_train_checkpoint_restores_across_checkpointing(tmp_path, pair):
    make_checkpointed, make_plain = pair
    checkpointed = trained(make_checkpointed())
    assert replays(checkpointed) == 1
    saved = tf.train.Checkpoint(model=checkpointed).write(str(tmp_path / "from_checkpointed"))

    plain = make_plain()
    plain(data(1))  # build, then restore every variable
    tf.train.Checkpoint(model=plain).read(saved).assert_existing_objects_matched()
    for a, b in zip(checkpointed.weights, plain.weights):
        np.testing.assert_array_equal(b.numpy(), a.numpy())
    trained(plain)
    back = tf.train.Checkpoint(model=plain).write(str(tmp_path / "from_plain"))

    again = make_checkpointed()
    again(data(1))
    tf.train.Checkpoint(model=again).read(back).assert_existing_objects_matched()
    for a, b in zip(plain.weights, again.weights):
        np.testing.assert_array_equal(b.numpy(), a.numpy())
    assert replays(again) == 1


def test_weights_file_loads_into_the_plain_model(tmp_path):
    model = trained(_functional_applied())
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    plain = functional()
    plain.load_weights(path)
    np.testing.assert_allclose(plain.predict(data(), verbose=0), model.predict(data(), verbose=0),
                               rtol=1e-6, atol=1e-6)
