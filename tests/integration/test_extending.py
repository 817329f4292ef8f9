"""docs/extending.md run as written: its components and rules, passed to one callback through ``extensions=``."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TinyModule, by_name, count_hooks, make_data, make_trainer

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.components import Component, Setup, component
from lightning_hookdiag.rules import BATCH

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def page_code() -> dict[str, Any]:
    """Every ``python`` block of the page, run in order in one namespace (as a reader would paste them)."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    namespace: dict[str, Any] = {"__name__": "extending_page"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def test_the_page_builds_a_callback_with_its_extensions():
    page = page_code()
    callback = page["callback"]
    assert isinstance(callback, LayerHealthCallback)
    assert {"huge_input", "flat_output"} <= set(callback.alert_counts)
    assert not {"huge_input", "flat_output"} & set(LayerHealthCallback().alert_counts)  # nothing process-wide


def test_a_components_fact_reaches_its_rule_by_name_in_its_callback_only():
    page = page_code()
    data = make_data(n=16)
    data.tensors[0][3, 1] = -5e3  # in the first batch (8 rows, not shuffled): step 0's inputs reach |x| = 5000
    module = TinyModule(data=data)
    callback = page["callback"]
    plain = LayerHealthCallback(every_n_steps=1, prefix="plain", on_anomaly="ignore")
    callback.on_anomaly = "ignore"
    make_trainer([callback, plain], max_steps=2).fit(module)

    inputs = {step: x for step, x, _, _ in module.record}
    peaks = {step: float(x.double().abs().max()) for step, x in inputs.items()}  # computed here, from the batches
    assert peaks[0] == 5e3
    assert peaks[1] < 1e3
    found = [f for f in callback.findings if f.rule == "huge_input"]
    assert [(f.step, f.layer, f.value, f.threshold, f.stat) for f in found] == [(0, BATCH, 5e3, 1e3, "input_absmax")]
    assert "|x| = 5e+03 at step 0" in found[0].message
    assert callback.alert_counts["huge_input"] == 1  # silent on step 1
    assert callback.alert_counts["flat_output"] == 0
    # The other callback of the same fit built no such component and runs no such rule.
    assert "huge_input" not in plain.alert_counts
    assert not [k for k in plain.last_metrics if "abs_sum" in k]
    assert count_hooks(module) == 0


def test_the_pages_statistic_is_logged_with_the_outputs_own_values():
    page = page_code()
    module = TinyModule()
    make_trainer([callback := page["callback"]], max_steps=1).fit(module)
    ((_, x, _, weights),) = module.record
    net = module.model
    net.load_state_dict(weights)
    with torch.no_grad():
        outputs = {"model.0": net[0](x)}
        outputs["model.1"] = net[1](outputs["model.0"])
        outputs["model.2"] = net[2](outputs["model.1"])
    logged = {k.split("/")[-1]: v for k, v in by_name(callback.last_metrics).items() if "/act_abs_sum/" in k}
    assert logged.keys() == outputs.keys()
    for name, out in outputs.items():
        assert logged[name] == pytest.approx(float(out.double().abs().sum()), rel=1e-6), name


class _Quiet(Component):
    """A component that watches nothing: what is pickled here is the factory, not its work."""


@component
def quiet_part(setup: Setup) -> _Quiet:
    return _Quiet()


def test_a_callback_with_a_decorated_component_pickles_before_and_after_a_fit():
    # The module attribute quiet_part is the ComponentFactory, not the function: pickle must find it by name.
    callback = LayerHealthCallback(every_n_steps=1, output={"summary": False}, extensions=[quiet_part])
    assert pickle.loads(pickle.dumps(callback)).extensions.components == (quiet_part,)
    make_trainer([callback], max_steps=2).fit(TinyModule())
    copy = pickle.loads(pickle.dumps(callback))
    assert copy.extensions.components == (quiet_part,)
    assert copy.last_metrics == callback.last_metrics
