"""The core decorator: exact gradients, argument handling, wrapping, errors."""

import inspect
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import Counter, assert_all_close, grads_of

from tf_checkpointing import checkpointable


def _dense_block(w, b):
    def block(x, y, some_str, some_bool, z=None):
        assert isinstance(some_str, str) and isinstance(some_bool, bool)
        h = tf.nn.gelu(tf.matmul(x, w) + b)
        if some_bool:
            h = h * y
        return h + z if z is not None else h

    return block


def test_gradients_match_plain_for_positional_keyword_and_variables(mode):
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(6, 6)).astype("float32"), name="w")
    b = tf.Variable(rng.normal(size=(6,)).astype("float32"), name="b")
    body = Counter(_dense_block(w, b))
    wrapped = checkpointable(body)
    x, y, z = (tf.constant(rng.normal(size=(4, 6)).astype("float32")) for _ in range(3))

    plain = grads_of(lambda x, y, z: body(x, y, "a", True, z=z), [x, y, z], [w, b], mode)
    calls_plain = body.calls
    ours = grads_of(lambda x, y, z: wrapped(x, y, "a", True, z=z, _checkpoint=True),
                    [x, y, z], [w, b], mode)
    assert_all_close(ours, plain, names=["loss", "x", "y", "z", "w", "b"])
    assert ours[1][2] is not None, "the keyword tensor z must get a gradient"
    # The forward and its replay: twice per checkpointed step, once per plain one.
    assert body.calls - calls_plain == 2 * calls_plain


def test_body_runs_twice_per_checkpointed_training_step_and_once_without():
    body = Counter(lambda x: tf.sin(x) * x)
    wrapped = checkpointable(body)
    x = tf.constant([1.0, 2.0])
    for checkpoint, expected in ((False, 1), (True, 2)):
        body.calls = 0
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wrapped(x, _checkpoint=checkpoint)
        tape.gradient(y, x)
        assert body.calls == expected


def test_no_tape_calls_the_function_directly():
    seen = []
    wrapped = checkpointable(lambda x: seen.append(type(x)) or x * 2, checkpoint=True)
    out = wrapped(tf.constant(1.0))
    assert float(out) == 2.0 and len(seen) == 1


# The outputs `parts` and `extra` are computed from the output `h`: gradients with
# respect to the inputs and `w`, which this test takes, are exact; the warning is
# about tape.gradient(loss, h), tested in test_chained_outputs.py.
@pytest.mark.filterwarnings("ignore::tf_checkpointing.debug.ChainedOutputWarning")
def test_nested_structures_in_arguments_and_outputs(mode):
    w = tf.Variable([[1.0, 2.0], [3.0, -1.0]], name="w")

    def body(inputs, extra=None):
        a, (b, c) = inputs["a"], inputs["pair"]
        h = tf.matmul(a, w) * b + c
        return {"h": h, "parts": [tf.tanh(h), None, 3], "count": tf.shape(h)[0],
                "extra": extra["scale"] * h}

    wrapped = checkpointable(body)
    a, b, c, s = (tf.random.stateless_normal([3, 2], seed=[i, 1]) for i in range(4))

    def call(fn, **kw):
        return lambda a, b, c, s: fn({"a": a, "pair": (b, c)}, extra={"scale": s}, **kw)

    plain = grads_of(call(body), [a, b, c, s], [w], mode)
    ours = grads_of(call(wrapped, _checkpoint=True), [a, b, c, s], [w], mode)
    assert_all_close(ours, plain)

    with tf.GradientTape():  # non-tensor and integer output leaves come back as they were
        out = wrapped({"a": a, "pair": (b, c)}, extra={"scale": s}, _checkpoint=True)
    assert out["parts"][1] is None and out["parts"][2] == 3
    assert out["count"].dtype == tf.int32 and int(out["count"]) == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_floating_dtype_gets_gradients(dtype, mode):
    w = tf.Variable(tf.cast([[0.5, -1.0], [2.0, 0.25]], dtype), name="w")
    body = lambda x: tf.nn.relu(tf.matmul(x, w)) * x  # noqa: E731
    x = tf.cast([[1.0, 2.0], [-0.5, 0.75]], dtype)
    plain = grads_of(body, [x], [w], mode)
    ours = grads_of(lambda x: checkpointable(body)(x, _checkpoint=True), [x], [w], mode)
    assert all(g is not None for g in ours[1])
    rtol = 1e-5 if dtype in ("float32", "float64") else 1e-2
    assert_all_close(ours, plain, rtol=rtol, atol=rtol)
    assert ours[1][0].dtype == dtype


def test_non_tensor_arguments_reach_the_function_untouched(mode):
    marker = object()
    seen = {}

    def body(x, flag, name, count, nothing, obj, ints, mask):
        seen.update(flag=type(flag), name=name, count=count, nothing=nothing, obj=obj)
        assert ints.dtype == tf.int32 and mask.dtype == tf.bool
        y = x * tf.cast(ints, x.dtype)
        if flag:  # a Python bool stays a bool, also inside tf.function
            y = tf.where(mask, y, 0.0)
        return y * count

    wrapped = checkpointable(body)
    x = tf.constant([1.0, 2.0, 3.0])
    ints, mask = tf.constant([1, 2, 3]), tf.constant([True, False, True])
    args = lambda fn, **kw: (lambda x: fn(x, True, "mode", 2, None, marker, ints, mask, **kw))  # noqa: E731
    plain = grads_of(args(body), [x], [], mode)
    ours = grads_of(args(wrapped, _checkpoint=True), [x], [], mode)
    assert_all_close(ours, plain)
    assert seen == dict(flag=bool, name="mode", count=2, nothing=None, obj=marker)


def test_same_tensor_twice_and_variable_as_argument(mode):
    v = tf.Variable([1.5, -2.0], name="v")
    body = lambda a, b, var: a * b * var + a  # noqa: E731
    x = tf.constant([0.5, 3.0])
    plain = grads_of(lambda x: body(x, x, v), [x], [v], mode)
    ours = grads_of(lambda x: checkpointable(body)(x, x, v, _checkpoint=True), [x], [v], mode)
    assert_all_close(ours, plain)


def test_keras_layer_built_lazily_inside_first_checkpointed_call(mode):
    keras.utils.set_random_seed(1)
    dense = keras.layers.Dense(3, activation="tanh")
    twin = keras.layers.Dense(3, activation="tanh")
    wrapped = checkpointable(dense)
    x = tf.random.stateless_normal([2, 4], seed=[1, 2])
    twin.build(x.shape)
    ours = grads_of(lambda x: wrapped(x, _checkpoint=True), [x], [], mode)  # builds dense
    twin.set_weights(dense.get_weights())
    ours = grads_of(lambda x: wrapped(x, _checkpoint=True), [x], dense.trainable_variables, mode)
    plain = grads_of(twin, [x], twin.trainable_variables, mode)
    assert_all_close(ours, plain)
    assert all(g is not None for g in ours[1])


def test_second_order_gradients(mode):
    w = tf.Variable([[0.3, -0.2], [0.1, 0.4]], name="w")
    body = lambda x: tf.tanh(tf.matmul(x, w)) ** 2  # noqa: E731
    wrapped = checkpointable(body, checkpoint=True)
    x = tf.constant([[1.0, -1.0], [0.5, 2.0]])

    def hessian_vector(fn):
        def step(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    loss = tf.reduce_sum(fn(x))
                gx, gw = inner.gradient(loss, [x, w])
                second = tf.reduce_sum(gx * gx) + tf.reduce_sum(gw)
            return outer.gradient(second, [x, w])
        return compile_step(step, mode)

    assert_all_close(hessian_vector(wrapped)(x), hessian_vector(body)(x))


def test_float64_numerical_gradient():
    w = tf.Variable(tf.constant([[0.3, -0.2], [0.1, 0.4]], tf.float64))
    wrapped = checkpointable(lambda x: tf.sin(tf.matmul(x, w)) * x, checkpoint=True)
    x = tf.constant([[1.0, -1.0], [0.5, 2.0]], tf.float64)
    theoretical, numerical = tf.test.compute_gradient(wrapped, [x])
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-6, atol=1e-8)


def test_threads_compute_checkpointed_gradients_at_once():
    w = tf.Variable(tf.random.stateless_normal([16, 16], seed=[3, 4]))
    body = lambda x: tf.nn.gelu(tf.matmul(x, w))  # noqa: E731
    wrapped = checkpointable(body, checkpoint=True)
    inputs = [tf.random.stateless_normal([8, 16], seed=[i, 0]) for i in range(4)]
    expected = [grads_of(body, [x], [w], "eager") for x in inputs]
    results, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(5):
                results[i] = grads_of(wrapped, [inputs[i]], [w], "eager")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want in zip(results, expected):
        assert_all_close(got, want)


def test_wrapping_keeps_name_doc_wrapped_and_signature():
    def block(x, y, some_str, some_bool, z=None):
        """Block docs."""
        return x

    wrapped = checkpointable(block)
    configured = checkpointable(checkpoint=True)(block)
    for w in (wrapped, configured):
        assert w.__name__ == "block" and w.__doc__ == "Block docs."
        assert w.__wrapped__ is block
        assert inspect.signature(w) == inspect.signature(block)


def test_methods_bound_and_decorated():
    class Model:
        def __init__(self):
            self.w = tf.Variable(2.0)
            self.calls = 0

        @checkpointable(checkpoint=True)
        def forward(self, x):
            self.calls += 1
            return x * self.w

    m = Model()
    bound = checkpointable(m.forward)
    x = tf.constant(3.0)
    for fn in (m.forward, bound):
        m.calls = 0
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x, _checkpoint=True)
        assert tape.gradient(y, [x, m.w]) == [2.0, 3.0]
        assert m.calls == 2
    assert inspect.signature(Model.forward) == inspect.signature(Model.forward.__wrapped__)


def test_wrapped_layer_is_still_the_layer_and_trains_in_a_subclassed_model():
    dense = keras.layers.Dense(4, name="inner")
    wrapped = checkpointable(dense, checkpoint=True)
    assert isinstance(wrapped, keras.layers.Layer) and wrapped.units == 4

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.block = wrapped
            self.head = keras.layers.Dense(1)

        def call(self, x):
            return self.head(self.block(x))

    net = Net()
    x = tf.ones([2, 3])
    net(x)
    assert len(wrapped.trainable_variables) == 2
    assert len(net.trainable_variables) == 4
    net.compile(optimizer="sgd", loss="mse")
    before = [v.numpy().copy() for v in dense.trainable_variables]
    net.fit(x, tf.ones([2, 1]), epochs=1, verbose=0)
    assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, dense.trainable_variables))


def test_decorated_layer_call_accepts_call_time_options(mode):
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)
            self.calls = 0

        @checkpointable
        def call(self, x, training=None):
            self.calls += 1
            return tf.nn.gelu(self.dense(x))

    layer = Block()
    x = tf.ones([2, 3])
    layer(x)
    layer.calls = 0
    ours = grads_of(lambda x: layer(x, _checkpoint=True), [x], layer.trainable_variables, mode)
    calls = layer.calls
    plain = grads_of(lambda x: layer(x), [x], layer.trainable_variables, mode)
    assert calls == 2 * (layer.calls - calls)
    assert_all_close(ours, plain)


def test_watch_vars_differentiates_a_non_trainable_variable():
    # A tape only sees trainable variables by itself; a non-trainable one the user
    # watches explicitly must be named in _watch_vars.
    v = tf.Variable(3.0, trainable=False)
    keras_var = keras.Variable(2.0)
    wrapped = checkpointable(lambda x: x * v * keras_var, checkpoint=True)
    x = tf.constant(2.0)
    with tf.GradientTape() as tape:
        tape.watch([x, v])
        y = wrapped(x, _watch_vars=[v, keras_var])
    gx, gv, gk = tape.gradient(y, [x, v, keras_var])
    assert (float(gx), float(gv), float(gk)) == (6.0, 4.0, 6.0)


class TestBadInput:
    def test_non_bool_checkpoint(self):
        wrapped = checkpointable(lambda x: x)
        with pytest.raises(TypeError, match=r"`_checkpoint`.*Python bool.*received 'yes'"):
            wrapped(tf.constant(1.0), _checkpoint="yes")
        with pytest.raises(TypeError, match=r"`_checkpoint`.*tensor cannot decide"):
            wrapped(tf.constant(1.0), _checkpoint=tf.constant(True))
        with pytest.raises(TypeError, match=r"`checkpoint`.*received 1"):
            checkpointable(lambda x: x, checkpoint=1)

    def test_non_variable_in_watch_vars(self):
        wrapped = checkpointable(lambda x: x, checkpoint=True)
        with pytest.raises(TypeError, match=r"`_watch_vars`.*received an item.*Tensor"):
            wrapped(tf.constant(1.0), _watch_vars=[tf.constant(2.0)])
        with pytest.raises(TypeError, match=r"`_watch_vars` must be an iterable.*received 3"):
            wrapped(tf.constant(1.0), _watch_vars=3)

    def test_not_callable(self):
        with pytest.raises(TypeError, match=r"`fn` must be a function.*received 42.*int"):
            checkpointable(42)

    @pytest.mark.parametrize("mode", ["eager", "graph"])
    def test_function_that_creates_layers_on_every_call(self, mode):
        def body(x):
            return keras.layers.Dense(2)(x)

        wrapped = checkpointable(body, checkpoint=True)
        with pytest.raises(ValueError, match=r"`.*body` created a new variable.*outside the func"):
            grads_of(wrapped, [tf.ones([1, 2])], [], mode)

    @pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
    def test_closed_over_tensor_that_needs_a_gradient(self, mode):
        w = tf.Variable(2.0)

        def step(x):
            with tf.GradientTape() as tape:
                scale = w * 3.0  # computed under the tape: its gradient reaches w
                y = checkpointable(lambda x: x * scale, checkpoint=True)(x)
            return tape.gradient(y, w)

        with pytest.raises(ValueError, match=r"uses a tensor it did not receive as an argument"):
            compile_step(step, mode)(tf.constant(1.0))

    def test_closed_over_constant_is_fine(self):
        scale = tf.constant(3.0)  # no tape watches it: nothing is lost
        wrapped = checkpointable(lambda x: x * scale, checkpoint=True)
        _, (grad,) = grads_of(wrapped, [tf.constant(1.0)], [], "eager")
        assert float(grad) == 2 * 3.0 * 3.0


def test_nested_checkpoints_give_exact_gradients_and_replay_the_inner_call(mode):
    w = tf.Variable([[0.5, -0.3], [0.2, 0.8]], name="w")
    inner_body = Counter(lambda x: tf.tanh(tf.matmul(x, w)))
    inner = checkpointable(inner_body, checkpoint=True)
    outer_body = Counter(lambda x: inner(inner(x) * 2.0) + x)
    outer = checkpointable(outer_body, checkpoint=True)
    x = tf.constant([[1.0, 2.0], [-1.0, 0.5]])
    plain = grads_of(lambda x: inner_body.fn(inner_body.fn(x) * 2.0) + x, [x], [w], mode)
    ours = grads_of(outer, [x], [w], mode)
    assert_all_close(ours, plain)
    # The outer body runs twice (forward, replay); inside the outer forward the
    # inner calls are plain (2 runs), inside the outer replay they are
    # checkpointed themselves (2 calls x forward and replay = 4 runs).
    assert outer_body.calls == 2 and inner_body.calls == 6


def test_forward_accumulator_gets_the_exact_jvp():
    wrapped = checkpointable(lambda x: tf.sin(x) * x, checkpoint=True)
    x, tangent = tf.constant([1.0, 2.0]), tf.constant([1.0, 0.5])
    with tf.autodiff.ForwardAccumulator(x, tangent) as acc:
        y = wrapped(x)
    np.testing.assert_allclose(acc.jvp(y), (tf.cos(x) * x + tf.sin(x)) * tangent, rtol=1e-6)


@pytest.mark.parametrize("quantization", ["int8", "float8", "int4"])
def test_a_quantized_layer_is_checkpointed(quantization, mode):
    """Keras runs ``quantized_call`` instead of ``call`` for a quantized layer; the
    wrapper checkpoints it too (the body runs again in backprop) and gradients are
    the plain twin's. (GPTQ and AWQ quantize for inference, from a calibration
    config: they run the same ``quantized_call``.)"""

    def quantized():
        keras.utils.set_random_seed(0)
        layer = keras.layers.Dense(8)
        layer.build((None, 16))
        layer.quantize(quantization)
        return layer

    x = tf.random.stateless_normal([4, 16], seed=[9, 9])
    plain = quantized()
    layer = checkpointable(quantized(), checkpoint=True)
    if quantization == "float8" and mode == "eager":
        # Keras' own float8 gradient fails eagerly (its custom gradient returns
        # no variable gradients); the checkpointed layer fails the same way.
        for fn in (plain, layer):
            with pytest.raises(ValueError, match="too many values to unpack"):
                grads_of(fn, [x], fn.trainable_variables, mode)
        return
    expected = grads_of(plain, [x], plain.trainable_variables, mode)
    runs = Counter(layer.__wrapped__.quantized_call)
    layer.__wrapped__.quantized_call = runs
    got = grads_of(layer, [x], layer.trainable_variables, mode)
    assert_all_close(got, expected, rtol=1e-4 if mode == "xla" else 1e-5)
    assert runs.calls == 2  # forward, and the replay in backprop
    for ours, theirs in zip(layer.variables, plain.variables):  # float8's scales, once
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, err_msg=ours.path)
