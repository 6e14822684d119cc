"""What the examples share: a quiet TensorFlow start-up, and the table of plain vs
checkpointed they print.

Nothing here imports TensorFlow at import time: an example parses its arguments
first (``--help`` answers at once), then calls :func:`start_tensorflow`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import time
from pathlib import Path
from typing import Any


def start_tensorflow() -> None:
    """Sets what TensorFlow reads once, when it starts, then imports it, Keras and
    tf_checkpointing with their start-up noise hidden (every other line on stderr
    is passed on).

    ``TF_CPU_ALLOCATOR_USE_BFC=true``: CPU memory statistics that count every
    allocation, which ``tf_checkpointing.debug.measure`` reads. ``TF_CPP_MIN_LOG_LEVEL=3``:
    no C++ log lines after start-up (a level you set is kept).
    """
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with _start_up_noise_hidden():
        import keras  # noqa: F401
        import tensorflow  # noqa: F401

        import tf_checkpointing  # noqa: F401


def _start_up_noise_hidden() -> contextlib.AbstractContextManager:
    """tf_checkpointing's own filter of TensorFlow's start-up noise, read from its
    file: imported as ``tf_checkpointing._quiet`` it would run the package's
    ``__init__``, which imports TensorFlow before the noise is hidden."""
    package = importlib.util.find_spec("tf_checkpointing")
    path = Path(package.submodule_search_locations[0]) / "_quiet.py"
    spec = importlib.util.spec_from_file_location("tf_checkpointing_quiet", path)
    quiet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quiet)
    return quiet.start_up_noise_hidden()


def measured_step(model: Any, x: Any, y: Any, batch_size: int) -> dict[str, float]:
    """Runs ``fit`` on the first batch twice: the first step traces the training
    step (and plans, if the model was given a budget), the second is measured.
    Returns that step's peak in MiB above what was allocated before it
    (``peak_mib``), and the loss of each step (``first_loss``, computed before
    any update, and ``loss``)."""
    from tf_checkpointing.debug import measure

    first_x = ({k: v[:batch_size] for k, v in x.items()} if isinstance(x, dict)
               else x[:batch_size])

    def one_step() -> float:
        history = model.fit(first_x, y[:batch_size], batch_size=batch_size, epochs=1,
                            verbose=0, shuffle=False)
        return history.history["loss"][-1]

    first_loss = one_step()
    stats = measure(one_step)
    return dict(peak_mib=stats.peak_mib, first_loss=first_loss, loss=stats.result)


def interleaved_fits(models: dict[str, Any], x: Any, y: Any, batch_size: int,
                     rounds: int) -> dict[str, float]:
    """Trains each model for ``rounds`` epochs over ``x``, one epoch of each model
    in turn (a shared machine's load then weighs on all alike). Returns, per
    model, the median wall time of its training steps (a step's outputs are ready
    when the next callback runs)."""
    import keras

    seconds: dict[str, list[float]] = {name: [] for name in models}

    class StepTimer(keras.callbacks.Callback):
        def __init__(self, into: list[float]) -> None:
            super().__init__()
            self.into = into

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.into.append(time.perf_counter() - self.started)

    for _ in range(rounds):
        for name, model in models.items():
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False,
                      callbacks=[StepTimer(seconds[name])])
    return {name: statistics.median(times) for name, times in seconds.items()}


def interleaved_steps(steps: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median wall time of each of ``steps`` (callables that wait for their
    result), called ``rounds`` times each, one of each in turn."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in seconds.items()}


def print_comparison(rows: dict[str, dict[str, float]], loss_of: str = "step") -> None:
    """rows: {name: {"peak_mib": ..., "step_s": ..., "loss": ...}}; the first is plain.
    Ends with what checkpointing saved, or says that this size shows no saving.
    ``loss_of``: which step's loss the rows hold, in words."""
    (base_name, base), *others = rows.items()

    def ratio(row: dict[str, float], key: str) -> float:
        return row[key] / base[key] if base[key] > 0 else float("nan")

    print(f"{'':<16}{'peak MiB':>10}{'x plain':>9}{'step ms':>10}{'x plain':>9}{'loss':>12}")
    for name, row in rows.items():
        print(f"{name:<16}{row['peak_mib']:>10.2f}{ratio(row, 'peak_mib'):>9.2f}"
              f"{row['step_s'] * 1e3:>10.1f}{ratio(row, 'step_s'):>9.2f}{row['loss']:>12.6f}")
    print("(peak: allocator peak of one training step above the level before it; step: "
          f"median wall time; loss: of the {loss_of}; ratios against {base_name} in this run)")
    for name, row in others:
        memory, seconds = ratio(row, "peak_mib"), ratio(row, "step_s")
        apart = abs(row["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12)
        if apart <= 1e-5:
            loss = "the same loss"
        elif apart <= 1e-3:  # the checkpointed graph sums the same terms in another order
            loss = f"the same loss but for rounding ({apart:.0e} apart)"
        else:
            loss = f"loss {row['loss']:.6f} vs {base['loss']:.6f}"
        if base["peak_mib"] <= 0:
            print(f"{name}: {base_name}'s peak read as 0 MiB, nothing to compare with")
        elif memory < 0.95:
            print(f"{name}: {memory:.2f}x {base_name}'s peak memory at {seconds:.2f}x its "
                  f"step time, {loss}")
        else:
            print(f"{name}: no memory saved at this size ({memory:.2f}x {base_name}'s "
                  "peak): the step's peak is not its activations here")
