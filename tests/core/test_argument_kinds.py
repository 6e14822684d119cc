"""Every kind of argument and output: exact gradients against the plain call, or
a clear error. Composite tensors, dataclasses, complex and integer-only calls,
NumPy arrays and Python scalars (issue 10, cases 1, 7, 8, 9)."""

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import Counter, assert_all_close

from tf_checkpointing import checkpointable


def _plain_and_checkpointed(body, inputs, mode, loss_of=None, sources=None):
    """(plain, checkpointed) results of ``step`` in ``mode``: the loss and the
    gradients with respect to ``sources(inputs)`` (default: the inputs) and w."""
    wrapped = checkpointable(body, checkpoint=True)
    sources = sources or (lambda xs: xs)
    loss_of = loss_of or (lambda out: tf.add_n([
        tf.reduce_sum(tf.abs(t) ** 2) for t in tf.nest.flatten(out, expand_composites=True)
        if t.dtype.is_floating or t.dtype.is_complex]))

    def make(fn):
        def step(*xs):
            with tf.GradientTape() as tape:
                tape.watch(sources(xs))
                loss = loss_of(fn(*xs))
            return loss, tape.gradient(loss, sources(xs))
        return compile_step(step, mode)

    return make(body)(*inputs), make(wrapped)(*inputs)


@dataclasses.dataclass
class Pair:
    hidden: Any
    extra: Any
    note: str = "pair"


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: Any
    derived: Any = dataclasses.field(init=False, default=None)


def test_dataclass_outputs_and_arguments_get_exact_gradients(mode):
    w = tf.Variable([[1.0, -2.0], [0.5, 3.0]], name="w")
    body = Counter(lambda p: Pair(tf.tanh(tf.matmul(p.hidden, w)), [p.extra * 2.0, None]))
    x, e = tf.constant([[0.3, -0.7]]), tf.constant([1.5, 2.5])
    plain, ours = _plain_and_checkpointed(
        lambda x, e: body(Pair(x, e)), [x, e], mode,
        loss_of=lambda p: tf.reduce_sum(p.hidden ** 2) + tf.reduce_sum(p.extra[0] ** 3))
    assert_all_close(ours, plain)
    assert ours[1][0] is not None and ours[1][1] is not None

    def loss_with_w(fn):
        def step(x):
            with tf.GradientTape() as tape:
                out = fn(Pair(x, x))
                loss = tf.reduce_sum(out.hidden) + tf.reduce_sum(out.extra[0])
            return tape.gradient(loss, w)
        return compile_step(step, mode)(x)

    assert_all_close(loss_with_w(checkpointable(body, checkpoint=True)), loss_with_w(body))


def test_frozen_dataclass_with_an_init_false_field_is_rebuilt():
    def body(x):
        out = Frozen(x * 3.0)
        object.__setattr__(out, "derived", tf.sin(x))
        return out

    x = tf.constant([0.2, 0.4])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        out = checkpointable(body, checkpoint=True)(x)
        loss = tf.reduce_sum(out.value) + tf.reduce_sum(out.derived)
    assert isinstance(out, Frozen)
    assert_all_close(tape.gradient(loss, x), 3.0 + tf.cos(x))


class Holder:
    def __init__(self, tensor):
        self.tensor = tensor


def test_an_object_holding_tensors_is_refused_naming_its_type(mode):
    wrapped = checkpointable(lambda x: Holder(x * 2.0), checkpoint=True)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = wrapped(x)
        return tape.gradient(out.tensor, x)

    with pytest.raises(TypeError, match=r"test_argument_kinds\.Holder.*\['tensor'\].*dataclass"):
        compile_step(step, mode)(tf.constant([1.0]))


def test_namedtuple_outputs_keep_their_type(mode):
    class Out(NamedTuple):
        a: Any
        b: Any

    plain, ours = _plain_and_checkpointed(
        lambda x: Out(tf.sin(x), [tf.cos(x)]), [tf.constant([0.1, 0.9])], mode)
    assert_all_close(ours, plain)


def test_ragged_tensor_arguments_and_outputs(mode):
    values = tf.constant([0.5, -1.0, 2.0, 0.25])
    splits = tf.constant([0, 1, 4], dtype=tf.int64)
    body = Counter(lambda rt: (rt * rt + 1.0, tf.reduce_sum(tf.sin(rt), axis=1)))
    wrapped = checkpointable(body, checkpoint=True)

    def call(fn):
        return lambda v: fn(tf.RaggedTensor.from_row_splits(v, splits))

    outcome = _same_outcome(lambda: compile_step(_ragged_step(call(body)), mode)(values),
                            lambda: compile_step(_ragged_step(call(wrapped)), mode)(values))
    assert body.calls == (3 if outcome == "ran" else body.calls)  # plain, forward, replay


def _same_outcome(plain_run, checkpointed_run):
    """Both give the same results, or (where TensorFlow cannot run the plain step,
    e.g. sparse ops under XLA) both raise the same error type."""
    try:
        plain = plain_run()
    except tf.errors.InvalidArgumentError as plain_error:
        with pytest.raises(type(plain_error)):
            checkpointed_run()
        return "raised"
    assert_all_close(checkpointed_run(), plain)
    return "ran"


def _ragged_step(fn):
    def step(values):
        with tf.GradientTape() as tape:
            tape.watch(values)
            rt, sums = fn(values)
            loss = tf.reduce_sum(rt.flat_values ** 2) + tf.reduce_sum(sums)
        return loss, tape.gradient(loss, values)
    return step


def test_sparse_tensor_argument_and_output(mode):
    indices = tf.constant([[0, 1], [2, 0]], dtype=tf.int64)

    def body(sp, dense):
        product = tf.sparse.sparse_dense_matmul(sp, dense)
        return product, sp.with_values(sp.values * 3.0)

    def call(fn):
        return lambda v, d: fn(tf.SparseTensor(indices, v, [3, 2]), d)

    def loss_of(out):
        return tf.reduce_sum(out[0] ** 2) + tf.reduce_sum(out[1].values ** 2)

    inputs = [tf.constant([1.5, -2.0]), tf.constant([[1.0, 2.0], [3.0, 4.0]])]
    _compare(body, call, loss_of, inputs, mode)


def _compare(body, call, loss_of, inputs, mode):
    wrapped = checkpointable(body, checkpoint=True)
    _same_outcome(lambda: _step(call(body), loss_of, mode)(*inputs),
                  lambda: _step(call(wrapped), loss_of, mode)(*inputs))


def _step(fn, loss_of, mode):
    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = loss_of(fn(*xs))
        return loss, tape.gradient(loss, xs)
    return compile_step(step, mode)


def test_indexed_slices_argument(mode):
    def body(slices):
        return tf.reduce_sum(tf.sin(slices.values), axis=1) * tf.cast(slices.indices, tf.float32)

    def call(fn):
        return lambda v: fn(tf.IndexedSlices(v, tf.constant([0, 2]), tf.constant([4, 3])))

    inputs = [tf.constant([[0.1, 0.2, 0.3], [1.0, 2.0, 3.0]])]
    loss_of = lambda out: tf.reduce_sum(out ** 2)  # noqa: E731
    _compare(body, call, loss_of, inputs, mode)


class Scaled(tf.experimental.ExtensionType):
    values: tf.Tensor
    scale: tf.Tensor


def test_extension_type_argument_and_output(mode):
    def body(s):
        return Scaled(tf.tanh(s.values) * s.scale, s.scale + 1.0)

    def call(fn):
        return lambda v, k: fn(Scaled(v, k))

    def loss_of(out):
        return tf.reduce_sum(out.values ** 2) + out.scale ** 2

    inputs = [tf.constant([0.3, -0.8]), tf.constant(1.7)]
    _compare(body, call, loss_of, inputs, mode)


def test_variables_reach_the_function_whole(mode):
    v = tf.Variable([1.0, 2.0], name="v")

    def body(x, var):
        assert isinstance(var, tf.Variable)
        return x * var

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(checkpointable(body, checkpoint=True)(x, v) ** 2)
        return tape.gradient(loss, [x, v])

    x = tf.constant([3.0, 4.0])
    assert_all_close(compile_step(step, mode)(x), [2 * x * v ** 2, 2 * x ** 2 * v])


@pytest.mark.parametrize("dtype", [tf.complex64, tf.complex128])
def test_complex_dtypes(mode, dtype):
    w = tf.Variable(tf.cast(tf.complex(tf.constant([0.5, -1.0]), tf.constant([2.0, 0.3])),
                            dtype), name="w")
    x = tf.cast(tf.complex(tf.constant([1.0, 2.0]), tf.constant([-0.5, 0.25])), dtype)

    def run(fn):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.abs(fn(x)) ** 2)
            return loss, tape.gradient(loss, [x, w])
        return compile_step(step, mode)(x)

    body = lambda x: tf.exp(x * w) * x  # noqa: E731
    assert_all_close(run(checkpointable(body, checkpoint=True)), run(body))


def test_integer_only_calls_run(mode):
    count = tf.Variable(0, name="count")

    def step(n):
        with tf.GradientTape():
            doubled = checkpointable(lambda n: n * 2, checkpoint=True)(n)
            seven = checkpointable(lambda: tf.constant(7), checkpoint=True)()
            count.assign_add(1)
            counted = checkpointable(lambda: count + 0, checkpoint=True)()
        return doubled, seven, counted

    doubled, seven, counted = compile_step(step, mode)(tf.constant(21))
    assert (int(doubled), int(seven), int(counted)) == (42, 7, 1)


def test_float_output_without_float_input_gets_variable_gradients(mode):
    w = tf.Variable([1.5, -0.5], name="w")

    def step(n):
        with tf.GradientTape() as tape:
            out = checkpointable(lambda n: tf.cast(n, tf.float32) * w ** 2, checkpoint=True)(n)
        return tape.gradient(out, w)

    assert_all_close(compile_step(step, mode)(tf.constant(3)), 6.0 * w)


def test_numpy_arrays_and_python_scalars_reach_the_function_unchanged(mode):
    seen = []

    def body(x, array, scalar, flag):
        seen.append((type(array), type(scalar), type(flag)))
        return x * float(array.sum()) * scalar

    wrapped = checkpointable(body, checkpoint=True)
    array = np.array([1.0, 2.0], dtype=np.float32)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wrapped(x, array, 2.0, True)
        return tape.gradient(y, x)

    assert_all_close(compile_step(step, mode)(tf.constant(1.0)), 6.0)
    assert set(seen) == {(np.ndarray, float, bool)}


def test_an_eager_tensor_array_argument_gets_an_error_that_names_it():
    x = tf.constant([0.3, -0.2])
    with tf.GradientTape() as tape:
        tape.watch(x)
        array = tf.TensorArray(tf.float32, size=2).write(0, x).write(1, x * 2.0)
        with pytest.raises(ValueError, match=r"argument of type TensorArray.*ta\.stack\(\)"):
            checkpointable(lambda ta: tf.sin(ta.stack()), checkpoint=True)(array)


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_tensor_arrays_in_graphs_get_exact_gradients(mode):
    def run(fn):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                array = tf.TensorArray(tf.float32, size=2).write(0, x).write(1, x * 2.0)
                out = fn(lambda ta, x: (tf.sin(ta.stack()), ta.write(0, ta.read(1) * x)))(array, x)
                loss = tf.reduce_sum(out[0]) + tf.reduce_sum(out[1].stack() ** 2)
            return loss, tape.gradient(loss, x)
        return compile_step(step, mode)(tf.constant([0.3, -0.2]))

    assert_all_close(run(lambda f: checkpointable(f, checkpoint=True)), run(lambda f: f))


def test_attrs_classes_are_flattened_by_tf_nest(mode):
    attr = pytest.importorskip("attr")  # in the `test` extra; skipped only without it

    @attr.s(frozen=True)
    class Out:
        hidden = attr.ib()
        extra = attr.ib()

    plain, ours = _plain_and_checkpointed(
        lambda x: Out(tf.sin(x), {"twice": x * 2.0}), [tf.constant([0.1, 0.9])], mode,
        loss_of=lambda out: tf.reduce_sum(out.hidden ** 2) + tf.reduce_sum(out.extra["twice"]))
    assert_all_close(ours, plain)


def test_an_argument_object_holding_watched_tensors_is_named_in_the_error(mode):
    wrapped = checkpointable(lambda holder: tf.sin(holder.tensor), checkpoint=True)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wrapped(Holder(x * 2.0))
        return tape.gradient(y, x)

    with pytest.raises(ValueError, match=r"argument of type Holder.*dataclass"):
        compile_step(step, mode)(tf.constant([1.0]))


@pytest.mark.parametrize("build", ["row_lengths", "row_splits", "ragged_constant", "argument"])
def test_what_plain_xla_compiles_on_ragged_tensors_compiles_checkpointed(build):
    """XLA needs a ragged tensor's row partition as a compile-time constant; a
    checkpointed call must not turn it into a runtime input."""
    values = tf.constant([0.5, -1.0, 2.0, 0.25, 1.5, -0.5])
    body = lambda rt: tf.reduce_sum(tf.sin(rt) * 2.0, axis=1)  # noqa: E731

    def ragged(v):
        if build == "row_lengths":
            return tf.RaggedTensor.from_row_lengths(v, tf.constant([2, 3, 1], tf.int64))
        if build == "row_splits":
            return tf.RaggedTensor.from_row_splits(v, [0, 2, 5, 6])
        return tf.ragged.constant([[1.0, 2.0], [3.0, 4.0, 5.0], [6.0]]) * v[0]

    def step(fn):
        @tf.function(jit_compile=True)
        def run(v, rt=None):
            with tf.GradientTape() as tape:
                tape.watch(v)
                x = ragged(v) if rt is None else rt.with_flat_values(rt.flat_values * v)
                loss = tf.reduce_sum(fn(x) ** 2)
            return loss, tape.gradient(loss, v)
        return run

    given = (tf.RaggedTensor.from_row_lengths(values, [2, 3, 1]),) if build == "argument" else ()
    assert_all_close(step(checkpointable(body, checkpoint=True))(values, *given),
                     step(body)(values, *given))
