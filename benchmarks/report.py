"""Turns benchmark results into a Markdown table, target checks, JSON and a PNG plot.

Example:
    >>> from benchmarks.harness import RunResult
    >>> rows = [RunResult("mlp", "eager", "plain", peaks_bytes=[2**20], step_times_s=[0.1])]
    >>> print(markdown_table(rows).splitlines()[0][:55])
    | model | mode | strategy | peak MiB | memory x plain |
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.harness import RunResult

MIB = 2**20
GRAD_TOLERANCE = 1e-5  # "gradients equal to plain": worst relative difference
OURS = ("checkpointable", "sqrt_segments", "budget_plan")


# How the plot and the READMEs name each strategy.
LABELS = {
    "plain": "plain TensorFlow",
    "recompute_grad": "tf.recompute_grad per block",
    "keras_remat": "keras.remat per block",
    "checkpointable": "checkpointable per block",
    "sqrt_segments": 'checkpoint_sequential(segments="sqrt")',
    "budget_plan": "CheckpointedSequential(budget=plain/3)",
}
# Strategies that keep about a third of plain's memory or less by design: the memory and
# batch targets apply to them, not to sqrt segments (~2 sqrt(N) kept inputs, a fixed
# schedule that does not aim at a budget).
SAVE_A_THIRD = ("recompute_grad", "keras_remat", "checkpointable", "budget_plan")


@dataclasses.dataclass(frozen=True)
class Target:
    """A criterion on one run, for the strategies it applies to."""

    name: str
    wanted: str
    measure: Callable[[RunResult], Optional[float]]
    passes: Callable[[float, RunResult], bool]
    fmt: str = "{:.3f}"
    applies_to: Optional[tuple[str, ...]] = None  # None: every strategy


# The library's goal on the GPT-2-style decoder with dropout, under tf.function: a
# third of plain's memory at most 1.35x its step time, exact gradients.
TARGET_MODEL, TARGET_MODE = "gpt2", "function"
TARGETS = (
    Target("peak memory", "<= 1/3 of plain", lambda r: r.memory_ratio,
           lambda v, r: v <= 1 / 3, applies_to=SAVE_A_THIRD),
    Target("step time", "<= 1.35x plain (median over rounds)", lambda r: r.time_ratio,
           lambda v, r: v <= 1.35),
    Target("gradients", f"equal to plain (<= {GRAD_TOLERANCE:g})", lambda r: r.grad_error,
           lambda v, r: v <= GRAD_TOLERANCE and r.none_grads == 0, fmt="{:.1e}"),
    Target("largest batch", ">= 3x plain's", lambda r: r.batch_ratio, lambda v, r: v >= 3.0,
           fmt="{:.2f}", applies_to=SAVE_A_THIRD),
)


# A save policy per block on the same decoder, tf.function and XLA: most of the
# replay's time saved for a bit more memory.
POLICY_STRATEGY = "dots_saveable"
POLICY_TARGETS = {
    mode: (
        Target("peak memory", "<= 0.6x plain", lambda r: r.memory_ratio, lambda v, r: v <= 0.6),
        Target("step time", f"<= {limit}x plain (median over rounds)", lambda r: r.time_ratio,
               lambda v, r, limit=limit: v <= limit),
        TARGETS[2],
    ) for mode, limit in (("function", 1.15), ("xla", 1.2))
}


# A policy per block planned for half of plain's peak.
PLAN_STRATEGIES = ("policy_plan", "budget_policies")
PLAN_TARGETS = (
    Target("peak memory", "<= 1/2 of plain", lambda r: r.memory_ratio, lambda v, r: v <= 0.5),
    Target("step time", "<= 1.15x plain (median over rounds)", lambda r: r.time_ratio,
           lambda v, r: v <= 1.15),
    TARGETS[2],
)
# The other save policies are reported, with no target of their own.
UNTARGETED = ("dots_no_batch", "dots_no_masks", "qkv_mlp_out", "attn_mlp_out", "budget_replay")


def _targets_for(r: RunResult) -> tuple[Target, ...]:
    if r.model != TARGET_MODEL or r.strategy in ("plain", *UNTARGETED):
        return ()
    if r.strategy == POLICY_STRATEGY:
        return POLICY_TARGETS.get(r.mode, ())
    if r.mode != TARGET_MODE:
        return ()
    return PLAN_TARGETS if r.strategy in PLAN_STRATEGIES else TARGETS


def check_targets(results: list[RunResult]) -> list[dict[str, Any]]:
    """Each target, for each strategy run on the target model and mode."""
    checks = []
    for r in results:
        for target in _targets_for(r):
            if target.applies_to is not None and r.strategy not in target.applies_to:
                continue
            value = target.measure(r) if r.status == "ok" else None
            passed = None if value is None else bool(target.passes(value, r))
            shown = _fmt(value, target.fmt)
            if target.name == "step time" and value is not None and r.time_ratio_quartiles:
                shown += " (quartiles {:.2f}-{:.2f})".format(*r.time_ratio_quartiles)
            checks.append(dict(strategy=r.strategy + ("" if r.mode == TARGET_MODE else
                                                      f" ({r.mode})"),
                               ours=r.strategy in (*OURS, POLICY_STRATEGY, *PLAN_STRATEGIES),
                               target=target.name, wanted=target.wanted, measured=value,
                               shown=shown, passed=passed))
    return checks


def markdown_table(results: list[RunResult]) -> str:
    head = ["model", "mode", "strategy", "peak MiB", "memory x plain", "step ms",
            "time x plain", "grad err", "state err", "max batch", "batch x plain", "notes"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in results:
        if r.status != "ok":
            lines.append(_row([r.model, r.mode, r.strategy] + ["-"] * 8
                              + [f"{r.status}: {r.note}"]))
            continue
        lines.append(_row([
            r.model, r.mode, r.strategy,
            _fmt(r.peak_bytes and r.peak_bytes / MIB, "{:.4g}"),
            _fmt(r.memory_ratio, "{:.2f}"),
            _fmt(r.step_time_s and r.step_time_s * 1e3, "{:.1f}"),
            _fmt(r.time_ratio, "{:.2f}"),
            _fmt(r.grad_error, "{:.1e}"),
            _fmt(r.state_error, "{:.1e}"),
            _fmt(r.max_batch, "{}"),
            _fmt(r.batch_ratio, "{:.2f}"),
            r.note]))
    return "\n".join(lines)


def targets_table(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return (f"(no target rows: the targets need model {TARGET_MODEL!r} in mode "
                f"{TARGET_MODE!r})")
    lines = [_row(["strategy", "measure", "target", "measured", "target met?"]),
             _row(["---"] * 5)]
    for c in checks:
        result = "not measured" if c["passed"] is None else ("yes" if c["passed"] else "no")
        name = LABELS.get(c["strategy"], c["strategy"]) + ("" if c["ours"] else " (peer)")
        lines.append(_row([name, c["target"], c["wanted"], c["shown"], result]))
    return "\n".join(lines)


def markdown_report(results: list[RunResult], checks: list[dict[str, Any]],
                    header: dict[str, Any]) -> str:
    budget = ", ".join(f"{m}: {b / MIB:.0f} MiB" for m, b in header["budgets"].items())
    return "\n".join([
        f"## Results ({header['size']}, {header['started']})", "",
        markdown_table(results), "",
        f"Ratios are against plain in the same model and mode, measured in this run. Peak: "
        f"allocator peak above the level before the step (forward + backward, no "
        f"optimizer), median of the timed steps. Step: median of {header['repeats']} "
        f"steps ({header.get('target_repeats', header['repeats'])} for {TARGET_MODEL}/"
        f"{TARGET_MODE}), run in rounds (one step per strategy per round); time x plain is the "
        f"median over rounds of the ratio to plain's step in the same round. Grad err: "
        f"worst relative difference from plain's gradients (same weights, same dropout "
        f"seeds). State err: BatchNorm statistics after one step "
        f"vs plain, relative to plain's update (1.0 = updated twice). Max batch: "
        f"extrapolated linearly from the median peaks at the base batch and at half of "
        f"it, budget {budget}.",
        "", f"### Targets ({TARGET_MODEL}, {TARGET_MODE})", "",
        "The library's goal on this model: a third of plain's peak memory at most 1.35x "
        "its step time, with gradients equal to plain's. Memory and batch targets are "
        "shown for the strategies that aim at a third of plain's memory (per-block "
        "checkpointing and the budget plan), not for sqrt segments.", "",
        targets_table(checks), ""])


def environment() -> dict[str, Any]:
    """Versions, machine, and load: what a reader needs to trust the numbers."""
    import keras
    import numpy
    import tensorflow as tf

    import tf_checkpointing

    env: dict[str, Any] = dict(
        python=sys.version.split()[0], tensorflow=tf.__version__, keras=keras.__version__,
        numpy=numpy.__version__, tf_checkpointing=getattr(tf_checkpointing, "__version__", "?"),
        platform=platform.platform(), cpu=_cpu_name(), cpu_count=os.cpu_count(),
        gpus=[d.name for d in tf.config.list_logical_devices("GPU")],
        load_average=list(os.getloadavg()),
        TF_CPU_ALLOCATOR_USE_BFC=os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
        onednn=_onednn_enabled(),
        git_commit=_git("rev-parse", "HEAD"), git_dirty=bool(_git("status", "--porcelain")))
    return env


def _onednn_enabled() -> Any:
    """Whether TensorFlow runs oneDNN kernels: CPU peaks depend on it (see _cli.py)."""
    try:
        from tensorflow.python.util import _pywrap_util_port  # no public API says it
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def write_outputs(out_dir: Path, stem: str, report: str, payload: dict[str, Any],
                  results: list[RunResult]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, png = (out_dir / f"{stem}{ext}" for ext in (".md", ".json", ".png"))
    md.write_text(report)
    js.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    plot(results, png)
    return [md, js, png]


def plot(results: list[RunResult], path: Path, title: str = "") -> None:
    """Peak memory vs step time, both as ratios to plain (plain sits at 1, 1), one
    point per strategy (colour) and mode (marker), one panel per model, all panels
    on one x-scale. Strategies whose gradients (or BatchNorm statistics) differ from
    plain's are drawn hollow and crossed. Ratios, not absolute medians: on a shared
    machine the paired ratio is the stable number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok" and r.memory_ratio and r.time_ratio]
    model_names = list(dict.fromkeys(r.model for r in results)) or ["(none)"]
    strategies = list(dict.fromkeys(r.strategy for r in ok))
    colours = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(strategies)}
    markers = {"eager": "o", "function": "s", "xla": "^"}
    fig, axes = plt.subplots(1, len(model_names), figsize=(5 * len(model_names), 4.6),
                             squeeze=False, sharex=True, sharey=True)
    for ax, model in zip(axes[0], model_names):
        for r in (r for r in ok if r.model == model):
            marker = markers.get(r.mode, "D")
            if is_wrong(r):
                ax.scatter(r.time_ratio, r.memory_ratio, facecolors="none", s=70,
                           edgecolors=colours[r.strategy], marker=marker, linewidths=1.5)
                ax.scatter(r.time_ratio, r.memory_ratio, color=colours[r.strategy],
                           marker="x", s=70, linewidths=1.5)
            else:
                ax.scatter(r.time_ratio, r.memory_ratio, color=colours[r.strategy],
                           marker=marker, s=50, edgecolors="black", linewidths=0.5)
        if model == TARGET_MODEL:
            ax.axhline(1 / 3, color="grey", linestyle="--", linewidth=0.8)
            ax.axvline(1.35, color="grey", linestyle="--", linewidth=0.8)
            ax.text(1.352, 1 / 3 + 0.02, "target", color="grey", fontsize="small")
        ax.set_title(model)
        ax.set_xlabel("step time / plain (median of paired rounds)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("peak memory / plain")
    axes[0][0].set_ylim(0, 1.1)
    fig.suptitle(title or "Peak memory vs step time of each strategy, as ratios to plain "
                 "TensorFlow (lower left is better)")
    handles = [plt.Line2D([], [], color=colours[s], marker="o", linestyle="",
                          label=LABELS.get(s, s)) for s in strategies]
    handles += [plt.Line2D([], [], color="grey", marker=m, linestyle="", label=mode)
                for mode, m in markers.items() if any(r.mode == mode for r in ok)]
    if any(is_wrong(r) for r in ok):
        handles.append(plt.Line2D([], [], color="black", marker="x", markerfacecolor="none",
                                  linestyle="", label="wrong gradients (or BatchNorm "
                                  "statistics updated twice)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4),
               fontsize="small")
    rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, 0.04 + 0.045 * rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def is_wrong(r: RunResult) -> bool:
    """Whether a run's gradients or state differ from plain's (beyond float noise)."""
    return bool((r.grad_error is not None and r.grad_error > GRAD_TOLERANCE) or r.none_grads
                or (r.state_error is not None and r.state_error > GRAD_TOLERANCE))


def rerender(json_path: Path) -> list[Path]:
    """Writes the Markdown report and the plot of a finished run again from its JSON
    (after a change to how they are presented), without measuring anything."""
    payload = json.loads(Path(json_path).read_text())
    fields = {f.name for f in dataclasses.fields(RunResult)}
    results = []
    for row in payload["results"]:
        kwargs = {k: v for k, v in row.items() if k in fields}
        kwargs["batch_peaks"] = {int(k): v for k, v in kwargs.get("batch_peaks", {}).items()}
        results.append(RunResult(**kwargs))
    md_path, png_path = Path(json_path).with_suffix(".md"), Path(json_path).with_suffix(".png")
    md_path.write_text(markdown_report(results, check_targets(results), payload["header"]))
    plot(results, png_path)
    return [md_path, png_path]


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
        return done.stdout.strip() if done.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    # python -m benchmarks.report benchmarks/results/quick.json: its .md and .png again.
    for name in sys.argv[1:]:
        print(*rerender(Path(name)))
