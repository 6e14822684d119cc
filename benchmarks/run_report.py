"""The main job's report (`run.py`): its targets, Markdown table, JSON and PNG plot, and
the same written again from a finished run's JSON (`python benchmarks/run.py --rerender
benchmarks/results/quick.json`). Tables and files go through the shared
`benchmarks/report.py`.

Example:
    >>> from benchmarks.harness import RunResult
    >>> rows = [RunResult("mlp", "eager", "plain", peaks_bytes=[2**20], step_times_s=[0.1])]
    >>> print(markdown_table(rows).splitlines()[0][:55])
    | model | mode | strategy | peak MiB | memory x plain |
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.harness import RunResult
from benchmarks.report import MIB, cell, pyplot, save_figure, table, write_json

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
# How the plot's legend names each mode (the identifiers are the library's `mode`s).
MODE_LABELS = {"eager": "eager", "graph": "graph (tf.function)",
               "xla": "xla (tf.function, jit_compile=True)"}
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


# The library's goal on the GPT-2-style decoder with dropout, under tf.function (mode
# "graph"): a third of plain's memory at most 1.35x its step time, exact gradients.
TARGET_MODEL, TARGET_MODE = "gpt2", "graph"
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
    ) for mode, limit in (("graph", 1.15), ("xla", 1.2))
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
            shown = cell(value, target.fmt)
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
    return table(head, (_cells(r) for r in results))


def _cells(r: RunResult) -> list[str]:
    if r.status != "ok":
        return [r.model, r.mode, r.strategy] + ["-"] * 8 + [f"{r.status}: {r.note}"]
    return [r.model, r.mode, r.strategy,
            cell(r.peak_bytes and r.peak_bytes / MIB, "{:.4g}"),
            cell(r.memory_ratio, "{:.2f}"),
            cell(r.step_time_s and r.step_time_s * 1e3, "{:.1f}"),
            cell(r.time_ratio, "{:.2f}"),
            cell(r.grad_error, "{:.1e}"),
            cell(r.state_error, "{:.1e}"),
            cell(r.max_batch, "{}"),
            cell(r.batch_ratio, "{:.2f}"),
            r.note]


def targets_table(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return (f"(no target rows: the targets need model {TARGET_MODEL!r} in mode "
                f"{TARGET_MODE!r})")
    return table(["strategy", "measure", "target", "measured", "target met?"], [
        [LABELS.get(c["strategy"], c["strategy"]) + ("" if c["ours"] else " (peer)"),
         c["target"], c["wanted"], c["shown"],
         "not measured" if c["passed"] is None else ("yes" if c["passed"] else "no")]
        for c in checks])


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


def write_outputs(out_dir: Path, stem: str, report: str, payload: dict[str, Any],
                  results: list[RunResult]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, png = (out_dir / f"{stem}{ext}" for ext in (".md", ".json", ".png"))
    md.write_text(report)
    write_json(js, payload)
    plot(results, png)
    return [md, js, png]


def plot(results: list[RunResult], path: Path, title: str = "") -> None:
    """Peak memory vs step time, both as ratios to plain (plain sits at 1, 1), one
    point per strategy (colour) and mode (marker), one panel per model, all panels
    on one x-scale. Strategies whose gradients (or BatchNorm statistics) differ from
    plain's are drawn hollow and crossed. Ratios, not absolute medians: on a shared
    machine the paired ratio is the stable number."""
    plt = pyplot()
    ok = [r for r in results if r.status == "ok" and r.memory_ratio and r.time_ratio]
    model_names = list(dict.fromkeys(r.model for r in results)) or ["(none)"]
    strategies = list(dict.fromkeys(r.strategy for r in ok))
    colours = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(strategies)}
    markers = {"eager": "o", "graph": "s", "xla": "^"}
    # At least 11 inches wide: the title and the four legend columns fit one panel too.
    fig, axes = plt.subplots(1, len(model_names), figsize=(max(5 * len(model_names), 11), 4.6),
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
    handles += [plt.Line2D([], [], color="grey", marker=m, linestyle="",
                           label=MODE_LABELS.get(mode, mode))
                for mode, m in markers.items() if any(r.mode == mode for r in ok)]
    if any(is_wrong(r) for r in ok):
        handles.append(plt.Line2D([], [], color="black", marker="x", markerfacecolor="none",
                                  linestyle="", label="wrong gradients (or BatchNorm "
                                  "statistics updated twice)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4),
               fontsize="small")
    rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, 0.04 + 0.045 * rows, 1, 1))
    save_figure(fig, path)


def is_wrong(r: RunResult) -> bool:
    """Whether a run's gradients or state differ from plain's (beyond float noise)."""
    return bool((r.grad_error is not None and r.grad_error > GRAD_TOLERANCE) or r.none_grads
                or (r.state_error is not None and r.state_error > GRAD_TOLERANCE))


def rerender(json_path: Path) -> list[Path]:
    """Writes the Markdown report and the plot of a finished run again from its JSON
    (after a change to how they are presented), without measuring anything."""
    payload = json.loads(Path(json_path).read_text())
    results = [RunResult.from_dict(r) for r in payload["results"]]
    md_path, png_path = Path(json_path).with_suffix(".md"), Path(json_path).with_suffix(".png")
    md_path.write_text(markdown_report(results, check_targets(results), payload["header"]))
    plot(results, png_path)
    return [md_path, png_path]
