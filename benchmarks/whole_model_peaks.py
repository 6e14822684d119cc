"""A whole-model strategy's peak, measured in a fresh process, as a user's run has it.

The BFC allocator hands a tensor a whole free chunk unless the chunk is at
least twice its size, so which chunks a step gets depends on what the
process allocated before: on MobileNetV2 the same least plan measured 122 to
158 MiB in consecutive steps of one process, and plain's step 314 MiB first
and 338-350 MiB after other strategies had run (the tensors alive at those
peaks: 122-125 MiB, as predicted). A user's training process runs one plan,
so the benchmark measures each strategy in a process of its own: the model
is built again (same seed, same layer names), the strategy applied (a plan
made in the benchmark's process is passed as its regions), one step traced,
and the peaks of the next steps read.

    python benchmarks/whole_model_peaks.py unet '{"batch": 8, "steps": 5}'   # plain, 5 peaks (MiB)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402,F401  (environment before TensorFlow starts)

MIB = 2**20


def plan_spec(plan: Any) -> dict:
    """The parts of a ``ModelPlan`` a fresh process needs to run it (JSON)."""
    return dict(call_names=list(plan.call_names), spans=plan.spans, mode=plan.mode,
                policies=[None if p is None else p.__name__ for p in plan.region_policies])


def fresh_peaks(model: str, tiny: bool, spec: dict, steps: int,
                tensors: bool = False) -> list[float]:
    """Peaks (MiB) of ``steps`` training steps of ``model`` run as ``spec`` says, in a
    new process: ``batch``, ``jit``, and at most one of ``select`` (a layer class
    name, or ``"every"``), ``plan`` (from :func:`plan_spec`) and ``budget``. With
    ``tensors``, one more step is traced and the peak of its tensors (requested
    bytes, see ``tf_checkpointing.planning._requested``) is appended."""
    command = [sys.executable, __file__, model, json.dumps(dict(spec, steps=steps,
                                                                tensors=tensors))]
    done = subprocess.run(command + (["--tiny"] if tiny else []), capture_output=True,
                          text=True, check=False, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"{model} {spec}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _apply(model: Any, spec: dict) -> None:
    import keras

    import tf_checkpointing as tc
    from tf_checkpointing import policies
    from tf_checkpointing.planning._model import ModelPlan

    if spec.get("select") == "every":
        tc.apply_checkpointing(model, lambda layer: not isinstance(layer, keras.layers.InputLayer))
    elif spec.get("select"):
        tc.apply_checkpointing(model, [getattr(keras.layers, spec["select"])])
    elif spec.get("plan"):
        given = spec["plan"]
        plan = ModelPlan(tuple(given["call_names"]), _tuples(given["spans"]), given["mode"],
                         None, 0, 0, 0, region_policies=tuple(
                             None if p is None else getattr(policies, p)
                             for p in given["policies"]))
        tc.apply_checkpointing(model, plan=plan)
    elif spec.get("budget"):
        tc.apply_checkpointing(model, budget=spec["budget"])


def _tuples(spans: Any) -> tuple:
    return tuple((a, c, _tuples(inner)) for a, c, inner in spans)


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    model_name, spec, tiny = args[0], json.loads(args[1]), "--tiny" in args
    import keras

    import tf_checkpointing as tc
    from benchmarks.whole_model import build, training_step
    from tf_checkpointing._memory import grow_cpu_pool

    grow_cpu_pool()  # as the benchmark's process: XLA's buffer counted at its size
    model, batch_of, _, _ = build(model_name, tiny)
    x = batch_of(spec["batch"])
    model(x)
    _apply(model, spec)
    step = training_step(model, keras.optimizers.SGD(1e-3), spec.get("jit", False))
    step(x).numpy()  # trace (and plan) outside the measurement
    peaks = [tc.peak_memory(lambda: step(x).numpy()) / MIB for _ in range(spec["steps"])]
    if spec.get("tensors"):
        from tf_checkpointing.planning._requested import requested_peak

        peaks.append(requested_peak(lambda: step(x).numpy()) / MIB)
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()
