"""An exact reference for the whole-model planner: its problem as a MILP (see README.md)."""
