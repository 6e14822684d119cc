"""Planning: where the checkpoints go. Profiles in, a plan value out.

This floor measures what each layer keeps and costs and solves for a plan; it
never imports the runtime that runs plans (the API floor above hands it a
:data:`~._runner.PlanRunner` when a plan must be run to be measured). Each
concern is one module: :mod:`._profile` measures what each layer of a chain
keeps and costs (reading the allocator with :mod:`._allocator`; eager steps in
:mod:`._layer_profile`, ``tf.function`` and XLA steps in :mod:`._graph_profile`),
:mod:`._calling` checks a chain and routes its keywords, :mod:`._plan` holds the
plan types, :mod:`._chain` solves for the schedule of a chain of layers within a
memory budget (:mod:`._rotor`); :mod:`._graph` reads a functional model's layer
graph (converting the inputs of the nested models it expands as Keras would:
:mod:`._nested_inputs`), and :mod:`._regions` (memory model, on the tensor
lifetimes of :mod:`._lifetimes`), :mod:`._region_solver` (program) and
:mod:`._model` plan checkpointed regions of it; :mod:`._xla` anchors plans for
XLA steps on measured ones. :mod:`._budget` and :mod:`._modes` validate the
``budget`` and ``mode`` every planning API takes. :mod:`._constants` holds the
planners' tuning constants, each with its reason (see ``docs/design.md#planner-constants``).
"""

from tf_checkpointing.planning._cache import clear_caches

__all__ = ["clear_caches"]
