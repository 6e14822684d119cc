"""Plans that outlive the process: a plan's config is JSON, made again in another
process, and a plan that no longer fits the model is refused, never applied."""

import json
import os
import subprocess
import sys
import warnings

import keras
import pytest
import tensorflow as tf
from helpers import REPO, assert_all_close, grads_of, residual_net

import tf_checkpointing as tc


def test_a_plan_round_trips_through_json_with_its_policies():
    keras.utils.set_random_seed(0)
    model = residual_net(count=False)
    names = list(tc.ModelPlan.from_regions(model, [["stem"]]).names)
    plan = tc.ModelPlan.from_regions(
        model, [names[1:5], names[6:9] + [names[9:11]]],
        policies=[tc.policies.dots_saveable, tc.policies.save_only_these_names("a", "b")])
    again = tc.ModelPlan.from_config(json.loads(json.dumps(plan.to_config())))
    # A name policy is made again from its names (a new function, the same policy).
    assert again.to_config() == plan.to_config() and str(again) == str(plan)
    assert again.regions == plan.regions and again.regions[1][-1] == names[9:11]
    assert again.pieces[1].policy is tc.policies.dots_saveable


def test_a_plan_saved_in_one_process_trains_exactly_in_another(tmp_path):
    keras.utils.set_random_seed(0)
    model = residual_net(count=False)
    x = tf.random.stateless_normal([4, 8, 8, 3], [0, 1])
    plan = tc.plan_model(model, x, budget="min", mode="eager")
    assert plan.regions
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_config()))
    script = f"""
import json, keras, tensorflow as tf, tf_checkpointing as tc
from helpers import residual_net
keras.utils.set_random_seed(0)
model = residual_net(count=False)
plan = tc.ModelPlan.from_config(json.loads(open({str(path)!r}).read()))
tc.apply_checkpointing(model, plan=plan)
print("REGIONS", json.dumps(model.call.plan.regions))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
               TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.split("REGIONS", 1)[1]) == plan.regions
    # In this process too: the loaded plan gives the plain model's gradients.
    keras.utils.set_random_seed(0)
    twin = residual_net(count=False)
    expected = grads_of(lambda x: twin(x, training=False), [x], twin.trainable_variables,
                        "eager")
    tc.apply_checkpointing(model, plan=tc.ModelPlan.from_config(json.loads(path.read_text())))
    got = grads_of(lambda x: model(x, training=False), [x], model.trainable_variables, "eager")
    assert_all_close(got, expected)


def test_a_plan_that_no_longer_fits_the_model_is_refused():
    keras.utils.set_random_seed(0)
    model = residual_net(count=False)
    config = tc.plan_model(model, tf.random.normal([4, 8, 8, 3]), budget="min",
                           mode="eager").to_config()
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", name="stem")(x)  # 16 filters, not 8
    changed = keras.Model(x, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h)))
    with pytest.raises(ValueError, match=r"argument `plan` was made for another model"):
        tc.apply_checkpointing(changed, plan=tc.ModelPlan.from_config(config))


def _sliced(width):
    """Two models whose graphs differ only in an op node's argument: the slice."""
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(x)
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv")(h[..., :width])
    return keras.Model(x, keras.layers.GlobalAveragePooling2D(name="pool")(h))


def test_a_plan_for_another_slice_of_the_same_names_is_refused(tmp_path):
    keras.backend.clear_session()
    wide = _sliced(8)
    plan = tc.ModelPlan.from_regions(wide, [list(tc.ModelPlan.from_regions(
        wide, [["stem"]]).names[:3])])
    keras.backend.clear_session()
    narrow = _sliced(1)  # the same layer and op names, in the same order
    assert plan.names == tc.ModelPlan.from_regions(narrow, [["stem"]]).names
    with pytest.raises(ValueError, match=r"made for another model.*with the same names "
                                         r"but other layers, arguments or connections"):
        tc.apply_checkpointing(narrow, plan=plan)
    keras.backend.clear_session()
    tc.apply_checkpointing(_sliced(8), plan=plan)  # the same model: accepted


def _cached_step(tmp_path, budget="min", build=None):
    """A fresh model (same seed) with ``apply_checkpointing(budget=, plan_cache=)``,
    and one traced training step run on it; returns the model."""
    keras.utils.set_random_seed(0)
    model = (build or residual_net)(count=False)
    tc.apply_checkpointing(model, budget=budget, plan_cache=str(tmp_path))
    x = tf.random.stateless_normal([4, 8, 8, 3], [0, 1])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    step()
    return model


def test_plan_cache_reads_the_plan_of_an_earlier_run_instead_of_planning(tmp_path, monkeypatch):
    first = _cached_step(tmp_path)
    files = list(tmp_path.glob("plan-*.json"))
    assert len(files) == 1 and first.call.plan.regions
    # The next run (a new model of the same architecture) plans nothing: it reads the file.
    import tf_checkpointing._plan_maker as runner

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again although the plan was saved")

    monkeypatch.setattr(runner, "plan_graph", no_planning)
    second = _cached_step(tmp_path)
    assert second.call.plan.to_config() == first.call.plan.to_config()
    monkeypatch.undo()
    # Another budget is another question: planned, and saved beside the first.
    _cached_step(tmp_path, budget=first.call.plan.plain_peak_bytes)
    assert len(list(tmp_path.glob("plan-*.json"))) == 2


def _op_net(count=False):
    """A residual net whose skips are op nodes (``h + y``, a Keras ``Operation``
    with no weights), as much hand-written functional code adds them."""
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(x)
    for i in range(3):
        y = keras.layers.Conv2D(8, 3, padding="same", name=f"conv{i}")(h)
        h = h + keras.layers.BatchNormalization(name=f"bn{i}")(y)
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(2, name="head")(pooled))


def test_plan_cache_keys_a_model_with_op_nodes(tmp_path, monkeypatch):
    # Keras numbers op nodes per process (add, add_1, ...); a new process numbers
    # them as the first did, as clear_session does here.
    keras.backend.clear_session()
    first = _cached_step(tmp_path, build=_op_net)
    assert len(list(tmp_path.glob("plan-*.json"))) == 1 and first.call.plan.regions
    import tf_checkpointing._plan_maker as runner

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again although the plan was saved")

    monkeypatch.setattr(runner, "plan_graph", no_planning)
    keras.backend.clear_session()
    assert _cached_step(tmp_path, build=_op_net).call.plan.to_config() == \
        first.call.plan.to_config()


def test_plan_cache_replans_over_a_file_it_cannot_use_and_says_which(tmp_path):
    _cached_step(tmp_path)
    (saved,) = tmp_path.glob("plan-*.json")
    saved.write_text("{not json")
    with pytest.warns(UserWarning, match=r"plan_cache.*cannot be used.*planning again"):
        model = _cached_step(tmp_path)
    assert model.call.plan.regions
    assert json.loads(saved.read_text())["plan"] == model.call.plan.to_config()


def test_plan_cache_refuses_what_is_not_a_folder_with_a_budget(tmp_path):
    model = residual_net(count=False)
    with pytest.raises(TypeError, match=r"`plan_cache` must be a folder.*received plan_cache=3"):
        tc.apply_checkpointing(model, budget="min", plan_cache=3)
    plan = tc.ModelPlan.from_regions(model, [["stem"]])
    with pytest.raises(TypeError, match=r"`plan_cache`.*with plan"):
        tc.apply_checkpointing(model, plan=plan, plan_cache=str(tmp_path))
    with pytest.raises(TypeError, match=r"`plan_cache`.*with select"):
        tc.apply_checkpointing(model, ["stem"], plan_cache=str(tmp_path))


@pytest.fixture(scope="module")
def cached_plan(tmp_path_factory):
    """The plan file of ``_cached_step``'s model (planned once for the module's
    tests): its name, its key and the model's layer graph."""
    folder = tmp_path_factory.mktemp("plan_cache")
    model = _cached_step(folder)
    (saved,) = folder.glob("plan-*.json")
    return saved.name, json.loads(saved.read_text())["key"], model.call.maker.graph


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "null", '{"key": 3}',
                                     '{"plan": []}', '{"plan": {"names": 5}}'])
def test_plan_cache_replans_over_valid_json_that_is_not_a_plan(tmp_path, content, cached_plan):
    # Valid JSON that is no plan once crashed the first step (`'list' object has
    # no attribute 'get'`). Read as the plan maker reads it (planning again after
    # a refused file: test_plan_cache_replans_over_a_file_it_cannot_use_and_says_which).
    from tf_checkpointing.planning.plans._plan_files import read_plan

    name, key, graph = cached_plan
    (tmp_path / name).write_text(content)
    with pytest.warns(UserWarning, match=r"plan_cache.*cannot be used.*planning again"):
        assert read_plan(tmp_path, key, graph) is None
    # The same file with the plan in it is read: what refused the others is its content.
    (tmp_path / name).write_text(json.dumps(
        {"key": key, "plan": tc.ModelPlan.from_regions(graph.model, [["stem"]]).to_config()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_plan(tmp_path, key, graph).regions == [["stem"]]


def test_plan_cache_that_cannot_be_a_folder_is_refused_when_given(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("")
    model = residual_net(count=False)
    with pytest.raises(ValueError, match=r"argument `plan_cache` must be a folder.*"
                                         r"a-file'.*it is a file, not a folder.*Fix"):
        tc.apply_checkpointing(model, budget="min", plan_cache=str(taken))
    with pytest.raises(ValueError, match=r"`plan_cache`.*no folder can be made there"):
        tc.apply_checkpointing(model, budget="min", plan_cache=str(taken / "below"))
    assert "call" not in vars(model)  # refused before anything was installed


def test_plan_cache_that_cannot_be_written_warns_and_trains(tmp_path, monkeypatch):
    from tf_checkpointing.planning.plans import _plan_files

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_plan_files.tempfile, "mkstemp", full)
    with pytest.warns(UserWarning, match=r"plan_cache.*could not be saved.*No space left.*"
                                         r"training goes on"):
        model = _cached_step(tmp_path)
    assert model.call.plan.regions and not list(tmp_path.glob("plan-*.json"))


def test_a_refused_plan_names_the_first_call_that_differs():
    keras.utils.set_random_seed(0)
    model = residual_net(count=False)
    plan = tc.ModelPlan.from_regions(model, [["stem", "conv0"]])
    x = keras.Input((8, 8, 3), name="image")  # residual_net, but conv1's kernel is 5x5
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(x)
    for i in range(3):
        y = keras.layers.Conv2D(8, 5 if i == 1 else 3, padding="same", name=f"conv{i}")(h)
        y = keras.layers.BatchNormalization(name=f"bn{i}")(y)
        y = keras.layers.Activation("relu", name=f"relu{i}")(y)
        y = keras.layers.Dropout(0.3, name=f"drop{i}")(y)
        h = keras.layers.Add(name=f"add{i}")([h, y])
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    other = keras.Model(x, keras.layers.Dense(2, name="head")(pooled))
    with pytest.raises(ValueError, match=r"made for another model.*first that differs is "
                                         r"call \d+, `conv1` here.*kernel_size', \(3, 3\)"
                                         r".*kernel_size', \(5, 5\)"):
        tc.apply_checkpointing(other, plan=plan)


def test_a_plans_config_given_as_the_plan_names_from_config_briefly():
    model = residual_net(count=False)
    config = tc.ModelPlan.from_regions(model, [["stem", "conv0"]]).to_config()
    with pytest.raises(TypeError, match=r"argument `plan` must be a ModelPlan; received a "
                                        r"dict.*ModelPlan.from_config") as caught:
        tc.apply_checkpointing(model, plan=config)
    assert len(str(caught.value)) < 400, str(caught.value)
