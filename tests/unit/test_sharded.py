"""Sharded strategies are recognised by class, not by name: what blocks a tripped step's replay under FSDP.

A pure check of ``replay.sharded`` on strategy objects; a sharded fit itself needs several processes
(``tests/distributed/test_params_fsdp.py``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_hookdiag._replay import sharded


class FSDPStrategy2(FSDPStrategy):
    """A user's subclass: shards just the same."""


def test_sharded_strategies_are_recognised_by_class_not_by_name():
    def trainer(strategy: Any) -> Any:
        return SimpleNamespace(strategy=strategy)

    assert sharded(trainer(ModelParallelStrategy()), {})
    assert sharded(trainer(FSDPStrategy2()), {})
    assert not sharded(trainer(DDPStrategy()), {})
    assert not sharded(trainer(SingleDeviceStrategy("cpu")), {})
    # A class that merely has the name is not one (the name-based check said it was).
    impostor = type("FSDPStrategy", (), {})()
    assert not sharded(trainer(impostor), {})
