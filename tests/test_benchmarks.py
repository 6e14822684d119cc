"""The benchmarks run end to end on toy shapes and write what they promise.

Each runs as a subprocess, as a user would run it: `python benchmarks/run.py --tiny`
and `python benchmarks/core.py` with a small chain, into a temporary directory.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(script, *args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


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
    assert re.search(r"^gpt2/function: \d+ strategies in [\d.]+ s$", stderr, re.MULTILINE), stderr
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
    assert "### Targets (gpt2, function)" in table
    assert table.strip() in stdout  # the same table on stdout
    assert "Total time" in stdout
    assert (out / "tiny.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_tiny_run_measures_every_model_and_strategy(tiny_run):
    _, _, payload, _ = tiny_run
    results = payload["results"]
    assert {r["model"] for r in results} == {"mlp", "gpt2", "unet"}
    assert {r["mode"] for r in results} == {"eager", "function", "xla"}
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
    assert rows["gpt2", "function", "recompute_grad"]["grad_error"] > 0.1
    assert rows["gpt2", "function", "checkpointable"]["grad_error"] <= 1e-5
    # BatchNorm in the U-Net: tf.recompute_grad updates the statistics twice.
    assert rows["unet", "function", "recompute_grad"]["state_error"] > 0.5
    assert rows["unet", "function", "checkpointable"]["state_error"] <= 1e-5
    targets = payload["targets"]
    assert {t["target"] for t in targets} == {"peak memory", "step time", "gradients",
                                              "largest batch"}


@pytest.mark.slow
def test_filters_and_unknown_names():
    done = _run("run.py", "--tiny", "--models", "nope")
    assert done.returncode == 2
    assert "expected a comma-separated subset of mlp,gpt2,unet" in done.stderr
    assert "'nope'" in done.stderr


@pytest.mark.slow
def test_core_benchmark_smoke(tmp_path):
    done = _run("core.py", "--layers", "3", "--width", "32", "--batch", "64", "--modes",
                "eager,function", "--repeats", "2", "--overhead-samples", "3",
                "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    payload = json.loads((tmp_path / "core.json").read_text())
    assert [t["target"] for t in payload["targets"]] == [
        "peak memory (eager)", "peak memory (function)", "step time (function)",
        "no-tape call overhead"]
    assert {r["strategy"] for r in payload["results"]} == {
        "plain", "recompute_grad", "checkpointable"}
    assert "### Targets" in (tmp_path / "core.md").read_text()
    assert "No-tape call of Dense(64)" in done.stdout
