"""The replay core: one checkpointed call, and what keeps its replay exact.

:func:`~tf_checkpointing.core._recompute.checkpointed_call` runs a function so
that backprop keeps only its inputs and replays it. The other modules each keep
one thing the replay must see again as the forward saw it: random draws
(:mod:`._seeding`, :mod:`._draws`), variable state (:mod:`._state`), the order of
variable reads and writes (:mod:`._ordering`), Keras' call context
(:mod:`._keras_context`), captured tensors and control flow (:mod:`._captures`,
:mod:`._control_flow`), added losses (:mod:`._losses`), the call's structure
(:mod:`._structure`); :mod:`._save_policies` keeps what a save policy picks, and
:mod:`._residuals` and :mod:`._memory` measure what a call keeps.

This floor imports nothing of planning or of the API above it.
"""
