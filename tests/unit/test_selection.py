import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hookdiag import list_layers
from lightning_hookdiag._selection import import_types, named_modules, resolve_layers


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.act(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)


def test_default_selects_every_callable_leaf_in_order():
    names = list(resolve_layers(Net()))
    assert names == [
        "encoder.0.fc",
        "encoder.0.act",
        "encoder.0.mlp.0",
        "encoder.0.mlp.1",
        "encoder.1.fc",
        "encoder.1.act",
        "encoder.1.mlp.0",
        "encoder.1.mlp.1",
        "head",
    ]


def test_empty_module_list_is_not_a_leaf_to_observe():
    net = nn.Sequential(nn.Linear(2, 2))
    net.extra = nn.ModuleList()
    assert list(resolve_layers(net)) == ["0"]


def test_names_and_globs():
    net = Net()
    assert list(resolve_layers(net, ["head", "encoder.*.mlp"])) == ["encoder.0.mlp", "encoder.1.mlp", "head"]
    assert list(resolve_layers(net, ["encoder.?.fc"])) == ["encoder.0.fc", "encoder.1.fc"]


def test_layer_types_as_classes_and_import_strings():
    net = Net()
    by_class = resolve_layers(net, layer_types=import_types([nn.ReLU, "torch.nn.GELU"], "layer_types"))
    assert list(by_class) == ["encoder.0.act", "encoder.0.mlp.1", "encoder.1.act", "encoder.1.mlp.1"]
    # Non-leaf types work too when no explicit layers are given.
    blocks = resolve_layers(net, layer_types=import_types(["torch.nn.Sequential"], "layer_types"))
    assert list(blocks) == ["encoder.0.mlp", "encoder.1.mlp"]


def test_exclude_removes_matches():
    names = list(resolve_layers(Net(), exclude=["encoder.1.*", "*.act"]))
    assert names == ["encoder.0.fc", "encoder.0.mlp.0", "encoder.0.mlp.1", "head"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": ["encoder.0.fcc"]}, r"layers: 'encoder\.0\.fcc' matches no module\. Closest names: encoder\.0\.fc"),
        ({"layers": ["decoder.*"]}, r"layers: 'decoder\.\*' matches no module.*list_layers\(model\)"),
        ({"layers": ["head.weight"]}, r"'head\.weight' matches no module\. Closest names: head"),
        ({"exclude": ["nothing_here"]}, r"exclude: 'nothing_here' matches no module"),
        ({"exclude": ["*"]}, r"no module left to observe after exclude=\['\*'\]"),
    ],
)
def test_unmatched_names_raise_with_close_matches(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_layers(Net(), **kwargs)


def test_layer_types_matching_nothing_names_types_present():
    with pytest.raises(ValueError, match=r"no selected module is an instance of Conv2d; the selection holds .*Linear"):
        resolve_layers(Net(), layer_types=(nn.Conv2d,))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("torch.nn.Linearr", r"layer_types: cannot import 'torch\.nn\.Linearr'; expected a full import path"),
        ("Linear", r"cannot import 'Linear'"),
        ("nosuchpackage.Thing", r"cannot import 'nosuchpackage\.Thing'"),
        ("torch.tensor", r"expected nn\.Module subclasses or import strings, got 'torch\.tensor'"),
        (int, r"expected nn\.Module subclasses or import strings, got <class 'int'>"),
    ],
)
def test_import_types_errors(value, message):
    with pytest.raises(ValueError, match=message):
        import_types([value], "layer_types")


def test_wrapper_segments_are_removed():
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    root = nn.Module()
    root.model = torch.compile(inner, backend="eager")
    names = named_modules(root)
    assert list(names) == ["model", "model.0", "model.1"]
    assert names["model"] is inner  # the wrapped module wins over its wrapper
    assert names["model.0"] is inner[0]


def test_ddp_like_module_segment_removed_only_under_known_wrappers():
    class DistributedDataParallel(nn.Module):  # same class name as torch's wrapper, no process group needed
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    user = nn.Module()
    user.module = nn.Linear(2, 2)  # a user attribute called "module" keeps its name
    wrapped = DistributedDataParallel(user)
    assert list(named_modules(wrapped)) == ["module"]
    assert named_modules(wrapped)["module"] is user.module


def test_checkpoint_wrapper_segment_removed():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), nn.ReLU())
    assert list(resolve_layers(net)) == ["0", "1"]
    x = torch.randn(3, 2, requires_grad=True)
    checkpoint(net, x, use_reentrant=False).sum().backward()


def test_list_layers_reports_types_and_leaves():
    infos = list_layers(Net())
    by_name = {i.name: i for i in infos}
    assert by_name["encoder"].type == "ModuleList"
    assert not by_name["encoder.0"].leaf
    assert by_name["encoder.0.fc"].leaf
    assert by_name["encoder.0.fc"].type == "Linear"
    assert str(by_name["head"]) == "head  (Linear, leaf)"
    assert len(infos) == len(list(Net().modules())) - 1


class _Perceptual(nn.modules.loss._Loss):
    """A loss with a network inside it (a perceptual loss): neither it nor its submodules are default layers."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (self.features(out) - self.features(target)).pow(2).mean()


def test_losses_and_metrics_are_not_default_layers_but_stay_selectable_by_name():
    torchmetrics = pytest.importorskip("torchmetrics")
    from lightning_hookdiag._selection import is_measurement

    net = nn.Module()
    net.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    net.loss_fn = nn.CrossEntropyLoss()
    net.perceptual = _Perceptual()
    net.acc = torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)
    net.mse = torchmetrics.MeanSquaredError()
    leaves = {info.name for info in list_layers(net) if info.leaf}
    assert {"loss_fn", "acc", "mse", "perceptual.features.0"} <= leaves  # what the default would otherwise pick
    assert [n for n in ("body", "loss_fn", "perceptual", "acc", "mse") if is_measurement(getattr(net, n))] == [
        "loss_fn",
        "perceptual",
        "acc",
        "mse",
    ]
    assert list(resolve_layers(net)) == ["body.0", "body.1"]
    assert list(resolve_layers(net, ["acc", "loss_fn", "perceptual.features.0"])) == [
        "loss_fn",
        "perceptual.features.0",
        "acc",
    ]
    assert list(resolve_layers(net, layer_types=(torchmetrics.Metric,))) == ["acc", "mse"]


def test_selection_does_not_import_torchmetrics():
    import subprocess
    import sys

    code = "import sys, lightning_hookdiag._selection; print('torchmetrics' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
