"""Test-suite set-up: exact CPU allocator statistics, oneDNN's kernels and quiet
TensorFlow logs.

All must be set before TensorFlow is imported, hence at the top of conftest.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The suite's memory tests hold on every host, as the benchmarks' (benchmarks/_cli.py):
# TensorFlow turns oneDNN on by default only on CPUs with AVX-512 VNNI/BF16, AVX-VNNI
# or AMX, and without it a convolution's backward allocates a scratch buffer the size
# of the L3 cache (32 MiB on an AVX2-only AMD EPYC), whatever its tensors' sizes: larger
# than every activation of the suite's small models (docs/measuring-memory.md, "oneDNN:
# a convolution's backward scratch").
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# XLA:CPU without LLVM's expensive optimization passes: the suite compiles hundreds of
# small XLA programs, and compiling is most of their time. Buffer assignment, which
# sets an XLA step's peak, is done on the HLO before LLVM runs, so the memory tests
# read the same bytes; only the programs' speed differs (examples run without it).
if "xla_llvm_disable_expensive_passes" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_llvm_disable_expensive_passes=true"]).strip()

import pytest  # noqa: E402

MODES = ("eager", "graph", "xla")


def compile_step(step, mode):
    """``step`` run eagerly, under tf.function, or under tf.function(jit_compile=True)."""
    import tensorflow as tf  # here: pytest-xdist's controller process needs no TensorFlow

    if mode == "eager":
        return step
    return tf.function(step, jit_compile=(mode == "xla"))


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


@pytest.fixture
def mixed_float16():
    """Keras' global dtype policy "mixed_float16" for the test, then the one before."""
    import keras

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy(previous)


def pytest_sessionstart(session):
    """In a process that runs tests (an xdist worker, or a run with ``-n 0``):
    TensorFlow, Keras and the library imported, and the objects they made moved
    out of the garbage collector's generations (``gc.freeze``). Planning collects
    garbage and lists the live variables once per plan (to leave no trace), and
    in a suite of hundreds of plans each pass went over the ~350k objects of the
    imports again. Before collection: a variable a test module makes when it is
    imported must stay visible to planning. A test process only; the library
    never touches the collector's settings."""
    import gc

    if not os.environ.get("PYTEST_XDIST_WORKER") and getattr(
            session.config.option, "numprocesses", None):
        return  # xdist's controller: it runs no test
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    import tf_checkpointing  # noqa: F401
    from tf_checkpointing.planning.measuring._leave_no_trace import live_variables

    gc.collect()
    assert not live_variables(), "a variable made at import would be hidden from planning"
    gc.freeze()


@pytest.fixture(autouse=True)
def _forget_planned_chains():
    """The planner caches profiles with their layers; dropping them after each test
    keeps one test's weights from pinning allocator blocks under the next test's
    memory measurements."""
    yield
    from tf_checkpointing.planning import clear_caches

    clear_caches()


# The test files that take longest, longest first (`--junitxml` times of a full run; the
# rest follow in their usual order). pytest-xdist hands out whole files (`--dist
# loadfile`) in collection order (`--no-loadscope-reorder`; by default it orders them by
# their number of tests, which left the few-test files that run examples and fresh
# processes to the end, one worker running them while the other waited). Longest first,
# the two workers finish within a short file of each other.
LONGEST_FIRST = (
    "tests/docs_examples/test_examples.py",
    "tests/docs_examples/test_benchmarks.py",
    "tests/whole_model/test_nested_blocks.py",
    "tests/whole_model/test_whole_model_memory.py",
    "tests/whole_model/test_whole_model.py",
    "tests/whole_model/test_xla_memory.py",
    "tests/whole_model/test_plan_files.py",
    "tests/whole_model/test_no_trace.py",
    "tests/whole_model/test_whole_model_policies.py",
    "tests/core/test_policies.py",
    "tests/core/test_xla_filters.py",
    "tests/planning/test_plans_per_batch.py",
    "tests/planning/test_chain_frozen.py",
    "tests/whole_model/test_whole_model_nested_calls.py",
    "tests/planning/test_planner.py",
    "tests/whole_model/test_whole_model_frozen.py",
    "tests/whole_model/test_whole_model_keras.py",
    "tests/planning/test_planning_random_state.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: k for k, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
