"""The benchmark models, built from standard Keras layers, as chains of blocks.

Every model is a `Workload`: a stem (not checkpointed), a list of blocks (the unit
that the per-block strategies checkpoint and that `checkpoint_sequential` segments),
and a head with its loss. A block is a Keras layer called as
`state = block(state, training=...)`; the state is a tensor, or a tuple of tensors
for the U-Net (the feature map followed by the skip connections still to be used).

    mlp   deep MLP: blocks of Dense(4w, gelu) -> Dense(w)
    gpt2  GPT-2-style decoder: token + position embedding, blocks of causal
          MultiHeadAttention, LayerNormalization, MLP and Dropout (pre-norm)
    unet  U-Net-ish: Conv2D + BatchNormalization + ReLU stages, max-pool down,
          upsample + concatenated skip connection up

Example:
    >>> workload = build("mlp", SIZES["tiny"]["mlp"], seed=0)
    >>> inputs, targets = workload.make_batch(workload.batch)
    >>> state = workload.stem(inputs, training=True)
    >>> for block in workload.blocks:
    ...     state = block(state, training=True)
    >>> float(workload.head_loss(state, targets, training=True)) > 0.0
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import tensorflow as tf

MIB = 2**20

# Shapes per size. `batch` is the base batch; `budget_mib` is the fixed memory budget
# for the largest-batch column (an input of the benchmark, not a result).
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "tiny": {
        "mlp": dict(blocks=4, width=32, batch=8, budget_mib=4),
        "gpt2": dict(blocks=2, dim=32, heads=2, seq=16, vocab=64, batch=2, budget_mib=4),
        "unet": dict(levels=2, channels=4, image=16, batch=2, budget_mib=4),
    },
    "quick": {
        "mlp": dict(blocks=16, width=64, batch=512, budget_mib=64),
        "gpt2": dict(blocks=12, dim=128, heads=4, seq=64, vocab=256, batch=8, budget_mib=256),
        "unet": dict(levels=2, channels=16, image=64, batch=8, budget_mib=256),
    },
    "full": {
        "mlp": dict(blocks=32, width=512, batch=1024, budget_mib=4096),
        "gpt2": dict(blocks=12, dim=256, heads=8, seq=256, vocab=1024, batch=16,
                     budget_mib=4096),
        "unet": dict(levels=4, channels=32, image=128, batch=16, budget_mib=4096),
    },
}
MODELS = ("mlp", "gpt2", "unet")
DROPOUT = 0.1


@dataclasses.dataclass
class Workload:
    """One model, split into stem, blocks and head, with its data."""

    name: str
    config: dict[str, int]
    stem: Callable[..., Any]
    blocks: list[keras.layers.Layer]
    head_loss: Callable[..., tf.Tensor]
    make_batch: Callable[[int], tuple[tf.Tensor, tf.Tensor]]
    input_signature: Callable[[], list[tf.TensorSpec]]
    layers: list[keras.layers.Layer]

    @property
    def batch(self) -> int:
        return self.config["batch"]

    @property
    def budget_bytes(self) -> int:
        return self.config["budget_mib"] * MIB

    @property
    def trainable_variables(self) -> list[Any]:
        return [v for layer in self.layers for v in layer.trainable_variables]

    @property
    def state_variables(self) -> list[Any]:
        """Non-trainable variables: BatchNorm statistics and dropout seed states."""
        return [v for layer in self.layers for v in layer.non_trainable_variables]


def build(name: str, config: dict[str, int], seed: int = 0) -> Workload:
    """Builds model `name` ("mlp", "gpt2" or "unet") with `config` and runs it once."""
    if name not in _BUILDERS:
        raise ValueError(f"Invalid value received for argument `name`: expected one of "
                         f"{MODELS}, received {name!r}. Pass one of those names.")
    keras.utils.set_random_seed(seed)
    workload = _BUILDERS[name](dict(config))
    inputs, targets = workload.make_batch(workload.batch)
    state = workload.stem(inputs, training=True)  # creates every variable
    for block in workload.blocks:
        state = block(state, training=True)
    workload.head_loss(state, targets, training=True)
    return workload


# ----------------------------------------------------------------------------- MLP
class MLPBlock(keras.layers.Layer):
    """Dense(4w, gelu) -> Dense(w)."""

    def __init__(self, width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4 * width, activation="gelu")
        self.down = keras.layers.Dense(width)

    def call(self, x: tf.Tensor, training: Any = None) -> tf.Tensor:
        return self.down(self.up(x))


def _mlp(config: dict[str, int]) -> Workload:
    width, classes = config["width"], 10
    stem = keras.layers.Dense(width)
    blocks = [MLPBlock(width, name=f"mlp_block_{i}") for i in range(config["blocks"])]
    head = keras.layers.Dense(classes)

    def make_batch(batch: int) -> tuple[tf.Tensor, tf.Tensor]:
        g = tf.random.Generator.from_seed(batch)
        return (g.normal([batch, width]),
                g.uniform([batch], maxval=classes, dtype=tf.int32))

    return Workload(
        "mlp", config, lambda x, training: stem(x), blocks,
        lambda h, y, training: _cross_entropy(y, head(h)), make_batch,
        lambda: [tf.TensorSpec([None, width], tf.float32), tf.TensorSpec([None], tf.int32)],
        [stem, *blocks, head])


# ---------------------------------------------------------------------------- GPT-2
class DecoderBlock(keras.layers.Layer):
    """Pre-norm GPT-2 block: x + Dropout(CausalAttention(LN(x))), then x + Dropout(MLP(LN(x)))."""

    def __init__(self, dim: int, heads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=DROPOUT)
        self.drop1 = keras.layers.Dropout(DROPOUT)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.fc = keras.layers.Dense(4 * dim, activation="gelu")
        self.proj = keras.layers.Dense(dim)
        self.drop2 = keras.layers.Dropout(DROPOUT)

    def call(self, x: tf.Tensor, training: Any = None) -> tf.Tensor:
        # The names are for save policies (identities only inside a checkpointed call).
        from tf_checkpointing import checkpoint_name

        h = self.norm1(x)
        h = self.attention(h, h, use_causal_mask=True, training=training)
        x = x + self.drop1(checkpoint_name(h, "attention_out"), training=training)
        h = checkpoint_name(self.proj(self.fc(self.norm2(x))), "mlp_out")
        return x + self.drop2(h, training=training)


def _gpt2(config: dict[str, int]) -> Workload:
    dim, seq, vocab = config["dim"], config["seq"], config["vocab"]
    tokens = keras.layers.Embedding(vocab, dim)
    positions = keras.layers.Embedding(seq, dim)
    blocks = [DecoderBlock(dim, config["heads"], name=f"decoder_block_{i}")
              for i in range(config["blocks"])]
    norm = keras.layers.LayerNormalization(epsilon=1e-5)
    head = keras.layers.Dense(vocab, use_bias=False)

    def stem(ids: tf.Tensor, training: Any) -> tf.Tensor:
        return tokens(ids) + positions(tf.range(seq))[tf.newaxis]

    def make_batch(batch: int) -> tuple[tf.Tensor, tf.Tensor]:
        ids = tf.random.Generator.from_seed(batch).uniform(
            [batch, seq + 1], maxval=vocab, dtype=tf.int32)
        return ids[:, :-1], ids[:, 1:]

    return Workload(
        "gpt2", config, stem, blocks,
        lambda h, y, training: _cross_entropy(y, head(norm(h))), make_batch,
        lambda: [tf.TensorSpec([None, seq], tf.int32)] * 2,
        [tokens, positions, *blocks, norm, head])


# ---------------------------------------------------------------------------- U-Net
class ConvStage(keras.layers.Layer):
    """Two Conv2D 3x3 + BatchNormalization + ReLU."""

    def __init__(self, channels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.convs = [keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)
                      for _ in range(2)]
        self.norms = [keras.layers.BatchNormalization() for _ in range(2)]

    def call(self, x: tf.Tensor, training: Any = None) -> tf.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = tf.nn.relu(norm(conv(x), training=training))
        return x


class DownBlock(keras.layers.Layer):
    """(x, *skips) -> (maxpool(stage(x)), *skips, stage(x))."""

    def __init__(self, channels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = ConvStage(channels)
        self.pool = keras.layers.MaxPooling2D()

    def call(self, state: tuple, training: Any = None) -> tuple:
        x, *skips = state
        h = self.stage(x, training=training)
        return (self.pool(h), *skips, h)


class UpBlock(keras.layers.Layer):
    """(x, *skips, skip) -> (stage(concat(upsample(x), skip)), *skips)."""

    def __init__(self, channels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.up = keras.layers.UpSampling2D()
        self.stage = ConvStage(channels)

    def call(self, state: tuple, training: Any = None) -> tuple:
        x, *skips, skip = state
        h = keras.ops.concatenate([self.up(x), skip], axis=-1)
        return (self.stage(h, training=training), *skips)


class Bottleneck(keras.layers.Layer):
    """(x, *skips) -> (stage(x), *skips)."""

    def __init__(self, channels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = ConvStage(channels)

    def call(self, state: tuple, training: Any = None) -> tuple:
        x, *skips = state
        return (self.stage(x, training=training), *skips)


def _unet(config: dict[str, int]) -> Workload:
    levels, channels, image, classes = config["levels"], config["channels"], config["image"], 4
    stem = keras.layers.Conv2D(channels, 3, padding="same")
    blocks: list[keras.layers.Layer] = [
        DownBlock(channels * 2**i, name=f"down_{i}") for i in range(levels)]
    blocks.append(Bottleneck(channels * 2**levels, name="bottleneck"))
    blocks += [UpBlock(channels * 2**i, name=f"up_{i}") for i in reversed(range(levels))]
    head = keras.layers.Conv2D(classes, 1)

    def make_batch(batch: int) -> tuple[tf.Tensor, tf.Tensor]:
        g = tf.random.Generator.from_seed(batch)
        return (g.normal([batch, image, image, 3]),
                g.uniform([batch, image, image], maxval=classes, dtype=tf.int32))

    def head_loss(state: tuple, y: tf.Tensor, training: Any) -> tf.Tensor:
        (x,) = state
        return _cross_entropy(y, head(x))

    return Workload(
        "unet", config, lambda x, training: (stem(x),), blocks, head_loss, make_batch,
        lambda: [tf.TensorSpec([None, image, image, 3], tf.float32),
                 tf.TensorSpec([None, image, image], tf.int32)],
        [stem, *blocks, head])


def _cross_entropy(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


_BUILDERS: dict[str, Callable[[dict[str, int]], Workload]] = {
    "mlp": _mlp, "gpt2": _gpt2, "unet": _unet}
