"""Solving: from measured costs to the plan within a memory budget.

The top room of planning. For a chain of layers: the cost model of a chain
(:mod:`._chain_costs`), the rotor dynamic program over it (:mod:`._rotor`)
and the chain planner (:mod:`._chain`). For a whole model: the model's
profile as a region model (:mod:`._model_profile`), the region memory model
(:mod:`._regions`) and its program (:mod:`._region_solver`), plans for XLA
steps anchored on measured ones (:mod:`._xla`), the step time model
(:mod:`._step_time`), what planning one model knows (:mod:`._planning`) and the
whole-model planner that chooses (:mod:`._model_planner`). It builds on the three rooms below it.
"""
