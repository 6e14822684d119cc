"""Plans for an XLA step (``jit_compile=True``) measured with the allocator, each
in a fresh process.

XLA keeps buffers that do not shrink with checkpointing (the weights transposed
for the backward convolutions, a MaxPool gradient's indices), so a plan for an
XLA step is anchored at the measured XLA steps of the plain and the least plan
(``planning/solving/_xla.py``); and a CPU reading of an XLA step is one large buffer,
which the BFC allocator would count as the whole region it opens, so the first
measurement grows the CPU pool (``_memory.grow_cpu_pool``). Each plan, the
least and one halfway to plain, must peak within 1.05x of its budget: a budget
plan's the budget it was made for, the least plan's the smallest budget it reports
(XLA's, measured).
"""

import json
import os
import subprocess
import sys
import textwrap

from helpers import REPO

MIB = 2**20

# A conv net with a MaxPool (whose XLA gradient keeps index tensors), then
# Conv-BN-ReLU layers; 4 MiB activations.
LAYERS = textwrap.dedent("""
    import json
    import keras, tensorflow as tf
    import tf_checkpointing as tc

    tc.debug.measure(lambda: None).peak_bytes  # the first measurement grows the CPU pool

    def layers():
        keras.utils.set_random_seed(0)
        out = [keras.layers.Conv2D(64, 3, padding="same"),
               keras.layers.MaxPooling2D(3, 1, padding="same")]
        for _ in range(6):
            out += [keras.layers.Conv2D(64, 3, padding="same"),
                    keras.layers.BatchNormalization(), keras.layers.Activation("relu")]
        return out

    x = tf.random.normal([16, 32, 32, 8])

    def xla_peak(model):
        from helpers import sgd_step  # tests/ is on the scripts' path

        step = sgd_step(model, jit_compile=True)
        step(x)  # traced (and planned) outside the measurement
        return tc.debug.measure(lambda: step(x).numpy()).peak_bytes
""")

MODEL = LAYERS + textwrap.dedent("""
    def make():
        inputs = keras.Input((32, 32, 8))
        h = inputs
        for layer in layers():
            h = layer(h)
        model = keras.Model(inputs, h)
        model(x)
        return model

    # One model (profiled once); applying a plan replaces the one applied before. Each
    # plan is run right after it is made, as in a user's process: the steps the
    # planner measures for the next budget free chunks of their own sizes, which the
    # BFC allocator hands out whole to a request of more than half their size (the
    # least plan's 33.5 MiB buffer read 41.7-45.4 MiB after the halfway plan's 43.6).
    model = make()
    least = tc.plan_model(model, x, budget="min", mode="xla")
    result = {}
    for name in ("min", "half"):
        plan = least if name == "min" else tc.plan_model(
            model, x, budget=(least.min_budget_bytes + least.plain_peak_bytes) // 2, mode="xla")
        tc.apply_checkpointing(model, plan=plan)
        result[name] = (xla_peak(model), plan.min_budget_bytes if plan.budget_bytes == "min"
                        else plan.budget_bytes)
    print(json.dumps(result))
""")

CHAIN = LAYERS + textwrap.dedent("""
    chain, budget, result = layers(), "min", {}
    for name in ("min", "half"):
        # Planned while the jit_compile=True step is traced: for XLA. The same
        # layers both times, so the second plan reuses the first one's profile.
        body = tc.CheckpointedSequential(chain, budget=budget)
        model = keras.Sequential([keras.Input((32, 32, 8), batch_size=16), body])
        peak = xla_peak(model)
        result[name] = (peak, body.plan.min_budget_bytes if budget == "min" else budget,
                        body.plan.profile.xla)
        budget = (body.plan.min_budget_bytes + body.plan.plain_peak_bytes) // 2
    print(json.dumps(result))
""")

GROWN = textwrap.dedent("""
    import json
    import tensorflow as tf
    import tf_checkpointing as tc

    # One 70 MiB tensor: a fresh pool would open a 128 MiB region for it, whole.
    peak = tc.debug.measure(lambda: tf.reduce_sum(tf.zeros([70 * 2**18]))).peak_bytes
    print(json.dumps(peak))
""")


def _run(script: str) -> object:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_large_allocation_is_counted_at_its_size_not_its_region():
    peak = _run(GROWN)
    assert 70 * MIB <= peak < 72 * MIB, peak / MIB


def test_whole_model_xla_plans_peak_within_their_budgets():
    result = _run(MODEL)
    for name, (peak, budget) in result.items():
        assert peak <= 1.05 * budget, (name, peak / MIB, budget / MIB)


def test_chain_xla_plans_peak_within_their_budgets():
    result = _run(CHAIN)
    for name, (peak, budget, xla) in result.items():
        assert xla, name  # planned for the XLA step it runs in
        assert peak <= 1.05 * budget, (name, peak / MIB, budget / MIB)
