"""Plans: the plan values, what a plan is asked for, and plans kept for reuse.

The plan types every planner returns and every runner reads
(:mod:`._plan`, with the :data:`~._plan.PlanRunner` the API floor hands down
when a plan must be run to be measured), the ``budget`` and ``mode`` every
planning API takes (:mod:`._budget`; ``mode`` is
:mod:`..measuring._modes`, which measuring needs too), plans written to and
read from a plan cache folder (:mod:`._plan_files`) and plans kept per input
shape and mode (:mod:`._reuse`). It builds on :mod:`..measuring` and
:mod:`..layer_graph` and imports nothing of :mod:`..solving`.
"""
