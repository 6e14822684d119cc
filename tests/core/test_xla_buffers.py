"""Under XLA, a replay stays a replay: read from XLA's own buffer assignment.

XLA may merge a replay into the forward (common-subexpression elimination: the
replay's ops are the forward's ops on the same values) or run it as soon as its
operands exist; either way the activations live until the backward and
checkpointing saves nothing, silently. Here the optimised HLO of a training step
(``XLA_FLAGS=--xla_dump_to=...``) must still hold the replay's matrix products,
one more per checkpointed layer than the plain step, and XLA's buffer for the
checkpointed step must be at most half of plain's, under both XLA:CPU
schedulers. (Replacing the arithmetic data edges with XLA's optimization
barrier fails both: XLA:CPU removes the barrier before its last CSE; see
docs/design.md#xlas-optimization-barrier.)

XLA ignores control edges: a replay's weight gradients are made before its input
gradients by data, except a frozen layer's, which no one asks for. (Convolutions'
filters and pools: test_xla_filters.py.)
"""

import textwrap

import pytest
from xla_dumps import STEPS, compile_scripts, matmuls, total_bytes

DEPTH = 12

SCRIPT = textwrap.dedent(f"""
    import keras, tensorflow as tf
    from tf_checkpointing import checkpointable

    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(128, activation="gelu") for _ in range({DEPTH})]
    for layer in layers:
        layer.build((None, 128))
    variables = [v for layer in layers for v in layer.trainable_variables]
    blocks = [checkpointable(layer) for layer in layers]
    x = tf.random.stateless_normal([1024, 128], seed=[0, 1])
    loss_of = tf.reduce_sum
""") + STEPS


def test_xla_keeps_each_replay_apart_from_the_forward(compiled):
    totals, dots = compiled.found("chain", total_bytes), compiled.found("chain", matmuls)
    found = {step: (totals[step], dots[step]) for step in ("plain", "checkpointed")}
    (plain_bytes, plain_dots), (ours_bytes, our_dots) = found["plain"], found["checkpointed"]
    # Forward, input and weight gradients: 3 per layer (the first needs no input gradient);
    # checkpointed adds the replay's: one per layer but the last, whose incoming gradient
    # (of a sum: ones) is a constant, so XLA may merge its replay, which the backward
    # needs first anyway. A replay merged into the forward takes its dot away.
    assert plain_dots == 3 * DEPTH - 1
    assert our_dots >= plain_dots + DEPTH - 1, found
    # TensorFlow 2.16's XLA ran the last layers' bias gradients at the end of the step,
    # holding their gradients (0.54x plain), until they were made first by data
    # (_weight_gradients.weight_gradients_first; docs/design.md#the-oldest-tensorflow).
    assert ours_bytes <= 0.5 * plain_bytes, found


# The chain of SCRIPT, its "plain" step traced with the replays' weight gradients
# ordered before their input gradients by control edges, which XLA ignores, and its
# "checkpointed" step as the package runs it under XLA: the input gradient reads the
# incoming gradient plus an opaque zero of the weight gradient
# (_weight_gradients.weight_gradients_first).
_CONTROL_EDGES_FIRST = textwrap.dedent("""
    from tf_checkpointing.core import _weight_gradients
    by_data = _weight_gradients._wait_by_data
    _weight_gradients._wait_by_data = (
        lambda other, gradient, op, *_: other._add_control_input(op))
    tf.function(plain_step, jit_compile=True)(x)
    _weight_gradients._wait_by_data = by_data
    tf.function(checkpointed_step, jit_compile=True)(x)
""")
WEIGHT_GRADIENTS_FIRST = (SCRIPT.split("for fn in (plain_step, checkpointed_step):")[0]
                          + _CONTROL_EDGES_FIRST)


def test_xla_makes_a_replays_weight_gradient_before_its_input_gradient(compiled):
    """Each replayed layer's input ``x`` is freed by its weight gradient, its last
    reader; made after the input gradient, ``x``, the incoming gradient and the
    input gradient are alive at once, and XLA ran the input gradients down the
    whole chain first, holding every replay's ``x``."""
    control, by_data = compiled.temporaries("weight_gradients_first")
    # TensorFlow 2.21: 0.28x (default scheduler) and 0.31x (the other one) the
    # temporaries of the same step with control edges.
    assert by_data <= 0.5 * control, (by_data, control)


# The top half of the chain frozen (Keras: `trainable = False`; TensorFlow still calls
# its variables trainable, so the tape hands the replay their gradients to make): a
# data edge from a frozen layer's weight gradient would make that unused product run.
FROZEN_HALF = SCRIPT.replace(
    "variables = [v for layer in layers for v in layer.trainable_variables]",
    "for layer in layers[len(layers) // 2:]:\n"
    "    layer.trainable = False\n"
    "variables = [v for layer in layers for v in layer.trainable_variables]")


def test_xla_runs_no_weight_gradient_of_a_frozen_layer(compiled):
    dots = compiled.found("frozen_half", matmuls)
    half = DEPTH // 2
    # Plain: the frozen half's forward and input gradients (2 each), the trainable
    # half's forward, input and weight gradients (3 each; the first layer makes no
    # input gradient). Checkpointed adds one replay per layer but the last (see
    # above); the frozen half's weight gradients (6 more) stay out.
    assert dots["plain"] == 2 * half + 3 * half - 1, dots
    assert dots["checkpointed"] == dots["plain"] + DEPTH - 1, dots


SCRIPTS = {"chain": SCRIPT, "weight_gradients_first": WEIGHT_GRADIENTS_FIRST,
           "frozen_half": FROZEN_HALF}


@pytest.fixture(scope="module", params=[True, False], ids=["default-scheduler", "other-scheduler"])
def compiled(request, tmp_path_factory):
    """Every script's steps, compiled in one process under one XLA:CPU scheduler."""
    return compile_scripts(tmp_path_factory.mktemp("xla-buffers"), request.param, SCRIPTS)
