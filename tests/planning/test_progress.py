"""A planning that takes a while says what it measures on stderr; a short one is silent."""

import keras
import tensorflow as tf
from helpers import residual_net

import tf_checkpointing as tc
from tf_checkpointing.planning.measuring import _progress


def test_a_long_planning_tells_what_it_measures(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "FIRST_AFTER", 0.0)
    monkeypatch.setattr(_progress, "EVERY", 0.0)
    keras.utils.set_random_seed(0)
    model = residual_net(count=False)
    tc.plan_model(model, tf.random.stateless_normal([2, 8, 8, 3], [0, 1]), budget="min",
                  mode="graph")
    lines = capsys.readouterr().err.splitlines()
    calls = len(model.layers) - 1
    assert any(line.startswith(f"plan_model: planning `{model.name}`: measuring layer calls 1/")
               for line in lines), lines
    assert any(f"measuring layer calls {calls}/{calls}" in line for line in lines), lines
    # One long measurement, with nothing to count: said when it starts.
    assert f"plan_model: planning `{model.name}`: measuring the plain step (" in "\n".join(
        lines), lines
    assert lines[-1].startswith(f"plan_model: planning `{model.name}`: done (")


def test_a_short_planning_prints_nothing(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "FIRST_AFTER", 1e9)  # "short", whatever the machine's load
    keras.utils.set_random_seed(0)
    tc.plan_model(residual_net(count=False), tf.random.stateless_normal([2, 8, 8, 3], [0, 1]),
                  budget="min", mode="graph")
    assert "planning" not in capsys.readouterr().err
