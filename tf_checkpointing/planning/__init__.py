"""Planning: where the checkpoints go. Profiles in, a plan value out.

This floor measures what each layer keeps and costs and solves for a plan; it
never imports the runtime that runs plans (the API floor above hands it a
:data:`~.plans._plan.PlanRunner` when a plan must be run to be measured). It
is four rooms, each importing only the ones listed before it:
:mod:`.measuring` (profiles of layers, chains and steps, read off the
allocator), :mod:`.layer_graph` (a Keras model's layer graph and its
checkpoint candidates), :mod:`.plans` (the plan types, ``budget`` and
``mode``, plan files and reuse) and :mod:`.solving` (the chain and
whole-model planners). Beside them, :mod:`._constants` holds the planners'
tuning constants, each with its reason (see
``docs/design.md#planner-constants``), and :mod:`._cache` the registry of the
planners' caches.
"""

from tf_checkpointing.planning._cache import clear_caches

__all__ = ["clear_caches"]
