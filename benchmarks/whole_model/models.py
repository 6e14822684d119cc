"""The whole-model benchmark's models, built the same way in every process.

    resnet50     keras.applications.ResNet50(weights=None), 128x128 (tiny: 64x64)
    unet         the U-Net of benchmarks/models.py (2 levels; tiny: 1, 16x16) as a
                 functional model
    mobilenetv2  keras.applications.MobileNetV2(weights=None), 128x128 (tiny: 64x64)
    gpt2         keras_hub.models.GPT2Backbone, 6 blocks of width 256 (tiny: 2 of 64),
                 built from its constructor (no weights downloaded)

A worker that measures a model and each process that reads one strategy's peaks
(`peaks.py`) build it here, from the same seed, so that layer names, and plans made
in one process, match in the others. TensorFlow, Keras and keras_hub are imported
inside the functions: `run.py`'s parent process, which imports this module through
`peaks.py`, never loads them.

Example:
    >>> model, batch_of, blocks, batch = build("unet", tiny=True)
    >>> model(batch_of(batch)).shape
    TensorShape([2, 16, 16, 4])
"""

from __future__ import annotations

import re
from typing import Any

MODELS = ("resnet50", "unet", "mobilenetv2", "gpt2")


def build(name: str, tiny: bool) -> tuple[Any, Any, list[list[str]], int]:
    """(model, batch maker, hand-written blocks as lists of layer names, batch)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    # keras.applications models: constructor, and the layer-name prefix of a block.
    applications = {"resnet50": (keras.applications.ResNet50, r"^(conv\d_block\d+)_"),
                    "mobilenetv2": (keras.applications.MobileNetV2, r"^(block_\d+)_")}
    if name in applications:
        constructor, prefix = applications[name]
        size, batch = (64, 4) if tiny else (128, 16)
        model = constructor(weights=None, input_shape=(size, size, 3), classes=10)
        blocks = _blocks_by_prefix(model, prefix)
        return model, lambda b: tf.random.normal([b, size, size, 3]), blocks, batch
    if name == "unet":
        return (*_unet(16 if tiny else 64, 4 if tiny else 16, 1 if tiny else 2),
                2 if tiny else 8)
    if name == "gpt2":
        import keras_hub

        seq, batch = (16, 2) if tiny else (128, 8)
        model = keras_hub.models.GPT2Backbone(
            vocabulary_size=1000, num_layers=2 if tiny else 6, num_heads=4,
            hidden_dim=64 if tiny else 256, intermediate_dim=128 if tiny else 1024,
            max_sequence_length=seq)

        def batch_of(b: int) -> dict:
            return {"token_ids": tf.random.uniform([b, seq], 0, 1000, tf.int32),
                    "padding_mask": tf.ones([b, seq], tf.int32)}

        blocks = [[layer.name] for layer in model.layers if "transformer_layer" in layer.name]
        return model, batch_of, blocks, batch
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def _blocks_by_prefix(model: Any, pattern: str) -> list[list[str]]:
    """The residual blocks: runs of layers whose names share the prefix ``pattern`` matches."""
    blocks: dict[str, list[str]] = {}
    for layer in model.layers:
        found = re.match(pattern, layer.name)
        if found:
            blocks.setdefault(found.group(1), []).append(layer.name)
    return list(blocks.values())


def _unet(image: int, channels: int, levels: int) -> tuple[Any, Any, list[list[str]]]:
    """The suite's U-Net (benchmarks/models.py) as a functional model."""
    import keras
    import tensorflow as tf

    layers = keras.layers
    blocks: list[list[str]] = []

    def stage(x: Any, width: int, name: str) -> Any:
        for k in range(2):
            x = layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"{name}_conv{k}")(x)
            x = layers.BatchNormalization(name=f"{name}_bn{k}")(x)
            x = layers.Activation("relu", name=f"{name}_relu{k}")(x)
        return x

    x = keras.Input((image, image, 3))
    h = layers.Conv2D(channels, 3, padding="same", name="stem")(x)
    skips = []
    for i in range(levels):
        h = stage(h, channels * 2**i, f"down{i}")
        skips.append(h)
        h = layers.MaxPooling2D(name=f"down{i}_pool")(h)
        blocks.append([f"down{i}_{s}" for s in ("conv0", "bn0", "relu0", "conv1", "bn1",
                                                 "relu1", "pool")])
    h = stage(h, channels * 2**levels, "mid")
    blocks.append([f"mid_{s}" for s in ("conv0", "bn0", "relu0", "conv1", "bn1", "relu1")])
    for i in reversed(range(levels)):
        h = layers.UpSampling2D(name=f"up{i}_up")(h)
        h = layers.Concatenate(name=f"up{i}_cat")([h, skips[i]])
        h = stage(h, channels * 2**i, f"up{i}")
        blocks.append([f"up{i}_{s}" for s in ("up", "cat", "conv0", "bn0", "relu0", "conv1",
                                               "bn1", "relu1")])
    model = keras.Model(x, layers.Conv2D(4, 1, name="head")(h), name="unet")
    return model, lambda b: tf.random.normal([b, image, image, 3]), blocks


def training_step(model: Any, optimizer: Any, jit: bool) -> Any:
    """One SGD step on the mean square of the model's outputs, as a ``tf.function``."""
    import tensorflow as tf

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32)))
                             for o in tf.nest.flatten(out)])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return tf.function(step, jit_compile=jit)
