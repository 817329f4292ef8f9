"""One logged name per module and parameter (test_aggregation_sync.py checks the consumers under real wrappers)."""

import torch
from torch import nn

from lightning_hookdiag._names import logged_name, owning_layer
from lightning_hookdiag._params import named_parameters_of
from lightning_hookdiag._selection import named_modules


class UserModule(nn.Module):
    """A user's own attribute called ``module``: a real segment, never dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)


def test_module_segments_are_dropped_only_below_ddp_style_wrappers():
    wrapped = nn.DataParallel(UserModule())
    assert logged_name("module.module.weight", wrapped) == "module.weight"
    assert logged_name("module.weight", UserModule()) == "module.weight"
    # Without the root no parent is known: ``module`` is kept, the private wrapper segments still go.
    assert logged_name("module._orig_mod.enc._checkpoint_wrapped_module.0.weight") == "module.enc.0.weight"
    assert list(named_modules(nn.Sequential(wrapped))) == ["0", "0.module"]


def test_selection_and_parameters_use_the_same_names_under_compile_and_checkpointing():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)))
    root = nn.Sequential(torch.compile(inner))
    modules = named_modules(root)
    assert list(modules) == ["0", "0.0"]
    assert type(modules["0.0"]) is nn.Linear  # the wrapped module, not its wrapper
    assert list(named_parameters_of({"0": modules["0"]})) == ["0.0.weight", "0.0.bias"]
    raw = [name for name, _ in root.named_parameters()]
    assert raw == ["0._orig_mod.0._checkpoint_wrapped_module.weight", "0._orig_mod.0._checkpoint_wrapped_module.bias"]
    assert [logged_name(name, root) for name in raw] == ["0.0.weight", "0.0.bias"]


def test_owning_layer_prefers_the_longest_known_layer():
    assert owning_layer("enc.block.0.weight", ["enc", "enc.block"]) == "enc.block"
    assert owning_layer("enc.block.0.weight", ["enc"]) == "enc"
    assert owning_layer("enc.block.0.weight") == "enc.block.0"
    assert owning_layer("enc._orig_mod.weight", ["enc"]) == "enc"
    assert owning_layer("bias") == "bias"
