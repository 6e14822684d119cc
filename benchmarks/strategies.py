"""The checkpointing strategies compared, each as "how to run the chain of blocks".

    plain            no checkpointing
    recompute_grad   `tf.recompute_grad` around each block
    keras_remat      `keras.remat` around each block (on the TF backend: tf.recompute_grad)
    checkpointable   `tf_checkpointing.checkpointable(block, checkpoint=True)` per block
    sqrt_segments    `tf_checkpointing.checkpoint_sequential(blocks, x, segments="sqrt")`
    budget_plan      `tf_checkpointing.CheckpointedSequential(blocks, budget=...)`, the
                     budget a fraction of plain's measured peak (default 1/3)
    dots_saveable    `checkpointable(block, checkpoint=True, policy=policies.dots_saveable)`
                     per block: keeps matrix products, convolutions and dropout masks,
                     replays the rest
    dots_no_masks    JAX's `dots_saveable`: the products only (the replay draws the
                     dropout masks again)
    dots_no_batch    the same with `policies.dots_with_no_batch_dims_saveable`
    qkv_mlp_out      MaxText-style: keeps the attention's q/k/v projections and the MLP
                     output (`checkpoint_name(..., "mlp_out")` in the decoder block)
    attn_mlp_out     keeps the named attention output and MLP output
                     (`policies.save_only_these_names("attention_out", "mlp_out")`)
    policy_plan      `CheckpointedSequential(blocks, budget=..., policies=[dots_saveable])`
                     for half of plain's peak: per block plain, dots_saveable or a full
                     replay (alone or in a segment). Until the library dropped
                     `planning.plan_policies`, this strategy was that per-block planner
                     (its committed results: results/policy_choice_gpt2.*, policies_gpt2.*)
    budget_replay    `CheckpointedSequential(blocks, budget=...)` for half of plain's peak:
                     plain blocks and (nested) full-replay segments
    budget_policies  the same with `policies="auto"`: per block also dots_saveable or
                     dots_with_no_batch_dims_saveable, the least replay time in the budget

`tf.recompute_grad` accepts keyword arguments only in eager mode, so for the two
peers `training=True` is closed over and the state's tensors are passed positionally:
their best use, not a strawman. A strategy whose API `tf_checkpointing` does not
export is skipped (`unavailable_reason` says why). A chain may carry a `note` (the
budget plan describes its schedule).

Example:
    >>> import keras, tensorflow as tf
    >>> chain = STRATEGIES["recompute_grad"].build([keras.layers.Dense(4)], {})
    >>> chain(tf.ones([2, 3])).shape
    TensorShape([2, 4])
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

Chain = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A named way of running blocks; `build(blocks, options)` returns state -> state."""

    name: str
    description: str
    build: Callable[[list, dict], Chain]
    needs: Optional[str] = None  # attribute of tf_checkpointing this strategy needs

    def unavailable_reason(self) -> Optional[str]:
        if self.needs is None:
            return None
        import tf_checkpointing

        if hasattr(tf_checkpointing, self.needs):
            return None
        return f"tf_checkpointing.{self.needs} is not exported by this version"


def _plain(blocks: list, options: dict) -> Chain:
    def chain(state: Any) -> Any:
        for block in blocks:
            state = block(state, training=True)
        return state

    return chain


def _per_block_peer(wrap: Callable[[Callable], Callable]) -> Callable[[list, dict], Chain]:
    """Wraps each block as `wrap(f)` with `f(*state_tensors)`: the peers' calling form."""

    def build(blocks: list, options: dict) -> Chain:
        tuple_state = options.get("tuple_state", False)

        def positional(block: Any) -> Callable[..., Any]:
            def f(*leaves: tf.Tensor) -> Any:
                out = block(tuple(leaves) if tuple_state else leaves[0], training=True)
                return list(out) if tuple_state else out

            return f

        wrapped = [wrap(positional(block)) for block in blocks]

        def chain(state: Any) -> Any:
            for fn in wrapped:
                state = tuple(fn(*state)) if tuple_state else fn(state)
            return state

        return chain

    return build


def _checkpointable(blocks: list, options: dict) -> Chain:
    from tf_checkpointing import checkpointable

    wrapped = [checkpointable(block, checkpoint=True) for block in blocks]
    return _plain(wrapped, options)


def _with_policy(policy_name: str) -> Callable[[list, dict], Chain]:
    """`checkpointable` per block with a save policy (the name of one in POLICIES)."""

    def build(blocks: list, options: dict) -> Chain:
        from tf_checkpointing import checkpointable

        policy = POLICIES[policy_name]()
        wrapped = [checkpointable(block, checkpoint=True, policy=policy) for block in blocks]
        return _plain(wrapped, options)

    return build


def _qkv_and_mlp_out() -> Callable[[Any], bool]:
    """MaxText's `qkv_proj` + `mlpwo` choice on the Keras decoder block: Keras runs
    the q/k/v EinsumDense layers as matrix products named `.../query/MatMul` etc."""
    import re

    qkv = re.compile(r"/(query|key|value)(_\d+)?/")

    def policy(out: Any) -> bool:
        return out.name == "mlp_out" or bool(out.op_name and qkv.search(out.op_name))

    return policy


def _dots_without_masks() -> Callable[[Any], bool]:
    """JAX's `dots_saveable`: the products only; the replay draws the dropout masks again."""
    from tf_checkpointing import policies

    def dots_without_masks(out: Any) -> bool:
        return policies.dots_saveable(out) and not out.random

    return dots_without_masks


def _policies() -> dict[str, Callable[[], Any]]:
    from tf_checkpointing import policies

    return {
        "dots_saveable": lambda: policies.dots_saveable,
        "dots_no_masks": _dots_without_masks,
        "dots_no_batch": lambda: policies.dots_with_no_batch_dims_saveable,
        "qkv_mlp_out": _qkv_and_mlp_out,
        "attn_mlp_out": lambda: policies.save_only_these_names("attention_out", "mlp_out"),
    }


POLICIES: dict[str, Callable[[], Any]] = _policies()
POLICY_PLAN_FRACTION = 0.5


def _half_budget(policies: Any) -> Callable[[list, dict], Chain]:
    """`CheckpointedSequential(blocks, budget=..., policies=...)` for half of plain's
    measured peak, the chain's share (the stem and head's part of plain's peak is taken
    off), planned on its first call in the step's mode. `policies`: None, "auto", or
    names of save policies in POLICIES."""

    def build(blocks: list, options: dict) -> Chain:
        import tf_checkpointing

        mode = options.get("mode", "eager")
        choice = ([POLICIES[name]() for name in policies]
                  if isinstance(policies, tuple) else policies)
        roomy = tf_checkpointing.plans.plan_sequential(  # the chain's plain peak, measured
            blocks, options["sample_state"], budget=2**50, mode=mode, training=True)
        wanted = int(POLICY_PLAN_FRACTION * options["plain_peak_bytes"])
        # The stem and head's share (never negative: the chain's profile may read a
        # little more than the whole step's plain peak).
        outside = max(options["plain_peak_bytes"] - roomy.plain_peak_bytes, 0)
        budget = max(wanted - outside, int(1.02 * (roomy.min_budget_bytes or 0)))
        sequential = tf_checkpointing.CheckpointedSequential(blocks, budget=budget,
                                                             policies=choice)

        def chain(state: Any) -> Any:
            return sequential(state, training=True)

        first_call = chain if mode == "eager" else tf.function(
            chain, autograph=False, jit_compile=mode == "xla")
        with tf.GradientTape():  # it plans on its first call that can be differentiated
            first_call(options["sample_state"])
        plan = sequential.plan
        chain.note = (  # type: ignore[attr-defined]
            f"for {wanted / 2**20:.1f} MiB: " + str(plan).replace("\n", ";"))
        return chain

    return build


def _sqrt_segments(blocks: list, options: dict) -> Chain:
    import tf_checkpointing

    checkpoint_sequential = getattr(tf_checkpointing, "checkpoint_sequential")  # noqa: B009

    def chain(state: Any) -> Any:
        return checkpoint_sequential(blocks, state, segments="sqrt", training=True)

    return chain


def _budget_plan(blocks: list, options: dict) -> Chain:
    """`CheckpointedSequential(blocks, budget=...)`, planned now on the base batch.

    It is planned for the mode the step runs in (its first call is traced in a
    tf.function for "graph", with jit_compile=True for "xla", so it plans for
    what a graph, or XLA, keeps).
    The layer form plans once, on its first call with fully known shapes, and keeps
    the plan for other batch sizes; `checkpoint_sequential(budget=...)` re-plans per
    input shape and cannot plan inside a tf.function traced with an unknown batch size.
    A budget below the least any schedule needs is raised to that least (said in the
    note), so the row still shows what the planner can do.
    """
    import tf_checkpointing

    layer_class = getattr(tf_checkpointing, "CheckpointedSequential")  # noqa: B009

    def planned(budget: int) -> Any:
        sequential = layer_class(blocks, budget=budget)

        def first_call(state: Any) -> Any:
            with tf.GradientTape():  # it plans on its first call that can be differentiated
                return sequential(state, training=True)

        if options.get("mode", "eager") != "eager":
            # Planned while a tf.function is traced: for what a graph (or XLA) keeps.
            # The step's own traces have a None batch, for which no plan can be made.
            first_call = tf.function(first_call, autograph=False,
                                     jit_compile=options["mode"] == "xla")
        first_call(options["sample_state"])
        return sequential

    wanted = options["plan_budget_bytes"]
    least = tf_checkpointing.plans.plan_sequential(  # the same profile the layer's call finds
        blocks, options["sample_state"], budget=2**50, mode=options.get("mode", "eager"),
        training=True).min_budget_bytes or 0
    sequential = planned(max(wanted, least))
    plan = sequential.plan

    def chain(state: Any) -> Any:
        # The step is traced with a None batch (it also runs the half batch), so
        # the layer warns that its plan holds only for batches no larger than the
        # one it was made for: the base batch, the largest this benchmark runs.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r".*unknown batch size", UserWarning)
            return sequential(state, training=True)

    raised = f" (asked {wanted / 2**20:.1f} MiB: below the planner's least)" \
        if least > wanted else ""
    pieces = " ".join(f"[{a},{b}){'*' if c else ''}"
                      for (a, b), c in zip(plan.segments, plan.checkpointed))
    chain.note = (  # type: ignore[attr-defined]
        f"plan for {plan.budget_bytes / 2**20:.1f} MiB{raised}: {pieces} (* checkpointed), "
        f"{plan.extra_forward_layers} extra block forwards, predicted peak "
        f"{(plan.predicted_peak_bytes or 0) / 2**20:.1f} MiB")
    return chain


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("plain", "no checkpointing", _plain),
    Strategy("recompute_grad", "tf.recompute_grad per block",
             _per_block_peer(tf.recompute_grad)),
    Strategy("keras_remat", "keras.remat per block", _per_block_peer(keras.remat)),
    Strategy("checkpointable", "tf_checkpointing.checkpointable per block", _checkpointable),
    Strategy("sqrt_segments", "checkpoint_sequential(segments='sqrt')", _sqrt_segments,
             needs="checkpoint_sequential"),
    Strategy("budget_plan", "CheckpointedSequential(budget=...)", _budget_plan,
             needs="CheckpointedSequential"),
    *(Strategy(name, f"checkpointable per block, policy {name}", _with_policy(name),
               needs="policies") for name in POLICIES),
    Strategy("policy_plan",
             "CheckpointedSequential(budget=plain/2, policies=[dots_saveable]): plain, dots "
             "or replay per block", _half_budget(("dots_saveable",)),
             needs="CheckpointedSequential"),
    Strategy("budget_replay", "CheckpointedSequential(budget=plain/2)", _half_budget(None),
             needs="CheckpointedSequential"),
    Strategy("budget_policies", "CheckpointedSequential(budget=plain/2, policies='auto')",
             _half_budget("auto"), needs="CheckpointedSequential"),
)}
