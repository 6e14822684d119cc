"""Shared helpers: run a step with and without checkpointing and compare."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from conftest import compile_step

import tf_checkpointing as tc
from tf_checkpointing import checkpointable

REPO = Path(__file__).resolve().parents[1]  # the repository's root


def sgd_step(model, jit_compile=None):
    """A training step of ``model`` as ``fit`` runs one: loss sum(out**2), its
    gradients applied by SGD, in one ``tf.function`` (XLA with ``jit_compile``)."""
    optimizer = keras.optimizers.SGD(1e-3)

    @tf.function(jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def grads_of(fn, inputs, variables, mode, **call_kwargs):
    """(loss, input grads, variable grads) of sum(fn(*inputs)**2) in ``mode``."""

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch([x for x in xs if isinstance(x, tf.Tensor)])
            out = fn(*xs, **call_kwargs)
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32) ** 2)
                             for o in tf.nest.flatten(out)
                             if isinstance(o, tf.Tensor) and o.dtype.is_floating])
        return loss, tape.gradient(loss, list(xs) + list(variables))

    return compile_step(step, mode)(*inputs)


def assert_all_close(actual, expected, rtol=1e-5, atol=1e-6, names=None):
    """Leaf-by-leaf comparison; a None must match a None.

    Each element may differ by ``rtol`` of its own size or of its tensor's largest
    element (plus ``atol``). Plain and checkpointed graphs differ in structure, so
    XLA's CPU code generator and oneDNN (on by default on AVX-512 VNNI CPUs) may sum
    in another order: on such a CPU, an element of 0.179 in a tensor of scale 8
    moved by 2.8e-6 under XLA, and one of 0.18 in a tensor of scale 150 by 1e-4
    with oneDNN. A replay bug (another dropout mask, a statistic updated twice, a
    lost gradient) moves elements by a good part of their tensor's scale.
    """
    actual, expected = tf.nest.flatten(actual), tf.nest.flatten(expected)
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        label = names[k] if names else k
        if e is None or a is None:
            assert a is None and e is None, f"{label}: {a} vs {e}"
            continue
        e64 = np.asarray(tf.cast(e, tf.float64))
        scale = float(np.max(np.abs(e64))) if e64.size else 0.0
        np.testing.assert_allclose(
            np.asarray(tf.cast(a, tf.float64)), e64,
            rtol=rtol, atol=atol + rtol * scale, err_msg=str(label))


class Counter:
    """Counts how often the wrapped function body runs (eagerly or when traced)."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


class BlockNet(keras.Model):
    """A subclassed model, Dense -> block -> Dense, whose block is a
    ``checkpointable(layer)`` proxy when ``checkpoint`` is true."""

    def __init__(self, block, checkpoint=False, **kwargs):
        super().__init__(**kwargs)
        self.pre = keras.layers.Dense(8, name="pre")
        self.block = checkpointable(block, checkpoint=True) if checkpoint else block
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x, training=None):
        return self.head(self.block(self.pre(x), training=training))


class ResidualBlock(keras.layers.Layer):
    """Dense -> Dropout -> BatchNorm -> Dense, plus the input: a block with both
    random and moving state. Each run calls ``record(hidden)`` with the first
    Dense's output; test modules override it to log the runs."""

    def __init__(self, units=8, activation="relu", rate=0.3, seed=7, **kwargs):
        super().__init__(**kwargs)
        self.units, self.activation, self.rate, self.seed = units, activation, rate, seed
        self.inner = keras.layers.Dense(units, activation=activation, name="inner")
        self.drop = keras.layers.Dropout(rate, seed=seed, name="drop")
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.outer = keras.layers.Dense(units, name="outer")

    def build(self, input_shape):
        hidden = tuple(input_shape)[:-1] + (self.units,)
        self.inner.build(input_shape)
        self.norm.build(hidden)
        self.outer.build(hidden)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "activation": self.activation,
                "rate": self.rate, "seed": self.seed}

    def record(self, hidden):
        pass

    def call(self, x, training=None):
        h = self.inner(x)
        self.record(h)
        h = self.norm(self.drop(h, training=training), training=training)
        return self.outer(h) + x


def ran_in_fresh_process(request) -> bool:
    """Runs the calling test again in a process of its own and returns True there
    (the caller then returns); returns False inside that process. For tests that read
    the allocator's bytes in use: in a long suite, what earlier tests left cached
    (traced functions, Keras state) shifts them."""
    import os
    import subprocess
    import sys
    if os.environ.get("TF_CHECKPOINTING_FRESH_TEST") == request.node.nodeid:
        return False
    env = dict(os.environ, TF_CHECKPOINTING_FRESH_TEST=request.node.nodeid)
    # -n 0: this one test, in that process; without the plugins it needs not (their
    # imports took ~0.5 s of each such process)
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:benchmark",
               request.node.nodeid]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return True


# Models shared by the whole-model and chain tests.


class Replays(keras.layers.Layer):
    """Identity that counts how often it runs inside a replay."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.replays = 0

    def call(self, x):
        if tc.is_recomputing():
            self.replays += 1
        return x


def residual_net(count=True):
    x = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(x)
    for i in range(3):
        y = keras.layers.Conv2D(8, 3, padding="same", name=f"conv{i}")(h)
        y = keras.layers.BatchNormalization(name=f"bn{i}")(y)
        y = keras.layers.Activation("relu", name=f"relu{i}")(y)
        y = keras.layers.Dropout(0.3, name=f"drop{i}")(y)
        y = Replays(name=f"count{i}")(y) if count else y
        h = keras.layers.Add(name=f"add{i}")([h, y])
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(2, name="head")(pooled), name="residual")


def partly_frozen(frozen_blocks=2, blocks=4, width=8, image=8, count=False):
    """A residual conv net whose stem and first blocks are frozen (with ``count``,
    each block counts its replays)."""
    x = keras.Input((image, image, 3))
    stem = keras.layers.Conv2D(width, 3, padding="same", name="stem")
    h = stem(x)
    frozen = [stem]
    for i in range(blocks):
        conv = keras.layers.Conv2D(width, 3, padding="same", name=f"conv{i}")
        norm = keras.layers.BatchNormalization(name=f"bn{i}")
        y = keras.layers.Activation("relu", name=f"relu{i}")(norm(conv(h)))
        y = keras.layers.Dropout(0.3, name=f"drop{i}")(y)
        y = Replays(name=f"count{i}")(y) if count else y
        h = keras.layers.Add(name=f"add{i}")([h, y])
        if i < frozen_blocks:
            frozen += [conv, norm]
    out = keras.layers.Dense(2, name="head")(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(x, out)
    for layer in frozen:
        layer.trainable = False
    return model


# The scripts' training step: one tf.function SGD step.
STEP = textwrap.dedent("""
    import json, os
    import keras, tensorflow as tf
    import tf_checkpointing as tc

    from helpers import sgd_step as make_step  # tests/ is on the scripts' path
""")


def run_script(code):
    """Runs ``code`` in a fresh process with the allocator's statistics on and
    tests/ on its path; returns what it printed."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def with_spans(plan, spans, policies=(), mode=None):
    """``plan`` (a ModelPlan) with its checkpointed regions set to ``spans``:
    ``(start, stop, inner spans)`` call ranges, each under the policy at its
    position in ``policies`` (a test forcing regions by position; by name, use
    ``ModelPlan.from_regions``)."""
    import dataclasses

    from tf_checkpointing.planning.plans._plan import pieces_of_spans

    return dataclasses.replace(plan, pieces=pieces_of_spans(0, len(plan.names), spans, policies),
                               mode=mode or plan.mode)


def plan_of(names, spans, mode="graph"):
    """A ModelPlan of a model whose calls are ``names``, checkpointing ``spans``."""
    return with_spans(tc.ModelPlan(names=tuple(names), pieces=(), mode=mode), spans)


def conv_bn_net(blocks=3, channels=4, dropout=0.0, dense_head=False):
    """Conv-BN-ReLU blocks (``conv{k}``, ``bn{k}``, ``relu{k}``, then dropout
    ``drop{k}`` where ``dropout``), on 8x8 images of ``channels`` channels, and a
    1x1 convolution or (``dense_head``) a Dense layer as the head; the same
    weights and seeds each time."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8, 8, channels))
    h = x
    for k in range(blocks):
        h = keras.layers.Conv2D(8, 3, padding="same", name=f"conv{k}")(h)
        h = keras.layers.BatchNormalization(name=f"bn{k}")(h)
        h = keras.layers.ReLU(name=f"relu{k}")(h)
        if dropout:
            h = keras.layers.Dropout(dropout, seed=k, name=f"drop{k}")(h)
    if dense_head:
        return keras.Model(x, keras.layers.Dense(2, name="head")(keras.layers.Flatten()(h)))
    return keras.Model(x, keras.layers.Conv2D(2, 1, name="head")(h))

