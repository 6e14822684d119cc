"""The benchmarks run end to end on toy shapes and write what they promise.

Each runs as a subprocess, as a user would run it (`python benchmarks/run.py --tiny`,
`python -m benchmarks.chain.sequential --tiny`, ...), into a temporary directory:
the main job and one or more scripts of each family (benchmarks/README.md). The
committed results' Markdown is checked against their JSON, without measuring.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(script, *args, timeout=240):
    """`python benchmarks/<script> args`; a dotted name runs as `python -m <name>`."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    command = ["-m", script] if script.startswith("benchmarks.") else [
        str(REPO / "benchmarks" / script)]
    return subprocess.run([sys.executable, *command, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = _run("run.py", "--tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done.stdout, json.loads((out / "tiny.json").read_text()), done.stderr


@pytest.mark.slow
def test_tiny_run_log_is_readable(tiny_run):
    """Output to a pipe (a log): no TensorFlow start-up noise, no carriage-return
    progress bar, one line per model and mode."""
    stderr = tiny_run[3]
    assert "cudart_stub" not in stderr and "absl::InitializeLog" not in stderr, stderr
    assert "\r" not in stderr
    assert re.search(r"^gpt2/graph: \d+ strategies in [\d.]+ s$", stderr, re.MULTILINE), stderr
    assert "Warning" not in stderr, stderr  # the library warns about nothing it runs itself


def test_results_go_to_an_ignored_directory_unless_asked():
    from benchmarks import _cli

    parser = argparse.ArgumentParser()
    _cli.add_output_arguments(parser)
    assert _cli.output_dir(parser.parse_args([])) == REPO / "benchmarks/results/latest"
    assert _cli.output_dir(parser.parse_args(["--update-results"])) == (
        REPO / "benchmarks/results")
    assert _cli.output_dir(parser.parse_args(["--out", "/tmp/x"])) == Path("/tmp/x")
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/latest/x.md"],
                             cwd=REPO)
    assert ignored.returncode == 0  # git ignores it: a user's run leaves the checkout clean


@pytest.mark.slow
def test_tiny_run_writes_table_json_and_png(tiny_run):
    out, stdout, payload, _ = tiny_run
    table = (out / "tiny.md").read_text()
    assert "| model | mode | strategy | peak MiB |" in table
    assert "### Targets (gpt2, graph)" in table
    assert table.strip() in stdout  # the same table on stdout
    assert "Total time" in stdout
    assert (out / "tiny.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_tiny_run_measures_every_model_and_strategy(tiny_run):
    _, _, payload, _ = tiny_run
    results = payload["results"]
    assert {r["model"] for r in results} == {"mlp", "gpt2", "unet"}
    assert {r["mode"] for r in results} == {"eager", "graph", "xla"}
    assert payload["environment"]["TF_CPU_ALLOCATOR_USE_BFC"] == "true"
    # The scripts pin oneDNN on (the U-Net's peaks depend on it) unless the caller set it.
    pinned = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").lower() in ("1", "true")
    assert payload["environment"]["onednn"] is pinned
    for r in results:
        if r["strategy"] in ("sqrt_segments", "budget_plan") and r["status"] == "skipped":
            assert "not exported" in r["note"]
            continue
        assert r["status"] == "ok", r
        assert r["peak_bytes"] > 0 and len(r["step_times_s"]) >= 3
        assert r["memory_ratio"] > 0 and r["time_ratio"] > 0
        if r["strategy"] == "plain":
            assert r["grad_error"] == 0.0 and r["memory_ratio"] == 1.0


@pytest.mark.slow
def test_tiny_run_shows_the_defects_it_is_meant_to_show(tiny_run):
    _, _, payload, _ = tiny_run
    rows = {(r["model"], r["mode"], r["strategy"]): r for r in payload["results"]}
    # Dropout in the decoder: tf.recompute_grad replays another mask, we do not.
    assert rows["gpt2", "graph", "recompute_grad"]["grad_error"] > 0.1
    assert rows["gpt2", "graph", "checkpointable"]["grad_error"] <= 1e-5
    # BatchNorm in the U-Net: tf.recompute_grad updates the statistics twice.
    assert rows["unet", "graph", "recompute_grad"]["state_error"] > 0.5
    assert rows["unet", "graph", "checkpointable"]["state_error"] <= 1e-5
    targets = payload["targets"]
    assert {t["target"] for t in targets} == {"peak memory", "step time", "gradients",
                                              "largest batch"}


def test_filters_and_unknown_names(capsys):
    # The parser alone, in this process: a subprocess would start TensorFlow (which
    # run.py imports before it parses) only to read a usage error.
    from benchmarks import run

    with pytest.raises(SystemExit) as exited:
        run.parse_args(["--tiny", "--models", "nope"])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "expected a comma-separated subset of mlp,gpt2,unet" in stderr
    assert "'nope'" in stderr
    assert run.parse_args(["--tiny", "--models", "gpt2,unet"]).models == ["gpt2", "unet"]


@pytest.mark.slow
def test_core_benchmark_smoke(tmp_path):
    done = _run("chain/core.py", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    payload = json.loads((tmp_path / "core.json").read_text())
    assert payload["config"] == dict(layers=3, width=32, batch=64)
    assert [t["target"] for t in payload["targets"]] == [
        "peak memory (eager)", "peak memory (graph)", "step time (graph)",
        "no-tape call overhead"]
    assert {r["strategy"] for r in payload["results"]} == {
        "plain", "recompute_grad", "checkpointable"}
    assert "### Targets" in (tmp_path / "core.md").read_text()
    assert "No-tape call of Dense(64)" in done.stdout


@pytest.mark.slow
def test_sequential_benchmark_smoke(tmp_path):
    done = _run("benchmarks.chain.sequential", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    payload = json.loads((tmp_path / "sequential_tiny.json").read_text())
    assert {p["mode"] for p in payload["plans"]} == {"eager", "graph"}
    assert all(row["grad_error"] <= 1e-5 for row in payload["strategies"].values())
    assert "| strategy | peak eager MiB | peak tf.function MiB |" in done.stdout


@pytest.mark.slow
def test_xla_chain_smoke():
    done = _run("chain/xla_chain.py", "--tiny")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "3 x Dense(32, gelu), batch 64, XLA" in done.stdout
    error = float(re.search(r"largest gradient difference (\S+)", done.stdout).group(1))
    assert error <= 1e-5, done.stdout


@pytest.mark.slow
def test_efficientnet_chain_smoke(tmp_path):
    done = _run("chain/efficientnet_chain.py", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    (row,) = json.loads((tmp_path / "efficientnet_chain.json").read_text())
    assert (row["budget"], row["xla"], row["pieces"]) == ("min", False, 14)
    assert row["peak_mib"] > 0 and row["segments"] >= 1 and row["predicted_mib"] > 0
    assert "| min | tf.function |" in (tmp_path / "efficientnet_chain.md").read_text()


@pytest.mark.slow
def test_whole_model_smoke(tmp_path):
    """The whole-model family end to end: a worker process for the model, each
    strategy's peaks in a fresh process of its own, the report."""
    done = _run("whole_model/run.py", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "whole_model.json").read_text())
    assert [r["strategy"] for r in rows] == ["plain", "budget 0.50"]
    assert all(r["peak_mib"] > 0 and r["step_x_plain_interleaved"] > 0 for r in rows)
    assert rows[1]["regions"] >= 1 and rows[1]["budget_mib"] > 0
    assert "## Targets" in (tmp_path / "whole_model.md").read_text()
    assert (tmp_path / "whole_model.png").read_bytes()[:8] == PNG_MAGIC
    assert "cudart_stub" not in done.stderr  # the workers start TensorFlow quietly too


@pytest.mark.parametrize("name", ["quick", "gpt2_full", "gpt2_timing", "policies_eager",
                                  "policies_gpt2", "policies_mlp_unet",
                                  "policy_choice_gpt2"])
def test_committed_results_markdown_is_their_json(name):
    """The committed Markdown is what the report makes of the committed JSON (modes
    named as the library names them), as `run.py --rerender` writes it."""
    from benchmarks import run_report
    from benchmarks.harness import RunResult

    payload = json.loads((REPO / f"benchmarks/results/{name}.json").read_text())
    results = [RunResult.from_dict(r) for r in payload["results"]]
    assert {r.mode for r in results} <= {"eager", "graph", "xla"}
    text = run_report.markdown_report(results, run_report.check_targets(results),
                                      payload["header"])
    assert text == (REPO / f"benchmarks/results/{name}.md").read_text()


def test_committed_family_results_markdown_is_their_json():
    from benchmarks.chain import core
    from benchmarks.harness import RunResult
    from benchmarks.milp import units
    from benchmarks.whole_model import applications_sweep, budget_sweep
    from benchmarks.whole_model import report as whole_model_report

    results = REPO / "benchmarks/results"
    payload = json.loads((results / "core.json").read_text())
    assert core.markdown([RunResult.from_dict(r) for r in payload["results"]],
                         payload["no_tape_overhead"], payload["targets"],
                         payload["config"]) == (results / "core.md").read_text()
    rows = json.loads((results / "applications_sweep.json").read_text())
    assert applications_sweep.report(rows) == (results / "applications_sweep.md").read_text()
    rows = json.loads((results / "whole_model.json").read_text())
    assert whole_model_report.markdown_table(rows) in (results / "whole_model.md").read_text()
    rows = json.loads((results / "budget_sweep.json").read_text())
    assert budget_sweep.report(rows) == (results / "budget_sweep.md").read_text()
    payload = json.loads((results / "region_units.json").read_text())
    assert units.report(payload["rows"]) + "\n" == (results / "region_units.md").read_text()


def test_least_plan_against_the_blocks_compares_the_plans_before_their_peaks():
    from benchmarks.whole_model.report import targets

    blocks = [[4, 5, True, [], None], [5, 6, True, [], None]]
    keeping = [[4, 5, True, [], "reductions_saveable"], [5, 6, True, [], None]]

    def check(least_pieces, least_mib, xla=False):
        rows = [dict(model="gpt2", strategy="hand-written per-block", xla=xla, peak_mib=52.8,
                     pieces=blocks),
                dict(model="gpt2", strategy="budget=min", xla=xla, peak_mib=least_mib,
                     pieces=least_pieces)]
        (found,) = [t for t in targets(rows) if "per-block selection" in t[0]]
        return found

    same = check(blocks, 53.4)
    assert same[2] and "one plan" in same[1]  # the same regions: the op order's noise
    assert not check(keeping, 53.4)[2]  # another plan (a region keeps its norms): peaks
    assert check(keeping, 52.0, xla=True)[2] and "XLA" in check(keeping, 52.0, xla=True)[0]


@pytest.mark.parametrize("module_name", ["benchmarks.whole_model.budget_sweep",
                                         "benchmarks.whole_model.user_path_report"])
def test_report_examples_run(module_name):
    """The examples in the reports' docstrings run as written (they need no TensorFlow)."""
    import doctest
    import importlib

    failed, attempted = doctest.testmod(importlib.import_module(module_name))
    assert attempted and not failed
