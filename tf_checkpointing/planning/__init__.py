"""Planning: where the checkpoints go.

Each concern is one module: :mod:`._profile` measures what each layer keeps
and costs (reading the allocator with :mod:`._allocator`; eager steps in
:mod:`._layer_profile`, ``tf.function`` and XLA steps in :mod:`._graph_profile`),
:mod:`._calling` checks a chain and routes its keywords, :mod:`._plan` holds the
plan types, :mod:`._chain` solves for the schedule of a chain of layers within a
memory budget; :mod:`._graph` reads a functional model's layer graph (converting the inputs
of the nested models it expands as Keras would: :mod:`._nested_inputs`) and
:mod:`._regions` (memory model, on the tensor lifetimes of :mod:`._lifetimes`),
:mod:`._region_solver` (program) and
:mod:`._model` plan checkpointed regions of it.
"""

from tf_checkpointing.planning._chain import plan_sequential
from tf_checkpointing.planning._model import plan_model
from tf_checkpointing.planning._plan import ModelPlan, Segment, SequentialPlan
from tf_checkpointing.planning._policies import PolicyPlan, plan_policies

__all__ = ["ModelPlan", "PolicyPlan", "Segment", "SequentialPlan", "plan_model", "plan_policies",
           "plan_sequential"]
