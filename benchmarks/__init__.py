"""Benchmarks of tf_checkpointing against plain TensorFlow, `tf.recompute_grad` and
`keras.remat`: the main job (`python benchmarks/run.py`) and the `chain/` and
`whole_model/` families. See benchmarks/README.md."""
