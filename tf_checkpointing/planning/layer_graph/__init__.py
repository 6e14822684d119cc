"""The layer graph: which layer calls a Keras model makes, and which can be checkpointed.

Reads a model's layer graph as the planners see it (:mod:`._layer_graph`,
expanding nested models and converting their inputs as Keras would:
:mod:`._nested_inputs`), checks a chain and routes its keywords
(:mod:`._calling`), finds the candidates: blocks and layers that hold
sublayers (:mod:`._blocks`), frozen layers no backward reaches
(:mod:`._frozen`), regions a user names by layer (:mod:`._regions_by_name`),
and measures per graph call what each save policy and each call keeps
(:mod:`._graph_choices`, :mod:`._saved_tensors`). It builds on
:mod:`..measuring` and imports no room above it.
"""
