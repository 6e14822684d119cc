"""The planners' tuning constants, each with the reason for its value.

A leaf module: it imports nothing from the package, so any module may import it.
The measurements behind the values are in the decision records,
``docs/decisions/`` (each constant names its record; ``docs/design.md`` lists them
under ``#planner-constants``). The modules that use a constant import it under its
former private name (``_HEADROOM``, ``_CHUNKS``...).
"""

from __future__ import annotations

__all__: list[str] = []

# Budgets -------------------------------------------------------------------------

# Share of a budget every plan keeps free: a fragmented allocator hands out blocks
# up to twice a tensor's size, which no per-layer profile sees (docs/decisions/0009-headroom.md).
HEADROOM = 0.10
# The share a whole-model plan keeps free under XLA: each such plan compared with a
# budget is a compiled step measured to the byte (one buffer, the same in every
# step), and Keras' own XLA step read at most 4.7% above the planner's measurement
# (docs/decisions/0053-xla-plans-keep-less-headroom.md). Chains keep HEADROOM: their
# XLA plans are predicted, not measured.
XLA_HEADROOM = 0.05
# A tf.function plan's allocator chunks over its tensors, at the least plan: the
# middle of the range measured on checkpointed plans (docs/decisions/0019-chunk-factor.md).
CHUNKS = 1.10
# An XLA budget takes the first of this many plans, evenly spaced in the model's peak
# between the least plan and plain, that measures within it: each one a budget passes
# costs an XLA compile, and fewer leave more of a budget unused
# (docs/decisions/0048-xla-budgets-climb-a-ladder.md).
XLA_LADDER_RUNGS = 4
# A budget at most this share below the least budget (the least plan's predicted peak
# plus HEADROOM) gets the least plan instead of an error: the least is read from one
# process's profile, and another process reads it a few percent apart, so a least
# reported by plan_model in one process may be refused in the next. The least plan
# still fits such a budget with half the headroom (docs/decisions/0046-least-budget-slack.md).
LEAST_BUDGET_SLACK = 0.05
# A budget below this many bytes is a unit slip (MiB, GiB): no training step fits.
LEAST_BYTES = 1024
# A user's selection of regions is measured (a compiled step) only where its
# predicted peak is at most this many times the least plan's: the largest error
# seen in such a pair (docs/decisions/0044-selections-that-could-win.md).
SELECTION_MARGIN = 1.5

# The whole-model region program (_region_solver) ---------------------------------

# Memory units of the region program, each step's bytes rounded to the nearest: fine
# enough that plans keep close to their limit, few enough that a model of a few hundred
# calls is solved in a second or two (docs/decisions/0049-region-program-rounds-to-the-nearest.md).
REGION_UNITS = 800
# Programs rounded to the nearest unit, each checked against the model's peak (one
# above the limit runs again lower), before the program with every step rounded up,
# which never exceeds the limit (the same record). Six, not two: the program at the
# lowered limit often finds another plan the rounding flatters, and falling back on
# the rounded-up plan made a higher budget replay more than a lower one
# (docs/decisions/0051-region-program-tries-six-times.md).
REGION_NEAREST_TRIES = 6
# Regions offered with sub-regions inside their replay (docs/decisions/0016-nesting.md): at most
# this many calls (bounds the inner programs' time),
NESTED_MAX_LEN = 24
# counted in this many units (coarse: one inner program runs per start),
NESTED_UNITS = 40
# at least this many calls (a one-call sub-region keeps its input: it saves little),
NESTED_MIN_LEN = 3
# and only where nesting lowers the region's need below this share of its flat need
# (a smaller gain is within the model's error, for a second recomputation).
NESTED_NEED_RATIO = 0.97

# The chain program (_rotor): units = max(MIN, min(MAX, CELLS // (n + 1) ** 2)) -----

# At most 1000 units of the budget (0.1% each: well inside HEADROOM),
ROTOR_MAX_UNITS = 1000
# at least 50 for a long chain (2% each),
ROTOR_MIN_UNITS = 50
# and about this many (start, stop, units) cells in the tables: bounded memory and
# time for any chain length (docs/decisions/0010-rotor-discretisation.md).
ROTOR_TABLE_CELLS = 3e7

# Caches (a profile runs the model, so it is kept and reused) ---------------------

# The last 16 chains: checkpoint_sequential(budget=) asks for its plan on every call.
CHAIN_CACHE_SIZE = 16
# The last 4 models (with input shapes and mode): profiles and policy measurements.
MODEL_CACHE_SIZE = 4
# One XLA anchor per model profile kept (docs/decisions/0023-xla-plans.md).
XLA_ANCHOR_CACHE_SIZE = MODEL_CACHE_SIZE

# Repeated readings (the executor's order varies, docs/decisions/0027-graph-profile-readings.md) --

# Runs of each layer's graph; the profile keeps the median readings.
GRAPH_RUNS = 5
# Plain steps measured, median kept (not under XLA, whose buffer is the same in each).
PLAIN_STEPS = 3
# Warm runs of a layer's forward; its time is the least of them.
TIMED_RUNS = 3
# Warm runs of a measured whole step (plain, or a plan's), timed, its peak's readings
# among them where one step is measured; its time is the least of them
# (docs/decisions/0039-step-time-model.md).
TIMED_STEPS = 5
# Timing rounds per distinct call under each policy in a model's graph, more for a
# call standing for several, up to POLICY_MAX_ROUNDS (docs/decisions/0011-policy-timing.md).
POLICY_REPEATS = 3
POLICY_MAX_ROUNDS = 8
# Calls of one family (same class and configuration, other shapes) timed under the
# policies, spread over their sizes; the others take their neighbours' ratios
# (docs/decisions/0011-policy-timing.md).
POLICY_FAMILY_SAMPLES = 4
# A call whose policies keep, in its forward, at most this share of its inputs' bytes
# (a normalization's moments) is given those bytes, an upper bound, instead of
# their listing by saved_residuals (docs/decisions/0011-policy-timing.md).
POLICY_SMALL_KEPT = 1 / 16

# Warnings ------------------------------------------------------------------------

# apply_checkpointing(select=...) warns when the selection is predicted to keep at
# least this share of plain's activations: it saves no memory and costs time
# (docs/decisions/0032-per-layer-selection-warning.md).
COSTLY_SELECTION_RATIO = 0.97

# Saved plans ---------------------------------------------------------------------

# Part of a saved plan's key (plans/_plan_files.plan_key): raised when a change moves
# what the plans of an unchanged version measure, so that a plan cache made before it
# plans again (2: save-everything regions no longer replay, XLA least plans may replay
# their plain pieces; decision 0054).
PLAN_REVISION = 2
