"""Benchmarks of tf_checkpointing against plain TensorFlow, `tf.recompute_grad` and
`keras.remat`. Run `python benchmarks/run.py` (models) or `python benchmarks/core.py`
(the decorator on a Dense chain); see benchmarks/README.md."""
