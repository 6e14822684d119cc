"""Chains of layers: `checkpointable` per layer against `tf.recompute_grad` on a Dense
chain (`core.py`), segments and budget plans (`sequential.py`), EfficientNetB0 as a
`CheckpointedSequential` under `fit` (`efficientnet_chain.py`)."""
