"""Plans that outlive the process: a folder of plan files, one per planning question.

Planning measures the model, which takes seconds to minutes (an XLA plan
compiles whole training steps). ``apply_checkpointing(model, budget=...,
plan_cache=folder)`` asks this module first: a plan made for the same question
in an earlier run is read back instead of planned again. The question is
everything the plan depends on, as a key: the model's layer calls (each
layer's name, class, configuration and weight shapes, and what each call reads), the
input shapes and dtypes, the dtype policy, the step's mode, the budget and the
save policies offered, which layers take gradients, the device, and the
versions of TensorFlow, Keras and this package, and the planner's revision
(``PLAN_REVISION``: what an unchanged version's plans measure). A plan for another question is
never found, so never applied; a file that cannot be read as a plan of this
model is planned again, with a warning naming it.

Example:
    >>> from tf_checkpointing.planning.plans._plan_files import file_name
    >>> file_name("x" * 64).endswith(".json")
    True
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import keras
import tensorflow as tf

from tf_checkpointing.planning._constants import PLAN_REVISION
from tf_checkpointing.planning._errors import PlanningValueError, caller
from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph
from tf_checkpointing.planning.plans._plan import ModelPlan
from tf_checkpointing.planning.plans._plan_text import policy_name

__all__ = ["device_of_step", "expect_folder", "file_name", "plan_key", "read_plan",
           "write_plan"]


def plan_key(graph: LayerGraph, inputs: Any, *, mode: str, budget: Any,
             policies: tuple[Any, ...], frozen: Any, device: str) -> str:
    """The key of a planning question (a hex digest; see the module docstring)."""
    # An op node (``h + y``) is a Keras Operation with no weights.
    weights = [[(tuple(v.shape), str(v.dtype), v.trainable)
                for v in getattr(call.layer, "weights", ())] for call in graph.calls]
    question = {
        "calls": list(graph.kinds()), "names": [call.name for call in graph.calls],
        "weights": weights,
        "inputs": [(tuple(leaf.shape), str(leaf.dtype)) for leaf in tf.nest.flatten(inputs)
                   if hasattr(leaf, "shape")],
        "dtype_policy": keras.config.dtype_policy().name, "mode": mode, "budget": budget,
        "policies": [policy_name(p) for p in policies], "frozen": repr(frozen),
        "device": device, "versions": [tf.__version__, keras.__version__, _our_version()],
        "revision": PLAN_REVISION,
    }
    text = json.dumps(question, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _our_version() -> str:
    try:
        return importlib.metadata.version("tf_checkpointing")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout
        return "unknown"


def device_of_step() -> str:
    """The device a training step runs on, as the key names it: the first GPU's
    model, else the CPU (plans measure its allocator and its speed)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return "GPU " + str(details.get("device_name", gpus[0].name))
    return "CPU"


def file_name(key: str) -> str:
    """The plan file's name in the folder."""
    return f"plan-{key[:32]}.json"


def read_plan(folder: Any, key: str, graph: LayerGraph) -> Optional[ModelPlan]:
    """The plan saved in ``folder`` for ``key``, or None (none saved, or a file
    that is not a plan of this graph: then with a warning)."""
    path = Path(folder) / file_name(key)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("plan"), dict):
            raise ValueError("it does not hold a plan file's JSON object")
        if saved.get("key") != key:
            raise ValueError("it was saved for another planning question")
        plan = ModelPlan.from_config(saved["plan"])
        if plan.names != tuple(call.name for call in graph.calls):
            raise ValueError("its layer calls are not this model's")
    except (OSError, ValueError, KeyError, TypeError, AttributeError,
            IndexError) as error:  # whatever the file holds: planned again
        warnings.warn(
            f"{caller()}: argument `plan_cache`: the plan file {str(path)!r} cannot be used "
            f"({error}); planning again and writing it anew.", UserWarning, stacklevel=5)
        return None
    return plan


def write_plan(folder: Any, key: str, plan: ModelPlan) -> Optional[Path]:
    """Saves ``plan`` in ``folder`` for ``key`` (atomically: a reader never sees
    half a file); returns its path, or None, with a warning, where the folder
    cannot take it (training goes on with the plan, unsaved)."""
    folder = Path(folder)
    path = folder / file_name(key)
    text = json.dumps({"key": key, "plan": plan.to_config()}, indent=1)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".plan-", suffix=".json")
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except OSError as error:
        warnings.warn(
            f"{caller()}: argument `plan_cache`: the plan could not be saved in {str(folder)!r} "
            f"({error}); training goes on with it, and the next run plans again. Fix: pass "
            "a folder this process can write, e.g. plan_cache='plans/'.",
            UserWarning, stacklevel=5)
        return None
    return path


def expect_folder(folder: Any) -> None:
    """Refuses a ``plan_cache`` that cannot be a folder of plan files (an
    existing file, a place where no folder can be made), naming the argument
    (a ``PlanningValueError``: the API called names itself)."""
    path = Path(folder)
    problem = None
    if path.exists() and not path.is_dir():
        problem = "it is a file, not a folder"
    else:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            problem = f"no folder can be made there ({error.strerror or error})"
        else:
            if not os.access(path, os.W_OK):
                problem = "this process cannot write in it"
    if problem is not None:
        raise PlanningValueError(
            f"argument `plan_cache` must be a folder this process can write plan "
            f"files in; received plan_cache={str(folder)!r}, but {problem}. Fix: pass "
            "another folder (made if missing), e.g. plan_cache='plans/'.")
