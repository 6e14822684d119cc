"""Distributed training with TensorFlow's own engine.

* ``MirroredStrategy`` over two logical CPU devices: a custom loop with
  ``strategy.run`` and ``Model.fit`` give the gradients and weights of the
  single-device run on the global batch; with Dropout and BatchNormalization in
  the block, checkpointed and plain models end equal under the strategy.
* ``MultiWorkerMirroredStrategy`` with two worker processes on 127.0.0.1: both
  workers end with the same weights, equal to a single-process run.

Logical devices must be configured before TensorFlow initializes its devices,
and a worker reads ``TF_CONFIG`` when its strategy is made, so each scenario
runs in a fresh interpreter: this file run as a script (``python
test_distribute.py ROLE OUT_DIR``) writes its results to ``OUT_DIR``, and the
tests compare them. Children have time limits and are killed on failure.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
GLOBAL_BATCH = 16
STEPS = 3
CHILD_TIMEOUT_S = 240


# --- what the children run ------------------------------------------------


def make_model(stochastic, checkpoint, runs):
    """pre -> block -> head. The block is checkpointed with apply_checkpointing;
    ``stochastic`` adds Dropout and BatchNormalization to it."""
    import keras

    from tf_checkpointing import apply_checkpointing, is_recomputing

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(8, activation="tanh", name="inner")
            self.drop = keras.layers.Dropout(0.3, seed=5, name="drop") if stochastic else None
            self.norm = keras.layers.BatchNormalization(name="norm") if stochastic else None
            self.outer = keras.layers.Dense(8, name="outer")

        def call(self, x, training=None):
            runs.append(is_recomputing())
            h = self.inner(x)
            if stochastic:
                h = self.norm(self.drop(h, training=training), training=training)
            return self.outer(h) + x

    x = keras.Input((8,))
    h = Block(name="block")(keras.layers.Dense(8, name="pre")(x))
    y = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(x, y, name="net")
    if checkpoint:
        apply_checkpointing(model, ["block"])
    init = np.random.default_rng(1)  # the same start in every process
    model.set_weights([
        init.normal(size=w.shape).astype(w.dtype) * 0.3 if w.trainable else w.numpy()
        for w in model.weights
    ])
    return model


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 8)).astype("float32")
    return x, rng.normal(size=(GLOBAL_BATCH * STEPS, 1)).astype("float32")


def custom_loop(strategy, checkpoint, runs, shard=None):
    """STEPS steps of SGD with ``strategy.run``; returns (first-step gradients
    summed over replicas, final weights). ``shard(x, y, ctx)`` picks a worker's
    part of each global batch (multi-worker)."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = make_model(False, checkpoint, runs)
        optimizer = keras.optimizers.SGD(0.1)
    runs.clear()  # forget the symbolic call that built the model
    x, y = make_data()

    def dataset_fn(ctx):
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        return batches.map(lambda a, b: shard(a, b, ctx)) if shard else batches

    if shard:
        dataset = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        dataset = strategy.experimental_distribute_dataset(dataset_fn(None))

    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.square(model(x, training=True) - y)[:, 0]
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return grads

    @tf.function
    def train(batch):
        grads = strategy.run(step, args=batch)
        return [strategy.reduce("SUM", g, axis=None) for g in grads]

    first = None
    for batch in dataset:
        grads = train(batch)
        first = [g.numpy() for g in grads] if first is None else first
    return first, [w.numpy() for w in model.weights]


def fit(strategy, stochastic, checkpoint, runs):
    import keras

    with strategy.scope():
        model = make_model(stochastic, checkpoint, runs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    runs.clear()
    x, y = make_data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def child_mirrored(out_dir):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    single = tf.distribute.get_strategy()  # the default strategy: one device
    results, runs = {}, []

    def save(name, arrays):
        for i, array in enumerate(arrays):
            results[f"{name}/{i}"] = array

    grads, weights = custom_loop(single, False, [])
    save("single_loop_grads", grads)
    save("single_loop_weights", weights)
    grads, weights = custom_loop(mirrored, True, runs)
    save("mirrored_loop_grads", grads)
    save("mirrored_loop_weights", weights)
    results["mirrored_loop_runs"] = np.array(runs)
    save("single_fit", fit(single, False, False, []))
    runs.clear()
    save("mirrored_fit", fit(mirrored, False, True, runs))
    results["mirrored_fit_runs"] = np.array(runs)
    save("mirrored_fit_stochastic_plain", fit(mirrored, True, False, []))
    save("mirrored_fit_stochastic_checkpointed", fit(mirrored, True, True, []))
    results["replicas"] = np.array(mirrored.num_replicas_in_sync)
    np.savez(os.path.join(out_dir, "mirrored.npz"), **results)


def child_worker(out_dir):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    def shard(x, y, ctx):
        n, i = ctx.num_input_pipelines, ctx.input_pipeline_id
        size = GLOBAL_BATCH // n
        return x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]

    runs = []
    grads, weights = custom_loop(strategy, True, runs, shard=shard)
    arrays = {f"grads/{i}": g for i, g in enumerate(grads)}
    arrays.update({f"weights/{i}": w for i, w in enumerate(weights)})
    np.savez(os.path.join(out_dir, f"worker{task}.npz"), runs=np.array(runs), **arrays)


# --- the tests ------------------------------------------------------------


def child_env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", **extra)
    # The package as this process imports it; the repository last, for a
    # checkout that is not installed.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH"), os.path.dirname(os.path.dirname(HERE))) if p
    )
    return env


def start(role, out_dir, **env):
    return subprocess.Popen(
        [sys.executable, HERE, role, str(out_dir)], env=child_env(**env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_all(processes, timeout=CHILD_TIMEOUT_S):
    """Waits for every child; kills them all if one fails or runs out of time."""
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=timeout)
            outputs.append(output)
            if process.returncode != 0:
                pytest.fail(f"child exited with {process.returncode}:\n{output[-4000:]}")
    except subprocess.TimeoutExpired:
        pytest.fail(f"child ran over {timeout} s")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return outputs


def load(path, prefix):
    arrays = np.load(path)
    count = len([k for k in arrays.files if k.startswith(prefix + "/")])
    return [arrays[f"{prefix}/{i}"] for i in range(count)]


def assert_all_close(actual, expected, atol=1e-5, what=""):
    assert len(actual) == len(expected) > 0
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=atol, err_msg=f"{what} leaf {i}")


@pytest.fixture(scope="module")
def mirrored_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("mirrored")
    wait_all([start("mirrored", out_dir)])
    return os.path.join(out_dir, "mirrored.npz")


def test_mirrored_custom_loop_matches_single_device(mirrored_results):
    results = np.load(mirrored_results)
    assert int(results["replicas"]) == 2
    # Each replica traced its forward and, into the gradient, its replay.
    assert list(results["mirrored_loop_runs"]) == [False, True] * 2
    assert_all_close(load(mirrored_results, "mirrored_loop_grads"),
                     load(mirrored_results, "single_loop_grads"), what="first-step gradient")
    assert_all_close(load(mirrored_results, "mirrored_loop_weights"),
                     load(mirrored_results, "single_loop_weights"), what="weights")


def test_mirrored_fit_matches_single_device(mirrored_results):
    results = np.load(mirrored_results)
    assert True in list(results["mirrored_fit_runs"])
    assert_all_close(load(mirrored_results, "mirrored_fit"),
                     load(mirrored_results, "single_fit"), what="weights")


def test_mirrored_fit_with_dropout_and_batchnorm_matches_plain(mirrored_results):
    assert_all_close(load(mirrored_results, "mirrored_fit_stochastic_checkpointed"),
                     load(mirrored_results, "mirrored_fit_stochastic_plain"), what="weights")


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.mark.slow
def test_multi_worker_mirrored_matches_single_process(tmp_path):
    import tensorflow as tf

    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    workers = [
        start("worker", tmp_path, TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}}))
        for i in range(2)
    ]
    wait_all(workers)
    results = [tmp_path / f"worker{i}.npz" for i in range(2)]
    reference_grads, reference_weights = custom_loop(tf.distribute.get_strategy(), False, [])
    for path in results:
        assert True in list(np.load(path)["runs"])  # the replay was traced into the step
        assert_all_close(load(path, "grads"), reference_grads, what=f"{path.name} gradient")
        assert_all_close(load(path, "weights"), reference_weights, what=f"{path.name} weights")
    for a, b in zip(load(results[0], "weights"), load(results[1], "weights")):
        np.testing.assert_array_equal(a, b)  # the workers agree exactly


if __name__ == "__main__":
    {"mirrored": child_mirrored, "worker": child_worker}[sys.argv[1]](sys.argv[2])
