"""Save policies: exact gradients, and kept ops absent from the backward's work."""

import dataclasses
import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close

from tf_checkpointing import checkpoint_name, checkpointable, policies
from tf_checkpointing.core._residuals import _executed  # the ops a tf.function runs
from tf_checkpointing.debug import saved_residuals

DOTS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")


class AttentionBlock(keras.layers.Layer):
    """Dense projection (named "proj"), per-batch q @ q^T and an einsum (batch
    dimensions), softmax, dropout, BatchNorm, a Dense MLP output (named "mlp_out")."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        init = keras.initializers.GlorotUniform(seed=3)
        self.proj = keras.layers.Dense(8, kernel_initializer=init, name="proj")
        self.out = keras.layers.Dense(8, kernel_initializer=init, name="out")
        self.drop = keras.layers.Dropout(0.3, seed=5)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        q = checkpoint_name(self.proj(x), "proj")
        scores = tf.nn.softmax(tf.matmul(q, q, transpose_b=True) / 3.0)
        h = tf.einsum("bij,bjd->bid", scores, q)
        h = self.norm(self.drop(h, training=training), training=training)
        return checkpoint_name(self.out(tf.nn.gelu(h)), "mlp_out") + x


def _keep_softmax(out):
    return out.op_type == "Softmax"


POLICIES = {
    "nothing": policies.nothing_saveable,
    "everything": policies.everything_saveable,
    "dots": policies.dots_saveable,
    "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
    "only_names": policies.save_only_these_names("proj", "mlp_out"),
    "except_names": policies.save_anything_except_these_names("proj"),
    "custom": _keep_softmax,
    "random": policies.random_saveable,
    "names_and_random": policies.save_from_both_policies(
        policies.save_only_these_names("mlp_out"), policies.random_saveable),
}


def _step(block, policy, checkpoint):
    call = checkpointable(block, checkpoint=checkpoint, policy=policy)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(call(x, training=True) ** 2)
        return loss, tape.gradient(loss, [x] + block.trainable_variables)

    return step


def _x():
    return tf.random.stateless_normal([2, 5, 8], seed=[1, 2])


@functools.cache
def _plain_run(mode):
    """(initial variables, plain step's results, variables after it) of a new
    AttentionBlock: the same for every block (seeded initializers and dropout), so
    computed once per mode."""
    block = AttentionBlock()
    block(_x())
    start = [v.numpy() for v in block.variables]
    plain = compile_step(_step(block, None, False), mode)(_x())
    return start, tf.nest.map_structure(np.asarray, plain), [v.numpy() for v in block.variables]


# Eager execution never asks a policy (_save_policies.Saver.active: it cannot
# substitute an op's outputs), so every policy replays fully there: one eager case.
@pytest.mark.parametrize("name, mode", [(name, mode) for name in sorted(POLICIES)
                                        for mode in ("graph", "xla")] + [("everything", "eager")])
def test_policy_matches_plain(name, mode):
    start, plain, plain_state = _plain_run(mode)
    block = AttentionBlock()
    block(_x())
    assert_all_close([v.numpy() for v in block.variables], start, rtol=0, atol=0)
    ours = compile_step(_step(block, POLICIES[name], True), mode)(_x())
    assert_all_close(ours, plain)
    # BatchNorm statistics and the dropout seed state: updated once, as plain.
    assert_all_close([v.numpy() for v in block.variables], plain_state)
    assert any(not np.array_equal(a, b) for a, b in zip(start, plain_state))


@functools.cache  # a new block each time (seeded): the plain count is shared
def _dot_count(policy, checkpoint):
    block = AttentionBlock()
    block(_x())
    graph = tf.function(_step(block, policy, checkpoint)).get_concrete_function(_x()).graph
    return sum(op.type in DOTS for op in _executed(graph))


@pytest.mark.parametrize("name, replayed", [
    ("nothing", 3), ("dots", 0), ("everything", 0), ("dots_no_batch", 2), ("only_names", 2),
])
def test_kept_ops_are_not_recomputed_in_the_graph(name, replayed):
    # The full replay recomputes 3 of the 4 products: the last one's output is
    # needed by no gradient, so TensorFlow prunes it even there.
    plain = _dot_count(None, False)
    assert plain == 4 * 3  # 4 forward products, 2 gradient products each
    assert _dot_count(POLICIES[name], True) == plain + replayed


@functools.cache  # a new block each time (seeded): plain's and a full replay's are shared
def _hlo_dots(policy, checkpoint):
    block = AttentionBlock()
    block(_x())
    step = tf.function(_step(block, policy, checkpoint), jit_compile=True)
    hlo = step.experimental_get_compiler_ir(_x())(stage="optimized_hlo")
    return len(re.findall(r"\bdot\(", hlo)) + len(re.findall(r"custom-call\(.*matmul", hlo))


def test_kept_ops_are_not_recomputed_under_xla():
    plain, nothing = _hlo_dots(None, False), _hlo_dots(None, True)
    assert nothing > plain  # the count sees a replay...
    assert _hlo_dots(policies.dots_saveable, True) == plain  # ...and none with dots kept


def test_convolutions_are_kept_by_dots_saveable():
    conv = keras.layers.Conv2D(4, 3, padding="same")
    x = tf.random.stateless_normal([2, 6, 6, 3], seed=[3, 3])
    conv(x)

    def count(policy, checkpoint):
        block = checkpointable(lambda x: tf.nn.relu(conv(tf.nn.relu(conv(x[..., :3])[..., :3]))),
                               checkpoint=checkpoint, policy=policy)

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(block(x) ** 2)
            return tape.gradient(loss, [x] + conv.trainable_variables)

        graph = tf.function(step).get_concrete_function(x).graph
        return sum(op.type.startswith("Conv2D") for op in _executed(graph))

    plain = count(None, False)
    assert count(None, True) == plain + 2
    assert count(policies.dots_saveable, True) == plain


def test_custom_policy_receives_the_documented_record():
    seen = []

    def policy(out):
        seen.append(out)
        return False

    block = AttentionBlock()
    block(_x())
    tf.function(_step(block, policy, True)).get_concrete_function(_x())
    assert all(isinstance(r, policies.OpOutput) for r in seen)
    named = {r.name: r for r in seen if r.name}
    assert set(named) == {"proj", "mlp_out"}
    assert named["proj"].op_type == "Identity" and named["proj"].shape == (2, 5, 8)
    assert named["proj"].dtype == tf.float32 and isinstance(named["proj"].op_name, str)
    einsum = next(r for r in seen if r.op_type == "Einsum")
    assert einsum.attrs["equation"] == b"bij,bjd->bid"
    assert einsum.input_shapes == ((2, 5, 5), (2, 5, 8))


def _record(op_type, input_shapes, equation=None):
    attrs = {} if equation is None else {"equation": equation}
    return policies.OpOutput(op_type, "op", None, tf.TensorShape([2, 2]), tf.float32,
                             tuple(tf.TensorShape(s) for s in input_shapes), 0, attrs)


@pytest.mark.parametrize("record, kept", [
    (_record("MatMul", [[4, 3], [3, 2]]), True),
    (_record("BatchMatMulV2", [[2, 4, 3], [3, 2]]), True),  # x @ kernel: broadcast only
    (_record("BatchMatMulV2", [[2, 4, 3], [2, 3, 2]]), False),  # a batch dimension
    (_record("Einsum", [[2, 4, 3], [3, 5]], "btd,df->btf"), True),
    (_record("Einsum", [[2, 4, 3], [2, 5, 3]], "bqd,bkd->bqk"), False),
    (_record("Conv2D", [[1, 4, 4, 1], [3, 3, 1, 1]]), False),
])
def test_dots_with_no_batch_dims_as_jax_defines_it(record, kept):
    assert policies.dots_with_no_batch_dims_saveable(record) is kept
    assert policies.dots_saveable(record) is True


def test_checkpoint_name_is_an_identity_outside_checkpointing():
    x = tf.constant([1.0, 2.0])
    assert checkpoint_name(x, "a") is x
    with pytest.raises(TypeError, match="`name` must be a str; received 3"):
        checkpoint_name(x, 3)


def test_call_time_policy_overrides_the_default():
    block = AttentionBlock()
    block(_x())
    call = checkpointable(block, checkpoint=False)

    def count(**options):
        def step(x):  # a training step: the input's and the weights' gradients
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(call(x, training=False, **options) ** 2)
            return tape.gradient(loss, [x] + block.trainable_variables)

        graph = tf.function(step).get_concrete_function(_x()).graph
        return sum(op.type in DOTS for op in _executed(graph))

    plain = count()
    assert count(_checkpoint=True) > plain
    assert count(_checkpoint=True, _policy=policies.dots_saveable) == plain


def test_not_a_policy_is_a_clear_error():
    with pytest.raises(TypeError, match=r"`policy` must be None or a save policy.*"
                                        r"received 'dots_saveable' of type str.*"
                                        r"policy=tf_checkpointing.policies.dots_saveable"):
        checkpointable(lambda x: x, policy="dots_saveable")
    f = checkpointable(lambda x: x * 2, checkpoint=True)
    x = tf.constant(1.0)
    with tf.GradientTape() as tape, pytest.raises(TypeError, match="`_policy`.*received 3"):
        tape.watch(x)
        f(x, _policy=3)
    with pytest.raises(TypeError, match="every name must be a str; received 1"):
        policies.save_only_these_names("a", 1)


def _sequential_dots(run):
    layers = [keras.layers.Dense(8, activation="gelu", kernel_initializer=keras.initializers
                                 .GlorotUniform(seed=k)) for k in range(4)]
    x = tf.random.stateless_normal([3, 8], seed=[2, 2])
    for layer in layers:
        layer.build((3, 8))
    variables = [v for layer in layers for v in layer.trainable_variables]

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)  # as a checkpointed call does: its replay differentiates x
            loss = tf.reduce_sum(run(layers, x) ** 2)
        return loss, tape.gradient(loss, [x] + variables)

    fn = tf.function(step)
    graph = fn.get_concrete_function(x).graph
    return sum(op.type == "MatMul" for op in _executed(graph)), fn(x)


def test_policy_on_checkpoint_sequential_and_checkpointed_sequential():
    from tf_checkpointing import CheckpointedSequential, checkpoint_sequential

    def plain(layers, x):
        for layer in layers:
            x = layer(x)
        return x

    n_plain, ref = _sequential_dots(plain)
    n_full, _ = _sequential_dots(lambda ls, x: checkpoint_sequential(ls, x, segments=4))
    n_dots, ours = _sequential_dots(lambda ls, x: checkpoint_sequential(
        ls, x, segments=4, policy=policies.dots_saveable))
    assert n_full > n_plain and n_dots == n_plain
    assert_all_close(ours, ref)
    seq = CheckpointedSequential([keras.layers.Dense(4)], segments=1,
                                 policy=policies.save_only_these_names("a"))
    again = CheckpointedSequential.from_config(seq.get_config())
    assert again.policy._config == ("save_only_these_names", ["a"])
    assert CheckpointedSequential.from_config(CheckpointedSequential(
        [keras.layers.Dense(4)], policy=policies.dots_saveable).get_config()
    ).policy is policies.dots_saveable


# Two single Dense layers of a small Sequential model: the selection warns that it
# saves little memory (tested in test_whole_model.py); here only the policy matters.
@pytest.mark.filterwarnings("ignore:apply_checkpointing. checkpointing these")
def test_policy_on_apply_checkpointing():
    from tf_checkpointing import apply_checkpointing

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="gelu"),
                              keras.layers.Dense(8, activation="gelu"), keras.layers.Dense(1)])
    x = tf.random.stateless_normal([3, 8], seed=[2, 2])

    def count():
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(model(x, training=True) ** 2)
            return tape.gradient(loss, [x] + model.trainable_variables)

        return sum(op.type == "MatMul"
                   for op in _executed(tf.function(step).get_concrete_function(x).graph))

    plain = count()
    hidden = lambda layer: getattr(layer, "units", 0) == 8  # noqa: E731
    apply_checkpointing(model, hidden)
    assert count() > plain
    apply_checkpointing(model, hidden, policy=policies.dots_saveable)
    assert count() == plain


@pytest.mark.parametrize("policy", [None, policies.dots_saveable,
                                    policies.save_anything_except_these_names("none")])
def test_nested_checkpoints_and_a_gradient_outside_the_function(policy, mode):
    w1 = tf.Variable(0.3 * tf.random.stateless_normal([8, 16], seed=[5, 1]))
    w2 = tf.Variable(0.3 * tf.random.stateless_normal([16, 8], seed=[5, 2]))
    inner = checkpointable(lambda x: tf.nn.gelu(x @ w1) @ w2, checkpoint=True, policy=policy)

    def block(x):
        return tf.tanh(inner(x)) @ tf.transpose(w2) @ w2

    outer = checkpointable(block, checkpoint=True, policy=policy)
    x = tf.random.stateless_normal([4, 8], seed=[5, 3])

    def grads(fn):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) ** 2)
            return [loss] + tape.gradient(loss, [x, w1, w2])

        return compile_step(step, mode)(x)

    # XLA fuses a replayed tanh/gelu otherwise than the plain graph's: the full
    # replay (policy None, the baseline) differs from plain by 2e-5 there too.
    rtol = 1e-4 if mode == "xla" else 1e-5
    assert_all_close(grads(outer), grads(block), rtol=rtol)
    # The forward traced in a tf.function, the gradient taken outside it.
    assert_all_close(grads(tf.function(outer)), grads(tf.function(block)), rtol=rtol)


def test_the_swap_makes_no_pass_over_kept_tensors_outside_xla():
    """Outside XLA a kept tensor waits for the replay's inputs by a control edge
    (an Identity): no element-wise op over it is added to the backward."""
    from tf_checkpointing.core import _residuals

    block = AttentionBlock()
    block(_x())
    graph = tf.function(_step(block, policies.dots_saveable, True)).get_concrete_function(
        _x()).graph
    swapped = [graph.get_operation_by_name(n) for n in _residuals.substitutions[graph]]
    assert len(swapped) == 5  # the 4 products and the dropout mask
    for op in swapped:
        assert op.type == "Identity" and op.control_inputs, op


@functools.cache  # a new block each time (seeded): the plain count is shared
def _draw_count(policy, checkpoint):
    from tf_checkpointing.core._draws import is_draw

    block = AttentionBlock()
    block(_x())
    graph = tf.function(_step(block, policy, checkpoint)).get_concrete_function(_x()).graph
    return sum(is_draw(op.type) for op in _executed(graph))


def _jax_dots(out):
    return policies.dots_saveable(out) and not out.random


@pytest.mark.parametrize("name, policy, redrawn", [
    ("nothing", None, True), ("jax_dots", _jax_dots, True), ("dots", policies.dots_saveable, False),
    ("dots_no_batch", policies.dots_with_no_batch_dims_saveable, False),
    ("random", policies.random_saveable, False),
])
def test_kept_dropout_masks_are_not_drawn_again(name, policy, redrawn):
    plain = _draw_count(None, False)
    assert plain == 2  # the dropout's key/counter and its uniform numbers
    assert _draw_count(policy, True) == plain * (2 if redrawn else 1)


def test_a_policy_is_asked_about_the_mask_not_the_numbers_it_is_made_of():
    asked = []

    def policy(out):
        asked.append(out)
        return False

    block = AttentionBlock()
    block(_x())
    tf.function(_step(block, policy, True)).get_concrete_function(_x())
    drawn = [(r.op_type, r.dtype) for r in asked if r.random]
    assert drawn == [("GreaterEqual", tf.bool)]  # uniform >= rate, 1 byte an element
    assert not any("Random" in r.op_type for r in asked)


def test_save_from_both_policies_keeps_either_and_round_trips_its_config():
    both = policies.save_from_both_policies(policies.save_only_these_names("a"),
                                            policies.random_saveable)
    record = _record("Identity", ())
    assert both(dataclasses.replace(record, name="a"))
    assert both(dataclasses.replace(record, random=True))
    assert not both(record)
    again = policies.from_config(policies.to_config(both))
    assert again.__name__ == both.__name__
    with pytest.raises(TypeError, match="argument `second` must be a save policy"):
        policies.save_from_both_policies(policies.dots_saveable, "random")


def test_name_policies_skip_their_ops_under_xla():
    """The swap survives XLA: keeping "proj" spares the replay its product (the
    "mlp_out" product is not replayed even without a policy: no gradient reads it)."""
    plain, nothing = _hlo_dots(None, False), _hlo_dots(None, True)
    assert _hlo_dots(POLICIES["only_names"], True) == nothing - 1 > plain


def _layout_step(policy, checkpoint, w, b):
    body = checkpointable(lambda x: tf.nn.gelu(tf.transpose(tf.nn.bias_add(x @ w, b))),
                          checkpoint=checkpoint, policy=policy)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(body(x) ** 2)
        return loss, tape.gradient(loss, [x, w, b])

    return step


def test_a_kept_product_read_only_by_bias_add_and_transpose_is_kept_after_them(mode):
    w = tf.Variable(tf.random.stateless_normal([8, 6], seed=[4, 1]))
    b = tf.Variable(tf.random.stateless_normal([6], seed=[4, 2]))
    x = tf.random.stateless_normal([5, 8], seed=[4, 3])
    plain = compile_step(_layout_step(None, False, w, b), mode)(x)
    assert_all_close(compile_step(_layout_step(policies.dots_saveable, True, w, b), mode)(x),
                     plain)

    def executed(policy, checkpoint):
        graph = tf.function(_layout_step(policy, checkpoint, w, b)).get_concrete_function(
            x).graph
        return sorted(op.type for op in _executed(graph)
                      if op.type in ("MatMul", "BiasAdd", "Transpose"))

    assert executed(None, True) != executed(None, False)  # a full replay redoes them
    assert executed(policies.dots_saveable, True) == executed(None, False)


class ConvNormBlock(keras.layers.Layer):
    """Convolution, BatchNorm, ReLU, LayerNorm: the statistics of both norms are
    reductions at most 1/16 of their inputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # No bias before a BatchNorm (as in ResNet): its gradient is zero up to rounding.
        self.conv = keras.layers.Conv2D(
            32, 3, padding="same", use_bias=False,
            kernel_initializer=keras.initializers.GlorotUniform(seed=4))
        self.batch_norm = keras.layers.BatchNormalization()
        self.layer_norm = keras.layers.LayerNormalization()

    def call(self, x, training=None):
        h = tf.nn.relu(self.batch_norm(self.conv(x), training=training))
        return self.layer_norm(h) + x


def _image():
    return tf.random.stateless_normal([4, 8, 8, 32], seed=[5, 6])


def _block_step(policy, checkpoint):
    block = ConvNormBlock()
    block(_image())
    return block, _step(block, policy, checkpoint)


def test_reductions_saveable_matches_plain(mode):
    block, plain_step = _block_step(None, False)
    start = [v.numpy() for v in block.variables]
    plain = compile_step(plain_step, mode)(_image())
    plain_state = [v.numpy() for v in block.variables]
    for v, value in zip(block.variables, start):
        v.assign(value)
    ours = compile_step(_step(block, policies.reductions_saveable, True), mode)(_image())
    assert_all_close(ours, plain)
    assert_all_close([v.numpy() for v in block.variables], plain_state)  # moving statistics
    assert any(not np.array_equal(a, b) for a, b in zip(start, plain_state))


def test_reductions_saveable_keeps_the_statistics_and_the_replay_skips_them():
    def means(policy, checkpoint):
        _, step = _block_step(policy, checkpoint)
        graph = tf.function(step).get_concrete_function(_image()).graph
        return sum(op.type == "Mean" for op in _executed(graph))

    plain = means(None, False)
    assert plain >= 4  # the batch and layer statistics: a mean and a variance each
    assert means(None, True) == plain + 4  # a full replay computes all four again
    assert means(policies.reductions_saveable, True) == plain


@pytest.mark.parametrize("op_type, shape, inputs, kept", [
    ("Mean", [1, 1, 1, 64], [[8, 32, 32, 64], [3]], True),   # BatchNorm's moments
    ("Mean", [8, 128, 1], [[8, 128, 256], [1]], True),        # LayerNorm's
    ("Sum", [8, 16], [[8, 16, 2], [1]], False),               # half its input: not small
    ("Max", [None, 1], [[None, 64], [1]], False),             # unknown size
    ("Softmax", [8, 1], [[8, 64]], False),                    # not a reduction
])
def test_reductions_saveable_keeps_small_reductions_only(op_type, shape, inputs, kept):
    record = policies.OpOutput(op_type, None, None, tf.TensorShape(shape), tf.float32,
                               tuple(tf.TensorShape(s) for s in inputs))
    assert policies.reductions_saveable(record) is kept


@pytest.mark.parametrize("policy", [policies.reductions_saveable, policies.dots_saveable])
def test_a_region_of_integer_inputs_keeps_only_the_policys_picks(policy):
    """A region whose only tensor inputs are integers (token ids: a model's
    embedding and first block) has no differentiable input for the kept tensors
    to wait on. They used to be substituted with no wait, so the ops computed from
    them and the weights alone (a LayerNorm's ``rsqrt(variance) * gamma``) were
    the forward's ops again, merged with them and held until the backward: on
    GPT2Backbone 26 MiB for the 9 MiB the policy keeps in the first block.
    They wait for the incoming gradient through the integer inputs, which the
    replay already makes wait for it."""
    emb, norm = keras.layers.Embedding(100, 64), keras.layers.LayerNormalization()
    dense = keras.layers.Dense(64)
    ids = tf.random.uniform([8, 32], 0, 100, tf.int32, seed=1)
    dense(norm(emb(ids)))

    def region(i):
        return tf.nn.gelu(dense(norm(emb(i))))

    def kept(fn, arg):
        return sorted((r.producer.rsplit("/", 1)[-1], r.bytes) for r in saved_residuals(fn, arg)
                      if r.kind == "activation" and r.bytes > 64)

    on_ids = kept(checkpointable(region, checkpoint=True, policy=policy), ids)
    # The same region from its embeddings (a float input, which always waited):
    # what the policy keeps there is what it may keep on the ids.
    on_floats = kept(checkpointable(lambda h: tf.nn.gelu(dense(norm(h))), checkpoint=True,
                                    policy=policy), emb(ids))
    assert on_floats, "the policy keeps something in this region"
    assert on_ids == on_floats


def test_a_region_of_integer_inputs_under_a_policy_matches_plain(mode):
    emb, norm = keras.layers.Embedding(100, 64), keras.layers.LayerNormalization()
    dense = keras.layers.Dense(64)
    ids = tf.random.uniform([8, 32], 0, 100, tf.int32, seed=1)
    dense(norm(emb(ids)))
    weights = emb.trainable_variables + norm.trainable_variables + dense.trainable_variables

    def region(i):
        return tf.nn.gelu(dense(norm(emb(i))))

    def step(fn):
        def run(i):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(fn(i) ** 2)
            return loss, tape.gradient(loss, weights)
        return compile_step(run, mode)

    plain = step(region)(ids)
    for policy in (policies.reductions_saveable, policies.dots_saveable):
        ours = step(checkpointable(region, checkpoint=True, policy=policy))(ids)
        assert_all_close([tf.convert_to_tensor(g) for g in ours[1]],
                         [tf.convert_to_tensor(g) for g in plain[1]])
        assert_all_close(ours[0], plain[0])
