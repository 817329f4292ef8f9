"""What the callback observes, seen through its public extension API: a user component passed in ``extensions=``."""

from __future__ import annotations

from torch import Tensor

from lightning_hookdiag.components import Component, ComponentFactory, Setup, component


class OutputLog(Component):
    """Appends the layer index of every output the callback observes (the tensors its statistics are taken from)."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = layers

    def on_output(self, layer: int, tensor: Tensor) -> None:
        self.layers.append(layer)


def observed_outputs(layers: list[int]) -> ComponentFactory:
    """A component factory for ``extensions=``: each fit's component appends to ``layers`` the index of every layer
    output handed to the components (one per observed output, as the statistics see them, replays included)."""

    @component
    def output_log(setup: Setup) -> OutputLog:
        return OutputLog(layers)

    return output_log
