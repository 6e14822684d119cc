"""Planning for a budget on a CPU machine where nothing is set: importing the
package turns TensorFlow's CPU memory statistics on while that still takes
effect, and ``apply_checkpointing(budget=...)`` raises at once, with the fix,
where it no longer can. Each case runs in a fresh process without
``TF_CPU_ALLOCATOR_USE_BFC``."""

import os
import subprocess
import sys

import pytest
from helpers import REPO

_MODEL = """
import keras, numpy as np
x = keras.Input((8, 8, 3)); h = x
for _ in range(3):
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
model = keras.Model(x, keras.layers.Conv2D(1, 1)(h))
model.compile("sgd", "mse")
"""


def _run(code, **env_overrides):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO), **env_overrides)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_budget_plans_on_cpu_with_nothing_set():
    done = _run("import tf_checkpointing as tc\n" + _MODEL + """
import os
tc.apply_checkpointing(model, budget="min")
model.fit(np.zeros((4, 8, 8, 3)), np.zeros((4, 8, 8, 1)), batch_size=4, verbose=0)
print(os.environ["TF_CPU_ALLOCATOR_USE_BFC"], model.call.plan is not None)
""")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["true", "True"]


@pytest.mark.parametrize("setting", [None, "false"])
def test_budget_refused_at_once_when_statistics_are_off(setting):
    # TensorFlow makes its devices before the package is imported (or the user
    # turned the allocator off): the error comes from apply_checkpointing, not fit.
    before = "import tensorflow as tf\ntf.ones([2]).numpy()\n" if setting is None else ""
    overrides = {} if setting is None else {"TF_CPU_ALLOCATOR_USE_BFC": setting}
    done = _run(before + "import tf_checkpointing as tc\n" + _MODEL + """
try:
    tc.apply_checkpointing(model, budget="min")
except RuntimeError as error:
    print("refused:", error)
else:
    print("accepted")
""", **overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("refused: apply_checkpointing:"), done.stdout
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in done.stdout
    assert ("import tf_checkpointing before" in done.stdout) == (setting is None)
    assert ("'false'" in done.stdout) == (setting == "false")
