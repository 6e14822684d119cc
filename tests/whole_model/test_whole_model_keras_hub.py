"""A model nobody here wrote: keras_hub's ``GPT2Backbone`` (from its constructor,
random weights, dropout on), its transformer blocks checkpointed as regions of
the whole-model runner, one replayed under each save policy and one in full.
Gradients (the token embedding's sparse one included) and the dropout seed
state equal plain's under ``tf.function`` and XLA."""


import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, grads_of

import tf_checkpointing as tc
from tf_checkpointing import policies

keras_hub = pytest.importorskip("keras_hub")

SEQ = 16


def _gpt2():
    keras.utils.set_random_seed(0)
    model = keras_hub.models.GPT2Backbone(
        vocabulary_size=100, num_layers=3, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=SEQ, dropout=0.2)
    x = {"token_ids": tf.random.stateless_uniform([2, SEQ], [0, 1], 0, 100, tf.int32),
         "padding_mask": tf.ones([2, SEQ], tf.int32)}
    model(x)
    return model, x


def _run(model, x, mode):
    loss, grads = grads_of(lambda x: model(x, training=True), [x], model.trainable_variables,
                           mode)
    # grads[0]: the integer inputs' (None); the embedding's gradient is IndexedSlices.
    dense = [tf.convert_to_tensor(g) for g in grads[1:]]
    return loss, dense, [v.numpy() for v in model.variables]


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_gpt2_blocks_replayed_under_policies_equal_plain(mode):
    model, x = _gpt2()
    before = [v.numpy() for v in model.variables]
    plain = _run(model, x, mode)
    # The dropout seed generators are variables: put back, the masks are plain's.
    for variable, value in zip(model.variables, before):
        variable.assign(value)
    # Each block a region of its own, named as the planner reads the layer calls (no
    # profile: the regions are fixed here).
    plan = tc.ModelPlan.from_regions(
        model, [[f"transformer_layer_{i}"] for i in range(3)], mode=mode,
        policies=(policies.dots_saveable, policies.dots_with_no_batch_dims_saveable, None))
    assert len(plan.regions) == 3, str(plan)
    tc.apply_checkpointing(model, plan=plan)
    ours = _run(model, x, mode)
    assert_all_close(ours[0], plain[0])
    assert_all_close(ours[1], plain[1])
    assert_all_close(ours[2], plain[2])  # the seed generators advanced as plain's
    assert any(not np.array_equal(a, b) for a, b in zip(plain[2], before))
    if mode == "graph":  # the runner passed the policies: the blocks keep their products
        kept = tc.debug.saved_residuals(lambda x: model(x, training=True), x)
        assert any(r.why == "kept by the save policy" for r in kept), kept
