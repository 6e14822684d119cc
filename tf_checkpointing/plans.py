"""Plans: where a chain or a model keeps checkpoints, as values to read, print and save.

Most code never touches a plan: pass a `budget` and the call plans for you. Plan
ahead to see what a budget costs, or to fix the plan by hand. `plan_sequential`
plans a chain of layers (a `SequentialPlan`, for `checkpoint_sequential` and
`CheckpointedSequential`); `plan_model` plans a whole functional model (a
`ModelPlan`, for `apply_checkpointing`; both are also in `tf_checkpointing`
itself). A `Plan` names the layers and covers them with `Segment` pieces, each
plain or checkpointed, with its save policy and checkpoints of its own inside.

Example (a plan by hand: layers a, b, c replayed in backprop, and a, b again
inside that replay):
    >>> from tf_checkpointing.plans import Segment, SequentialPlan
    >>> inner = (Segment(0, 2, True), Segment(2, 3, False))
    >>> plan = SequentialPlan(names=("a", "b", "c", "d"),
    ...                       pieces=(Segment(0, 3, True, inner), Segment(3, 4, False)))
    >>> plan.regions, plan.depth, plan.forward_counts
    ([[['a', 'b'], 'c']], 2, [3, 3, 2, 1])
    >>> print(plan)
    SequentialPlan: 4 layers; 1 checkpointed region, 5 extra layer forwards (2.25x forward)
      [0, 3) checkpointed (3 layers: a, b, c)
        [0, 2) checkpointed (2 layers: a, b)
        [2, 3) plain (1 layer: c)
      [3, 4) plain (1 layer: d)
"""

from tf_checkpointing._sequential import plan_sequential as plan_sequential
from tf_checkpointing._whole_model import plan_model as plan_model
from tf_checkpointing.planning.plans._plan import ModelPlan as ModelPlan
from tf_checkpointing.planning.plans._plan import Plan as Plan
from tf_checkpointing.planning.plans._plan import Segment as Segment
from tf_checkpointing.planning.plans._plan import SequentialPlan as SequentialPlan

__all__ = ["ModelPlan", "Plan", "Segment", "SequentialPlan", "plan_model", "plan_sequential"]
