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

    python benchmarks/whole_model/peaks.py unet '{"batch": 8, "steps": 5}'   # plain, 5 peaks (MiB)
    python benchmarks/whole_model/peaks.py unet '{"batch": 2, "steps": 1}' --tiny

`run.py`'s worker calls :func:`fresh_peaks`, which runs this module as a script.
TensorFlow is imported in `main` and `_apply`, which run in that script's process:
`run.py`'s parent process imports this module without loading it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402  (environment before TensorFlow starts)
from benchmarks.report import MIB  # noqa: E402
from benchmarks.whole_model.models import MODELS, build, training_step  # noqa: E402


def fresh_peaks(model: str, tiny: bool, spec: dict, steps: int,
                tensors: bool = False) -> list[float]:
    """Peaks (MiB) of ``steps`` training steps of ``model`` run as ``spec`` says, in a
    new process: ``batch``, ``jit``, and at most one of ``select`` (a layer class
    name, or ``"every"``), ``plan`` (a ``ModelPlan.to_config()``) and ``budget``. With
    ``tensors``, one more step is traced and the peak of its tensors (requested
    bytes, see ``tf_checkpointing.planning.measuring._requested``) is appended."""
    # The spec goes in a file: a ResNet50 plan's config (its calls' kinds, which a
    # plan is checked against) is over the 128 KiB Linux allows one argument.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(dict(spec, steps=steps, tensors=tensors), file)
    try:
        command = [sys.executable, __file__, model, "@" + file.name]
        done = subprocess.run(command + (["--tiny"] if tiny else []), capture_output=True,
                              text=True, check=False, env=dict(os.environ))
    finally:
        os.unlink(file.name)
    if done.returncode != 0:
        raise RuntimeError(f"{model} {spec}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _apply(model: Any, spec: dict) -> None:
    import keras

    import tf_checkpointing as tc

    if spec.get("select") == "every":
        tc.apply_checkpointing(model, lambda layer: not isinstance(layer, keras.layers.InputLayer))
    elif spec.get("select"):
        tc.apply_checkpointing(model, [getattr(keras.layers, spec["select"])])
    elif spec.get("plan"):
        tc.apply_checkpointing(model, plan=tc.ModelPlan.from_config(spec["plan"]))
    elif spec.get("budget"):
        tc.apply_checkpointing(model, budget=spec["budget"])


def _spec(text: str) -> dict:
    """The spec argument: JSON, or ``@path`` of a file holding it."""
    if text.startswith("@"):
        return json.loads(Path(text[1:]).read_text())
    return json.loads(text)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("spec", type=_spec, help='JSON: "batch", "steps", and "jit", '
                        '"select", "plan", "budget", "tensors" (see fresh_peaks); '
                        '@FILE: read from FILE')
    parser.add_argument("--tiny", action="store_true", help="the model's small shapes")
    args = parser.parse_args(argv)
    model_name, spec, tiny = args.model, args.spec, args.tiny
    with _cli.quiet_start_up():
        import keras

        import tf_checkpointing as tc
        from tf_checkpointing.core._memory import grow_cpu_pool
        from tf_checkpointing.planning.measuring._requested import requested_peak

    grow_cpu_pool()  # as the benchmark's process: XLA's buffer counted at its size
    model, batch_of, _, _ = build(model_name, tiny)
    x = batch_of(spec["batch"])
    model(x)
    _apply(model, spec)
    step = training_step(model, keras.optimizers.SGD(1e-3), spec.get("jit", False))
    step(x).numpy()  # trace (and plan) outside the measurement
    peaks = [tc.debug.measure(lambda: step(x).numpy()).peak_bytes / MIB
             for _ in range(spec["steps"])]
    if spec.get("tensors"):
        peaks.append(requested_peak(lambda: step(x).numpy()) / MIB)
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()
