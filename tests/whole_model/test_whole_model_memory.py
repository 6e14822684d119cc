"""Whole-model plans measured with the allocator, each in a fresh process.

A residual conv net (Conv-BN-ReLU blocks, 4 MiB activations) trained with a
``tf.function`` SGD step: a plan for a budget between the least and plain
peaks within 1.05x of its budget in the largest of three steps, its prediction
at most 15% below their median (the executor's op order on 2 cores moves a step's
peak by up to ~10% from step to step) and at most 30% above, and
the least memory below what checkpointing every layer, or every Activation,
gives.
"""

import json
import textwrap

import pytest
from helpers import STEP, run_script

SCRIPT = STEP + textwrap.dedent("""
    def make():
        keras.utils.set_random_seed(0)
        x = keras.Input((32, 32, 8))
        h = keras.layers.Conv2D(64, 3, padding="same")(x)
        for i in range(6):
            y = keras.layers.Conv2D(64, 3, padding="same")(h)
            y = keras.layers.BatchNormalization()(y)
            y = keras.layers.Activation("relu")(y)
            h = keras.layers.Add()([h, y])
        out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h))
        return keras.Model(x, out)

    x = tf.random.normal([16, 32, 32, 8])

    def peak(setup):
        model = make()
        model(x)
        setup(model)
        step = make_step(model)
        step(x)
        # The executor's op order moves a step's peak: three steps, each peak kept.
        return sorted(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(3)), model

    plans = {}

    def planned(budget):
        def setup(model):
            plans[budget] = tc.plan_model(model, x, budget=budget, mode="graph")
            tc.apply_checkpointing(model, plan=plans[budget])
        return setup

    def planned_halfway(model):
        # Planned on the model the least plan was made for (profiled once, as a second
        # budget of a user's model is), run on this model: another instance of the
        # same architecture, made and planned right before its steps.
        least = plans["min"]
        half = (least.min_budget_bytes + least.plain_peak_bytes) // 2
        plans["half"] = tc.plan_model(least_model, x, budget=half, mode="graph")
        tc.apply_checkpointing(model, plan=plans["half"])

    median = lambda peaks: peaks[1]  # noqa: E731
    result = {"plain": median(peak(lambda m: None)[0])}
    least_peaks, least_model = peak(planned("min"))
    result["min"] = median(least_peaks)
    half_peaks = peak(planned_halfway)[0]
    half = plans["half"].budget_bytes
    result["half"], result["half_largest"] = median(half_peaks), half_peaks[-1]
    result["half_budget"], result["half_predicted"] = half, plans["half"].predicted_peak_bytes
    result["every_layer"] = median(peak(lambda m: tc.apply_checkpointing(
        m, lambda layer: not isinstance(layer, keras.layers.InputLayer)))[0])
    result["activations"] = median(peak(lambda m: tc.apply_checkpointing(
        m, [keras.layers.Activation]))[0])
    print("RESULT", json.dumps(result))
""")


@pytest.mark.slow
def test_plans_keep_their_budget_and_the_least_beats_per_layer():
    out = run_script(SCRIPT)
    r = json.loads(out.split("RESULT", 1)[1])
    message = json.dumps({k: round(v / 2**20, 1) for k, v in r.items()})
    assert r["half_largest"] <= 1.05 * r["half_budget"], message
    # Within 15% below (the side that breaks a budget) and 30% above: the model
    # counts each replayed BatchNorm's backward temporaries alive at once, and the
    # 1.1x chunk factor is over on this net (the halfway plan was predicted at
    # 52.8 MiB and measured 44.0, its tensors 44.0, in some runs).
    assert -0.15 <= r["half_predicted"] / r["half"] - 1 <= 0.30, message
    assert r["min"] < r["half"] <= r["plain"], message
    assert r["min"] < r["every_layer"] and r["min"] < r["activations"], message


TOKENS_SCRIPT = STEP + textwrap.dedent("""
    from tf_checkpointing import plan_model
    from helpers import plan_of

    keras.utils.set_random_seed(0)
    ids = keras.Input((64,), batch_size=16, dtype="int32")
    h = keras.layers.Embedding(100, 64)(ids)
    for i in range(4):  # blocks that keep 16 MiB each for their backward
        y = keras.layers.Dense(1024, activation="relu")(h)
        h = keras.layers.Add()([h, keras.layers.Dense(64)(y)])
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    x = tf.random.uniform([16, 64], 0, 100, tf.int32)
    model(x)
    least = plan_model(model, x, budget="min", mode="graph")
    names = list(least.names)
    # The first region's inputs are all integer (the token ids): the embedding
    # and the first block; then one region per block.
    blocks = [i + 1 for i, n in enumerate(names) if n.startswith("add")]
    cuts = [0] + blocks
    plan = tc.ModelPlan.from_regions(model, [names[a:c] for a, c in zip(cuts, cuts[1:])])
    tc.apply_checkpointing(model, plan=plan)
    step = make_step(model)
    step(x)
    # The least of a few steps: the executor's op order moves the peak by a few MiB.
    peak = min(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(5))
    print("RESULT", json.dumps({"peak": peak, "block_kept": 16 * 64 * 1024 * 4}))
""")


@pytest.mark.slow
def test_a_region_with_only_integer_inputs_replays_when_its_gradient_arrives():
    # Before, the replay of a region whose inputs are all integer depended on no
    # gradient, so the executor ran it as the backward began, holding its block's
    # activations on top of the others' backward: 13.7 MiB, against 9.7 MiB once
    # the replay waits for its gradient (one block keeps 4 MiB).
    r = json.loads(run_script(TOKENS_SCRIPT).split("RESULT", 1)[1])
    assert r["peak"] < 3 * r["block_kept"], {k: v / 2**20 for k, v in r.items()}


TWO_OUTPUTS_SCRIPT = STEP + textwrap.dedent("""
    from tf_checkpointing import plan_model
    from helpers import plan_of

    keras.utils.set_random_seed(0)

    def block(h, name):  # keeps about 4 x 2 MiB for its backward
        for k in range(2):
            h = keras.layers.Conv2D(32, 3, padding="same", name=f"{name}_conv{k}")(h)
            h = keras.layers.Activation("relu", name=f"{name}_relu{k}")(h)
        return h

    x_in = keras.Input((32, 32, 32))
    skip = keras.layers.Conv2D(32, 1, name="a_skip")(x_in)  # the first region's first output
    # Region a makes the skip, then its block; region b is a block on a's last output;
    # the skip is read again only at the end, so its gradient comes first.
    h = block(skip, "a")
    h = block(h, "b")
    model = keras.Model(x_in, keras.layers.Add(name="out")([h, skip]))
    x = tf.random.normal([16, 32, 32, 32])
    model(x)
    names = list(plan_model(model, x, budget="min", mode="graph").names)
    cut = names.index("b_conv0")
    spans = ((0, cut, ()), (cut, names.index("out"), ()))
    tc.apply_checkpointing(model, plan=plan_of(tuple(names), spans))
    step = make_step(model)
    step(x)
    peak = min(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(3))
    print("RESULT", json.dumps({"peak": peak, "tensor": 16 * 32 * 32 * 32 * 4}))
""")


@pytest.mark.slow
def test_a_region_replays_when_all_its_output_gradients_arrived():
    # Region a returns the skip (read by the last layer, so its gradient comes
    # first) and its block's output. Before, its replay waited only for its first
    # output's gradient and ran during region b's replay, holding both blocks'
    # activations: 18.0 MiB, against 12.0 MiB once it waits for every gradient
    # (tensors of 2 MiB).
    r = json.loads(run_script(TWO_OUTPUTS_SCRIPT).split("RESULT", 1)[1])
    assert r["peak"] < 7.5 * r["tensor"], {k: v / 2**20 for k, v in r.items()}


OUTPUT_GRADIENT_SCRIPT = STEP + textwrap.dedent("""
    from helpers import plan_of

    keras.utils.set_random_seed(0)
    x_in = keras.Input((32, 32, 32))
    h = keras.layers.Conv2D(32, 3, padding="same")(x_in)
    h = keras.layers.BatchNormalization()(h)  # writes its statistics in the forward
    h = keras.layers.Activation("relu")(h)
    for i in range(8):  # later layers whose backward keeps 2 MiB tensors
        h = keras.layers.Conv2D(32, 3, padding="same")(h)
        h = keras.layers.Activation("relu")(h)
    model = keras.Model(x_in, h)
    x = tf.random.normal([16, 32, 32, 32])
    model(x)

    @tf.function
    def step(x):  # the gradient of the loss with respect to the output only
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            tape.watch(out)
            loss = tf.reduce_sum(out ** 2)
        return tape.gradient(loss, out)

    def peak():
        step(x)
        return min(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(3))

    plain = peak()
    names = tuple(layer.name for layer in model.layers[1:])
    tc.apply_checkpointing(model, plan=plan_of(names, ((0, 3, ()),)))
    step = tf.function(step.python_function)
    print("RESULT", json.dumps({"plain": plain, "region": peak(),
                                "tensor": 16 * 32 * 32 * 32 * 4}))
""")


@pytest.mark.slow
def test_a_gradient_that_needs_no_replay_runs_no_backward():
    # A gradient of the loss with respect to the model's output needs no layer's
    # backward, and the executor prunes them all. Before, the first region's
    # replay wrote the BatchNorm statistics (then put back): writes must run, so
    # the replay ran, and with it every later layer's backward that feeds its
    # output gradient: 20.0 MiB, against 4.0 MiB plain (tensors of 2 MiB).
    r = json.loads(run_script(OUTPUT_GRADIENT_SCRIPT).split("RESULT", 1)[1])
    assert r["region"] < r["plain"] + r["tensor"], {k: v / 2**20 for k, v in r.items()}


BATCHNORM_REPLAY = STEP + textwrap.dedent("""
    from tf_checkpointing.planning.measuring._requested import requested_peak
    from tf_checkpointing.planning._constants import CHUNKS
    from tf_checkpointing.planning.solving import _model_profile

    keras.utils.set_random_seed(0)
    x = keras.Input((32, 32, 8))
    h = x
    for i in range(4):  # MobileNetV2's shape: a 6x expansion, its BatchNorm, a projection
        y = keras.layers.Conv2D(48, 1)(h)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.ReLU()(y)
        y = keras.layers.Conv2D(8, 1)(y)
        h = keras.layers.BatchNormalization()(y)
    model = keras.Model(x, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h)))
    data = tf.random.normal([32, 32, 32, 8])
    model(data)
    plan = tc.plan_model(model, data, budget="min", mode="graph")
    tc.apply_checkpointing(model, plan=plan)
    step = make_step(model)
    step(data)
    tensors = [requested_peak(lambda: step(data).numpy()) for _ in range(12)]
    (_, profile, _), = _model_profile._profiles.values()
    batchnorms = [dict(output=profile.boundary_bytes[i + 1], alone=p.backward_alone_bytes,
                       above_kept=p.backward_peak_bytes)
                  for i, p in enumerate(profile.layers) if "batch_norm" in p.name]
    print("RESULT", json.dumps(dict(model=plan.predicted_peak_bytes / CHUNKS,
                                    tensors=tensors, batchnorms=batchnorms)))
""")


@pytest.mark.slow
def test_the_least_plan_predicts_its_tensors_where_batchnorm_backward_peaks():
    # A replayed BatchNorm's output is freed before its backward makes three
    # temporaries its size; read above its kept output, MobileNetV2's least plan
    # was predicted 13-19% low (96 MiB against 123). The profile must read that
    # backward on its own (two temporaries above what it keeps, the freed output
    # the third: test_regions checks the model adds them). The executor's order
    # moves this plan's peak between processes (28.3, 29.4, 32.5, 34.6, 40.9 MB
    # seen) and the profile's readings move the prediction (30.5-36.2 MB), so the
    # prediction is only bounded by the best order's step and 1.25x the worst.
    r = json.loads(run_script(BATCHNORM_REPLAY).split("RESULT", 1)[1])
    summary = {k: v for k, v in r.items() if k != "batchnorms"}
    wide = [bn for bn in r["batchnorms"] if bn["output"] > 4 * 2**20]
    assert len(wide) == 4, r["batchnorms"]
    for bn in wide:
        assert bn["alone"] >= 1.9 * bn["output"], r["batchnorms"]
    assert min(r["tensors"]) <= r["model"] <= 1.25 * max(r["tensors"]), summary


WEIGHTS_SCRIPT = STEP + textwrap.dedent("""
    keras.utils.set_random_seed(0)
    x_in = keras.Input((256,))
    h = x_in
    for i in range(4):  # 4 MiB kernels, 32 KiB activations
        h = keras.layers.Dense(1024, activation="relu", name=f"dense{i}")(h)
    model = keras.Model(x_in, keras.layers.Dense(1, name="head")(h))
    x = tf.random.normal([8, 256])
    model(x)
    plan = tc.plan_model(model, x, budget="min", mode="graph")
    tc.apply_checkpointing(model, plan=plan)
    step = make_step(model)
    step(x)
    peaks = sorted(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(5))
    print("RESULT", json.dumps({"predicted": plan.predicted_peak_bytes, "median": peaks[2],
                                "kernel": 1024 * 1024 * 4}))
""")


@pytest.mark.slow
def test_a_plan_counts_the_weight_an_update_copies():
    # A step updates a weight as soon as its gradient exists, while the input
    # gradient may still read the weight's value, so the update copies the
    # weight: a 4 MiB kernel beside its 4 MiB gradient, 8 MiB. Before the planner
    # counted that copy, it predicted 4.6 MiB for a step measured at 12.1 (median
    # of 5); now 6-8 (its profile's readings vary). Steps measure 8-12 MiB: how
    # many layers' gradients and copies overlap is the executor's choice, which
    # the planner does not model, so only the floor is asserted.
    r = json.loads(run_script(WEIGHTS_SCRIPT).split("RESULT", 1)[1])
    message = {k: round(v / 2**20, 2) for k, v in r.items()}
    assert r["predicted"] >= 1.5 * r["kernel"], message
    assert r["median"] >= 2 * r["kernel"], message  # the copy is there to count
