"""The scripts in examples/ run end to end with --tiny, as a user would run them: no
TensorFlow noise, a visible memory saving at their tiny sizes, and exact training
(the checkpointed run ends with the plain run's loss)."""

import os
import subprocess
import sys

import pytest
from helpers import REPO

EXAMPLES = ["gpt2_fit.py", "distributed_loop.py", "resnet50_budget.py"]


def _run_example(name, timeout=600):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPP_MIN_LOG_LEVEL")}
    # The suite's XLA flag (conftest) off, any flag of the machine's kept.
    flags = env.pop("XLA_FLAGS", "").replace("--xla_llvm_disable_expensive_passes=true", "")
    if flags.strip():
        env["XLA_FLAGS"] = flags.strip()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(REPO / "examples" / name), "--tiny"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    # No TensorFlow start-up noise: stderr holds at most the planner's progress lines.
    told = [line for line in done.stderr.splitlines()
            if line.strip() and not line.startswith("apply_checkpointing: planning ")]
    assert told == [], done.stderr[-4000:]
    rows = {}
    for line in done.stdout.splitlines():
        words = line.split()
        if words and words[0] in ("plain", "checkpointed") and len(words) == 6:
            rows[words[0]] = [float(w) for w in words[1:]]
    assert set(rows) == {"plain", "checkpointed"}, done.stdout
    return done.stdout, rows


def _assert_saves_memory_exactly(stdout, rows, loss_rel=1e-5):
    plain, checkpointed = rows["plain"], rows["checkpointed"]
    assert plain[0] >= 1.0 and checkpointed[0] > 0, stdout  # peak MiB: no 0.0 readings
    assert checkpointed[1] < 0.8, stdout  # peak x plain: the saving the sizes are for
    assert "checkpointed: 0." in stdout and "no memory saved" not in stdout, stdout
    assert plain[2] > 0 and checkpointed[2] > 0, stdout  # step ms
    assert checkpointed[4] == pytest.approx(plain[4], rel=loss_rel), stdout  # loss


@pytest.mark.slow
def test_gpt2_fit():
    stdout, rows = _run_example("gpt2_fit.py")
    assert "checkpointed: transformer_layer_0, transformer_layer_1" in stdout
    _assert_saves_memory_exactly(stdout, rows)


@pytest.mark.slow
def test_distributed_loop():
    stdout, rows = _run_example("distributed_loop.py")
    assert "MirroredStrategy over 2 replicas" in stdout
    _assert_saves_memory_exactly(stdout, rows)


@pytest.mark.slow
def test_resnet50_budget():
    stdout, rows = _run_example("resnet50_budget.py", timeout=900)
    assert "ModelPlan (graph): 176 layers, budget min -> predicted peak" in stdout
    _assert_saves_memory_exactly(stdout, rows, loss_rel=1e-3)


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_answers_without_tensorflow(name):
    """--help is parsed before TensorFlow is imported: it answers at once."""
    code = (f"import runpy, sys; sys.argv = [{name!r}, '--help']\n"
            f"try:\n    runpy.run_path({str(REPO / 'examples' / name)!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('tensorflow imported:', 'tensorflow' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO / "examples",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--tiny" in done.stdout, done.stdout
    assert "tensorflow imported: False" in done.stdout and done.stderr == "", done
