"""Blocks inside a layer, checkpointed one by one when the running plan says so.

A whole-model plan can checkpoint the repeated blocks that run inside one
layer of the model's graph (``ModelPlan.blocks``: keras_hub's ``ViTEncoder``
runs its ``ViTEncoderBlock`` s in a Python loop, where no region of the graph
reaches). The graph runner cannot run those blocks itself: the layer that holds
them calls them. So each such block's ``call`` is replaced by a
:class:`BlockSwitch`: the block's own ``call``, or, while the switch is on, that
call checkpointed as ``apply_checkpointing(model, [Block])`` checkpoints it. The
runner turns the switches on and off for the plan it runs, before each call of
the model; a replay's backward runs in the same step, under the same settings.

Switches are put on the blocks where the plan can choose them: by the runner
``apply_checkpointing(model, budget=...)`` installs (for as long as it is
installed), and for the duration of :func:`switches_installed` where planning
alone must run them (``plan_model``, which leaves the model as it found it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import wrapt

from tf_checkpointing._decorator import checkpointable

__all__: list[str] = []

# The attribute apply_checkpointing(select) reads to re-wrap a layer from its own call.
ORIGINAL_CALL = "_self_tf_checkpointing_original_call"


class BlockSwitch(wrapt.FunctionWrapper):
    """A block's ``call`` that runs checkpointed while ``on`` (see the module).

    Example:
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing._block_switch import BlockSwitch
        >>> layer = keras.layers.Dense(4)
        >>> layer.build((None, 3))
        >>> switch = BlockSwitch(layer.call)
        >>> switch.on = True
        >>> switch(tf.ones([2, 3])).shape
        TensorShape([2, 4])
    """

    def __init__(self, original: Any, *, force_seed: bool = False, check: Any = False) -> None:
        def run(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            target = self._self_checkpointed if self._self_on else wrapped
            return target(*args, **kwargs)

        super().__init__(original, run)
        self._self_checkpointed = checkpointable(original, checkpoint=True,
                                                 force_seed=force_seed, check=check)
        self._self_on = False
        setattr(self, ORIGINAL_CALL, original)

    @property
    def on(self) -> bool:
        return bool(self._self_on)

    @on.setter
    def on(self, value: bool) -> None:
        self._self_on = bool(value)


def switch_of(layer: Any) -> Any:
    """The layer's :class:`BlockSwitch`, or None."""
    current = vars(layer).get("call")
    return current if isinstance(current, BlockSwitch) else None


def install_switches(layers: Iterable[Any], *, force_seed: bool = False,
                     check: Any = False) -> list[Any]:
    """Puts a switch (off) on each of ``layers`` whose ``call`` is its class's
    own; returns the layers it put one on. A layer checkpointed already (chosen
    with ``apply_checkpointing(model, [Block])``) keeps its checkpoint."""
    installed = []
    for layer in layers:
        if "call" in vars(layer):
            continue
        # Plain object.__setattr__: a function is nothing for Keras to track.
        object.__setattr__(layer, "call", BlockSwitch(layer.call, force_seed=force_seed,
                                                      check=check))
        installed.append(layer)
    return installed


def remove_switches(layers: Iterable[Any]) -> None:
    """Gives ``layers`` their own ``call`` back (where a switch is still on them)."""
    for layer in layers:
        if switch_of(layer) is not None:
            object.__delattr__(layer, "call")


def set_switches(blocks: dict[Any, Any], on: Iterable[Any]) -> None:
    """Turns the switch of each layer of ``blocks`` (by reference) on when its
    reference is in ``on``, else off."""
    chosen = set(on)
    for ref, layer in blocks.items():
        switch = switch_of(layer)
        if switch is not None:
            switch.on = ref in chosen


@contextlib.contextmanager
def switches_installed(layers: Iterable[Any]) -> Iterator[None]:
    """Switches on ``layers`` for the block (off), removed after it."""
    installed = install_switches(layers)
    try:
        yield
    finally:
        remove_switches(installed)
