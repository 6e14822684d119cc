"""tf_checkpointing.RematScope: keras.RematScope's modes, exact, and working under fit.

Each model is built twice from the same seeds: once inside the scope, once plain.
The scoped one must give the plain one's loss, gradients and state (dropout masks,
BatchNorm statistics), replay what it checkpoints (the activation functions log
`is_recomputing()`), and leave the layers created outside the scope alone.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close

from tf_checkpointing import RematScope, is_recomputing

SCOPES = {
    "full": dict(mode="full"),
    "activations": dict(mode="activations"),
    # hidden's output is [4, 32] = 128 elements; head's [4, 1]: only hidden is larger
    "larger_than": dict(mode="larger_than", output_size_threshold=64),
    "list_of_layers": dict(mode="list_of_layers", layer_names=["hidden"]),
}


class Net:
    """outside (created outside any scope) -> hidden (gelu) -> dropout -> BN -> head."""

    def __init__(self, scope):
        keras.utils.set_random_seed(7)
        self.log = {"outside": [], "hidden": []}
        self.outside = keras.layers.Dense(16, activation=self._logged("outside"),
                                          name="outside")
        with (RematScope(**scope) if scope else contextlib.nullcontext()):
            self.hidden = keras.layers.Dense(32, activation=self._logged("hidden"),
                                             name="hidden")
            self.dropout = keras.layers.Dropout(0.3, seed=3)
            self.norm = keras.layers.BatchNormalization(name="norm")
            self.head = keras.layers.Dense(1, name="head")
        self.model = keras.Sequential([keras.Input((8,)), self.outside, self.hidden,
                                       self.dropout, self.norm, self.head])

    def _logged(self, name):
        def gelu(x):
            self.log[name].append(is_recomputing())
            return keras.activations.gelu(x)

        return gelu

    def state(self):
        return [v.numpy() for v in self.model.non_trainable_variables]


def _twins(scope_name):
    ours, plain = Net(SCOPES[scope_name]), Net(None)
    plain.model.set_weights(ours.model.get_weights())
    return ours, plain


def _step(net, mode):
    variables = net.model.trainable_variables

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(net.model(x, training=True) ** 2)
        return loss, tape.gradient(loss, [x] + variables)

    return compile_step(step, mode)


@pytest.mark.parametrize("scope_name", list(SCOPES))
def test_gradients_and_state_equal_plain(scope_name, mode):
    ours, plain = _twins(scope_name)
    x = tf.random.stateless_normal([4, 8], seed=[1, 2])
    loss, grads = _step(ours, mode)(x)
    plain_loss, plain_grads = _step(plain, mode)(x)
    assert_all_close(loss, plain_loss)
    assert_all_close(grads, plain_grads, names=["x"] + [v.path for v in
                                                         ours.model.trainable_variables])
    assert_all_close(ours.state(), plain.state())
    # The checkpointed part was replayed; the layer created outside never was.
    assert True in ours.log["hidden"], ours.log
    assert True not in ours.log["outside"]
    assert True not in plain.log["hidden"]


@pytest.mark.parametrize("scope_name", list(SCOPES))
def test_fit_trains_like_plain(scope_name):
    """Model.fit (a tf.function), where keras.RematScope fails in 3 of its 4 modes."""
    ours, plain = _twins(scope_name)
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")
    histories = []
    for net in (ours, plain):
        net.model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        histories.append(net.model.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                                       verbose=0).history["loss"])
    np.testing.assert_allclose(histories[0], histories[1], rtol=1e-5)
    assert_all_close(ours.model.get_weights(), plain.model.get_weights())
    assert True in ours.log["hidden"]
    assert True not in ours.log["outside"]


def test_only_chosen_layers_are_checkpointed():
    ours = Net(SCOPES["list_of_layers"])
    _step(ours, "eager")(tf.ones([4, 8]))
    checkpointed = {layer.name for layer in ours.model.layers
                    if "_tf_checkpointing_remat_call" in vars(layer)}
    assert checkpointed == {"hidden"}


def test_full_mode_checkpoints_the_layers_of_a_model_created_inside():
    """A Sequential created in the scope is not checkpointed as a whole (a whole-model
    replay would keep every activation again); each of its layers is."""
    with RematScope("full"):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"),
                                  keras.layers.Dense(8, name="b")])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones([2, 8])))
    tape.gradient(loss, model.trainable_variables)
    assert "_tf_checkpointing_remat_call" not in vars(model)
    assert all("_tf_checkpointing_remat_call" in vars(layer) for layer in model.layers)


def test_none_mode_inside_a_scope_turns_it_off():
    with RematScope("full"):
        with RematScope(None):
            off = keras.layers.Dense(4)
        on = keras.layers.Dense(4)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(on(off(tf.ones([2, 3]))))
    tape.gradient(loss, off.trainable_variables + on.trainable_variables)
    assert "_tf_checkpointing_remat_call" not in vars(off)
    assert "_tf_checkpointing_remat_call" in vars(on)


def test_same_arguments_and_mode_as_keras():
    scope = RematScope(mode="larger_than", output_size_threshold=2048)
    assert isinstance(scope, keras.RematScope)
    assert scope.mode == "larger_than" and scope.output_size_threshold == 2048
    assert RematScope(mode="list_of_layers", layer_names=["a"]).layer_names == ["a"]
    assert repr(RematScope()) == ("RematScope(mode='full', output_size_threshold=1024, "
                                  "layer_names=[])")


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match=r"argument `mode`.*received 'everything'"):
        RematScope(mode="everything")
    with pytest.raises(TypeError, match=r"`layer_names` must be a list.*\['dense_1'\]"):
        RematScope(mode="list_of_layers", layer_names="dense_1")
    with pytest.raises(TypeError, match=r"`output_size_threshold` must be a number"):
        RematScope(mode="larger_than", output_size_threshold="big")
