import pytest
import torch
from helpers import count_hooks
from torch import nn

from lightning_hookdiag import LayerHealthWarning, capture_activations


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
        self.lstm = nn.LSTM(4, 3, batch_first=True)
        self.skipped = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        out, _ = self.lstm(h)
        return out


def test_captures_detached_outputs_of_last_call():
    net = Encoder()
    x = torch.randn(2, 5, 4, requires_grad=True)
    with capture_activations(net, ["layers.1", "lstm"]) as acts:
        net(x)
        net(x * 2)  # the most recent call wins
    expected = net.layers[1](net.layers[0](x * 2))
    torch.testing.assert_close(acts["layers.1"], expected)
    assert not acts["layers.1"].requires_grad
    out, (h, c) = acts["lstm"]  # tuple outputs are kept whole, every tensor detached
    assert out.shape == (2, 5, 3)
    assert not h.requires_grad
    assert count_hooks(net) == 0


def test_to_cpu_and_globs():
    net = Encoder()
    with capture_activations(net, "layers.*", to_cpu=True) as acts:
        net(torch.randn(1, 2, 4))
    assert sorted(acts) == ["layers.0", "layers.1", "layers.2"]
    assert all(t.device.type == "cpu" for t in acts.values())


def test_unknown_name_raises_with_closest_names():
    with pytest.raises(ValueError, match=r"'layer\.1' matches no module\. Closest names: layers\.1"):  # noqa: SIM117
        with capture_activations(Encoder(), ["layer.1"]):
            pass


def test_module_that_never_ran_is_absent_and_warned():
    net = Encoder()
    with (
        pytest.warns(LayerHealthWarning, match="skipped did not run"),
        capture_activations(net, ["layers.0", "skipped"]) as acts,
    ):
        net.skipped.forward(torch.randn(1, 4))  # forward called directly: no hook fires
        net(torch.randn(1, 2, 4))
    assert "skipped" not in acts
    assert "layers.0" in acts


def test_hooks_removed_when_body_raises():
    net = Encoder()
    with pytest.raises(KeyError), capture_activations(net, ["layers.0"]):
        assert count_hooks(net) == 1
        raise KeyError("inside")
    assert count_hooks(net) == 0
