"""Train a keras_hub GPT-2 with Model.fit, its transformer blocks checkpointed.

The model is keras_hub's own `GPT2Backbone` (built from its constructor: random
weights, nothing downloaded) with a language-model head. The same model is
trained twice from the same weights and seeds: plain, and with
`apply_checkpointing(model, [TransformerDecoder])`, which makes each transformer
block keep only its input and replay its forward during backprop (dropout masks
included, so the losses are equal). Prints peak memory and step time of both.

    pip install -e ".[examples]"
    python examples/gpt2_fit.py            # 6 blocks, 256 tokens (~2-3 min on 2 CPU cores)
    python examples/gpt2_fit.py --tiny     # 2 blocks, 128 tokens (~40 s; what the tests run)
"""

from __future__ import annotations

import argparse

SIZES = {
    "default": dict(vocabulary_size=2048, num_layers=6, num_heads=4, hidden_dim=256,
                    intermediate_dim=1024, sequence_length=256, batch_size=8, steps=3, rounds=2),
    # Small, but the blocks' activations still outweigh what no checkpoint frees (the
    # weights' gradients and AdamW's update): at width 16 and 8 tokens, the
    # checkpointed step peaked at 1.33x plain's.
    "tiny": dict(vocabulary_size=256, num_layers=2, num_heads=2, hidden_dim=64,
                 intermediate_dim=256, sequence_length=128, batch_size=4, steps=5, rounds=2),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (~40 s)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before TensorFlow starts: --help answers at once

from _common import (  # noqa: E402
    interleaved_fits,
    measured_step,
    print_comparison,
    start_tensorflow,
)

start_tensorflow()  # exact CPU memory statistics, no start-up noise

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

from tf_checkpointing import apply_checkpointing  # noqa: E402


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


def main(args: argparse.Namespace) -> int:
    size = SIZES["tiny" if args.tiny else "default"]
    print(f"GPT2Backbone: {size['num_layers']} blocks, width {size['hidden_dim']}, "
          f"{size['sequence_length']} tokens, batch {size['batch_size']}")
    plain = build_model(size)
    checkpointed = build_model(size)
    blocks = apply_checkpointing(checkpointed, [keras_hub.layers.TransformerDecoder])
    print(f"checkpointed: {', '.join(layer.name for layer in blocks)}")
    models = {"plain": plain, "checkpointed": checkpointed}
    x, y = data(size)
    batch = size["batch_size"]
    measured = {name: measured_step(model, x, y, batch) for name, model in models.items()}
    seconds = interleaved_fits(models, x, y, batch, rounds=size["rounds"])
    print_comparison({name: dict(measured[name], step_s=seconds[name]) for name in models},
                     loss_of="measured step (the second)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
