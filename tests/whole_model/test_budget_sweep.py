"""Budgets swept from the least to plain's peak, each plan measured (issue 50).

PyTorch's ``activation_memory_budget`` is the warning: its peak is not monotonic
in the budget (a lower budget has measured 4x higher). Here ten budgets, from the
least a plan needs to plain's peak, are planned on one profile (the model's
profile is cached; only the program runs again) and each plan's ``tf.function``
step is measured with the allocator: each peak at most 1.05x its budget, and a
lower budget never measures above a higher one's by more than 2% (the
executor's op order moves a step's peak by a few percent; the largest of three
steps is compared).
"""

import json
import textwrap

import pytest
from helpers import STEP, run_script

SCRIPT = STEP + textwrap.dedent("""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 8))
    h = keras.layers.Conv2D(32, 3, padding="same")(inputs)
    for i in range(6):
        y = keras.layers.Conv2D(32, 3, padding="same")(h)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.Activation("relu")(y)
        h = keras.layers.Add()([h, y])
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h)))
    x = tf.random.normal([8, 32, 32, 8])
    model(x)

    def peaks(plan):
        tc.apply_checkpointing(model, plan=plan)
        step = make_step(model)
        step(x)
        return sorted(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(3))

    least = tc.plan_model(model, x, budget="min", mode="graph")
    low, high = least.min_budget_bytes, least.plain_peak_bytes
    rows = []
    for k in range(10):
        budget = int(high - (high - low) * k / 9)
        plan = tc.plan_model(model, x, budget=budget, mode="graph")
        rows.append({"budget": budget, "peaks": peaks(plan), "regions": len(plan.regions),
                     "predicted": plan.predicted_peak_bytes})
    print("RESULT", json.dumps({"least": low, "plain": high, "rows": rows}))
""")


@pytest.mark.slow
def test_measured_peaks_fall_with_the_budget_and_stay_within_it():
    r = json.loads(run_script(SCRIPT).split("RESULT", 1)[1])
    rows = r["rows"]
    table = "\n".join(f"budget {row['budget'] / 2**20:6.2f} MiB: peaks "
                      f"{[round(p / 2**20, 2) for p in row['peaks']]}, "
                      f"{row['regions']} regions, predicted {row['predicted'] / 2**20:.2f}"
                      for row in rows)
    assert r["least"] < r["plain"], table
    assert any(row["regions"] for row in rows), table  # checkpointing took place
    for row in rows:
        assert row["peaks"][-1] <= 1.05 * row["budget"], table
    # The largest of three steps, the peak a user provisions for (the median of
    # three is bimodal on steps this small: 16.0 and 17.5 MiB in one run).
    largest = [row["peaks"][-1] for row in rows]  # budgets fall down the list
    for k in range(1, len(rows)):
        assert largest[k] <= 1.02 * min(largest[:k]), table
    # The least plan keeps clearly less than plain's plan.
    assert largest[-1] < 0.8 * largest[0], table
