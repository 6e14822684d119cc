"""Train a keras_hub GPT-2 with Model.fit, its transformer blocks checkpointed.

The model is keras_hub's own `GPT2Backbone` (built from its constructor: random
weights, nothing downloaded) with a language-model head. The same model is
trained twice from the same weights and seeds: plain, and with
`apply_checkpointing(model, [TransformerDecoder])`, which makes each transformer
block keep only its input and replay its forward during backprop (dropout masks
included, so the losses are equal). Prints peak memory and step time of both.

    pip install -e ".[examples]"
    python examples/gpt2_fit.py            # 6 blocks, 256 tokens (~2-3 min on 2 CPU cores)
    python examples/gpt2_fit.py --tiny     # toy sizes, seconds (what the tests run)
"""

from __future__ import annotations

import argparse
import os

# Before TensorFlow is imported: exact CPU memory statistics, and no C++ log lines.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from _compare import median_step_seconds, print_comparison  # noqa: E402

from tf_checkpointing import apply_checkpointing, measure  # noqa: E402

SIZES = {
    "default": dict(vocabulary_size=2048, num_layers=6, num_heads=4, hidden_dim=256,
                    intermediate_dim=1024, sequence_length=256, batch_size=8, steps=5),
    "tiny": dict(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
                 intermediate_dim=32, sequence_length=8, batch_size=2, steps=2),
}


def build_model(size: dict, seed: int = 0) -> keras.Model:
    """GPT2Backbone + a Dense language-model head, compiled for next-token loss."""
    keras.utils.set_random_seed(seed)  # same weights and dropout seeds for both runs
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=size["vocabulary_size"], num_layers=size["num_layers"],
        num_heads=size["num_heads"], hidden_dim=size["hidden_dim"],
        intermediate_dim=size["intermediate_dim"], max_sequence_length=size["sequence_length"])
    logits = keras.layers.Dense(size["vocabulary_size"], name="lm_head")(backbone.output)
    model = keras.Model(backbone.inputs, logits)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(size: dict) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, size["vocabulary_size"],
                          (size["batch_size"] * size["steps"], size["sequence_length"] + 1))
    inputs = {"token_ids": tokens[:, :-1],
              "padding_mask": np.ones_like(tokens[:, :-1])}
    return inputs, tokens[:, 1:]  # predict the next token


def run(model: keras.Model, size: dict) -> dict[str, float]:
    x, y = data(size)
    batch = size["batch_size"]
    first = {k: v[:batch] for k, v in x.items()}
    # One step first: traces fit's tf.function and creates the optimizer's slots.
    model.fit(first, y[:batch], batch_size=batch, epochs=1, verbose=0, shuffle=False)
    history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    peak = measure(model.train_on_batch, first, y[:batch]).peak_mib
    step = median_step_seconds(lambda: model.train_on_batch(first, y[:batch]), size["steps"])
    return dict(peak_mib=peak, step_s=step, loss=history.history["loss"][-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (seconds)")
    args = parser.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "default"]
    print(f"GPT2Backbone: {size['num_layers']} blocks, width {size['hidden_dim']}, "
          f"{size['sequence_length']} tokens, batch {size['batch_size']}")
    plain = build_model(size)
    checkpointed = build_model(size)
    blocks = apply_checkpointing(checkpointed, [keras_hub.layers.TransformerDecoder])
    print(f"checkpointed: {', '.join(layer.name for layer in blocks)}")
    rows = {"plain": run(plain, size), "checkpointed": run(checkpointed, size)}
    print_comparison(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
