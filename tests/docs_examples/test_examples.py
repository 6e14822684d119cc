"""The scripts in examples/ run end to end with --tiny, as a user would run them,
and train exactly: the checkpointed run ends with the plain run's loss."""

import os
import subprocess
import sys

import pytest
from helpers import REPO


def _run_example(name):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(REPO / "examples" / name), "--tiny"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {}
    for line in done.stdout.splitlines():
        words = line.split()
        if words and words[0] in ("plain", "checkpointed") and len(words) == 6:
            rows[words[0]] = [float(w) for w in words[1:]]
    assert set(rows) == {"plain", "checkpointed"}, done.stdout
    return done.stdout, rows


@pytest.mark.slow
def test_gpt2_fit():
    stdout, rows = _run_example("gpt2_fit.py")
    assert "checkpointed: transformer_layer_0, transformer_layer_1" in stdout
    assert rows["checkpointed"][4] == pytest.approx(rows["plain"][4], rel=1e-5)  # loss
    assert rows["plain"][0] > 0 and rows["plain"][2] > 0  # peak MiB, step ms


@pytest.mark.slow
def test_distributed_loop():
    stdout, rows = _run_example("distributed_loop.py")
    assert "MirroredStrategy over 2 replicas" in stdout
    assert rows["checkpointed"][4] == pytest.approx(rows["plain"][4], rel=1e-5)
    assert rows["plain"][2] > 0
