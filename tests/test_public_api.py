"""The public API: a small top level, two submodules, and the names that moved from the
top level still importable for a release, each with a warning naming its new place."""

import ast
import warnings

import pytest
import tensorflow as tf
from helpers import REPO

import tf_checkpointing
from tf_checkpointing import debug, plans

MOVED = {"Plan": plans, "Segment": plans, "SequentialPlan": plans, "plan_sequential": plans,
         "ChainedOutputWarning": debug, "MemoryStats": debug, "Residual": debug,
         "measure": debug, "print_saved_residuals": debug, "saved_residuals": debug}


def test_the_top_level_fits_a_screen_and_every_name_resolves_without_a_warning():
    assert len(tf_checkpointing.__all__) <= 14
    assert len(set(tf_checkpointing.__all__)) == len(tf_checkpointing.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module in (tf_checkpointing, plans, debug):
            for name in module.__all__:
                assert getattr(module, name) is not None, (module.__name__, name)
        namespace: dict = {}
        exec("from tf_checkpointing import *", namespace)
    assert set(tf_checkpointing.__all__) <= set(namespace)


def test_the_submodules_export_what_the_top_level_shares_with_them():
    assert tf_checkpointing.plan_model is plans.plan_model
    assert tf_checkpointing.ModelPlan is plans.ModelPlan
    assert set(MOVED) <= set(plans.__all__) | set(debug.__all__)
    assert not set(MOVED) & set(tf_checkpointing.__all__)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_imports_from_the_top_level_with_a_warning(name):
    module = MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"`{module.__name__}\.{name}`") as caught:
        old = getattr(tf_checkpointing, name)
    assert old is getattr(module, name)
    assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line


@pytest.mark.parametrize("name", ["measure", "Segment"])
def test_from_import_of_a_moved_name_warns_once(name):
    namespace: dict = {}
    with pytest.warns(DeprecationWarning, match=rf"from {MOVED[name].__name__} import {name}"
                      ) as caught:
        exec(compile(f"from tf_checkpointing import {name}", "<user>", "exec"), namespace)
    assert namespace[name] is getattr(MOVED[name], name)
    assert [w.filename for w in caught] == ["<user>"]


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="'tf_checkpointing' has no attribute 'mesure'"):
        tf_checkpointing.mesure  # noqa: B018
    assert not hasattr(tf_checkpointing, "call_names")


def test_peak_memory_is_back_as_measure_peak_bytes_with_a_warning():
    from tf_checkpointing.core._memory import peak_memory as in_core

    step = lambda x: tf.reduce_sum(x * 2.0)  # noqa: E731
    x = tf.random.uniform([512, 1024])  # 2 MiB: x * 2.0 is allocated in the step
    expected = debug.measure(step, x, device="CPU:0").peak_bytes
    with pytest.warns(DeprecationWarning, match=r"tf_checkpointing\.debug\.measure\(fn\)"
                      r"\.peak_bytes"):
        from tf_checkpointing import peak_memory
    assert peak_memory is debug.peak_memory is in_core
    with pytest.warns(DeprecationWarning, match=r"`peak_memory\(fn\)` is deprecated.*"
                      r"tf_checkpointing\.debug\.measure\(fn\)\.peak_bytes") as caught:
        peak = peak_memory(step, x, device="CPU:0")
    assert caught[0].filename == __file__
    # The same step measured twice: equal up to the few small buffers eager mode
    # allocates around it (a scalar's 256 bytes was seen).
    assert isinstance(peak, int) and peak >= 2 * 2**20
    assert abs(peak - expected) <= 4096


def test_model_plan_call_names_is_names_with_a_warning():
    plan = plans.ModelPlan(names=("a", "b"), pieces=(plans.Segment(0, 2, True),))
    with pytest.warns(DeprecationWarning, match=r"ModelPlan\.call_names.*`ModelPlan\.names`"
                      ) as caught:
        names = plan.call_names
    assert names == plan.names == ("a", "b")
    assert caught[0].filename == __file__
    assert "call_names" not in plan.to_config()


def _imported(path):
    """(line, names) of each import in ``path``: modules and ``module.name``s."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield node.lineno, {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, {node.module} | {f"{node.module}.{a.name}" for a in node.names}


@pytest.mark.parametrize("floor", ["core", "planning"])
def test_the_lower_floors_never_import_the_front_modules(floor):
    front = {"tf_checkpointing.plans", "tf_checkpointing.debug"}
    found = []
    for path in sorted((REPO / "tf_checkpointing" / floor).rglob("*.py")):
        found += [f"{path.name}:{line}" for line, names in _imported(path) if names & front]
    assert not found, f"{floor}/ imports a module of the package front: {found}"


def test_the_rooms_of_planning_import_only_the_rooms_before_them():
    rooms = ["measuring", "layer_graph", "plans", "solving"]
    planning = REPO / "tf_checkpointing" / "planning"
    found = []
    for path in sorted(planning.rglob("*.py")):
        here = path.relative_to(planning).parts
        level = rooms.index(here[0]) if len(here) > 1 else -1  # planning/_x.py: below all
        for line, names in _imported(path):
            for name in names:
                parts = name.split(".")
                if (parts[:2] == ["tf_checkpointing", "planning"] and len(parts) > 2
                        and parts[2] in rooms and rooms.index(parts[2]) > level):
                    found.append(f"{path.relative_to(planning)}:{line} {name}")
    assert not found, f"a room of planning imports one above it: {found}"
