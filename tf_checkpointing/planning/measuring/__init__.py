"""Measuring: what each layer call keeps and costs, read off the allocator.

The bottom room of planning. It runs layers, chains and whole training steps
and reads what they cost: the allocator's peaks and held bytes
(:mod:`._allocator`, the profiler's requested bytes in :mod:`._requested`),
one profile per layer of a chain (:mod:`._profile`: eager steps in
:mod:`._layer_profile`, ``tf.function`` and XLA steps in
:mod:`._step_profile`, with the tensors each backward reads from
:mod:`._backward_reads`), a whole training step's peak and time
(:mod:`._whole_step`), what each save policy keeps of a layer
(:mod:`._choices`) and how long each tensor of a measured graph lives
(:mod:`._lifetimes`). Measuring leaves the process as it found it
(:mod:`._leave_no_trace`) and says what it is doing when that takes a while
(:mod:`._progress`). The kinds of step measured, :class:`._modes.Mode`, are
defined here, the lowest room that needs them. It imports no other room of planning.
"""
