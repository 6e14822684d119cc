"""Planning: where the checkpoints go.

Each concern is one module: :mod:`._profile` measures what each layer keeps
and costs, :mod:`._plan` holds the plan types, :mod:`._chain` solves for the
schedule of a chain of layers within a memory budget.
"""

from tf_checkpointing.planning._chain import plan_sequential
from tf_checkpointing.planning._plan import Segment, SequentialPlan
from tf_checkpointing.planning._policies import PolicyPlan, plan_policies

__all__ = ["PolicyPlan", "Segment", "SequentialPlan", "plan_policies", "plan_sequential"]
