"""What both examples print: peak memory and step time of plain vs checkpointed."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_step_seconds(step: Callable[[], Any], steps: int) -> float:
    """Median wall time of `steps` calls of `step` (each call waits for its result)."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def print_comparison(rows: dict[str, dict[str, float]]) -> None:
    """rows: {name: {"peak_mib": ..., "step_s": ..., "loss": ...}}; the first is plain."""
    (base_name, base), *_ = rows.items()
    print(f"{'':<16}{'peak MiB':>10}{'x plain':>9}{'step ms':>10}{'x plain':>9}{'loss':>12}")
    for name, row in rows.items():
        print(f"{name:<16}{row['peak_mib']:>10.1f}{row['peak_mib'] / base['peak_mib']:>9.2f}"
              f"{row['step_s'] * 1e3:>10.1f}{row['step_s'] / base['step_s']:>9.2f}"
              f"{row['loss']:>12.6f}")
    print("(peak: allocator peak above the level before the step; step: median wall time; "
          f"ratios against {base_name} in this run)")
