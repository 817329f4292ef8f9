"""The bug benchmark as a table: what the callback says on each ordinary training bug, and on its fixed twin.

Runs every case of ``tests/bugs/`` (the bug and its twin, with the case's settings, then the bug again with the
default ``every_n_steps=50``) and the healthy zoo of ``tests/helpers/zoo.py`` (every step sampled), and prints, per
class of principle, how many bugs are named at the right layer at both intervals (TrainCheck's ports apart), the twins
that are not silent, one row per case, and the totals next to DeepDiagnosis's figures. The output is kept in
``docs/bugs.md``:

    PYTHONPATH=$PWD python benchmarks/bugs.py > docs/bugs.md

40-60 seconds on one thread (it sets one: the models are tiny), depending on the load.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "bugs"), str(ROOT / "tests")]

from cases import CASES, PRINCIPLES, Case, run  # noqa: E402
from principles import PRINCIPLE_CASES  # noqa: E402
from traincheck import NOT_PORTED  # noqa: E402

from lightning_hookdiag import LayerHealthCallback  # noqa: E402
from lightning_hookdiag.rules import Finding  # noqa: E402

DEFAULT_EVERY = 50
ZOO_STEPS = 42
# DeepDiagnosis (Wardat et al., ICSE 2022), on its benchmark of 53 buggy and 188 healthy models.
DEEPDIAGNOSIS = {"identified": (46, 53), "localised": (34, 53), "healthy flagged": (67, 188)}
# Where each case sits in the categories the field reports (a case may sit in several).
CATEGORIES = [
    ("issue 28, stretch", "layers in a Python list; a repeated-sample batch; a softmax before cross-entropy",
     ["layers_in_a_python_list", "repeated_sample_batch", "double_softmax"]),
    ("PyTorch forum", "\"no trainable layers\", \"eval() before forward\", eval mode left on, zero_grad forgotten",
     ["layers_in_a_python_list", "eval_before_forward", "eval_mode_left_on", "grads_never_zeroed"]),
    ("DeepDiagnosis: numerical errors", "NaN/Inf made in the forward or the backward",
     ["nan_log_in_wrapper", "nan_from_sqrt"]),
    ("DeepDiagnosis: dying ReLU", "units <= 0 for every sample",
     ["dying_relus", "sgd_lr_too_high", "zero_init", "relu_on_the_output"]),
    ("DeepDiagnosis: saturated activation", "Tanh/Sigmoid at their bounds", ["saturating_tanh"]),
    ("DeepDiagnosis: vanishing / exploding gradient", "the gradient fades or grows towards the input",
     ["deep_sigmoid", "exploding_no_clipping", "exploding_relu_rnn", "loss_summed_not_averaged"]),
    ("DeepDiagnosis: unchanged weight", "weights that do not move",
     ["head_not_in_optimizer", "bf16_rounded_away", "lr_too_low", "tiny_gradient_clip", "step_lr_every_step"]),
    ("DeepDiagnosis: preprocessing, last-layer activation, layout", "what the fixes of their benchmark change",
     ["raw_pixels", "one_feature_in_raw_units", "unnormalised_batch", "relu_on_the_output", "double_softmax",
      "sigmoid_into_bce_with_logits", "missing_activation"]),
    ("TrainCheck: API misuse and silent pipeline errors", "optimizer membership, mode, gradient flow, scheduler,"
     " data pipeline, precision",
     ["head_not_in_optimizer", "grads_never_zeroed", "eval_mode_left_on", "stray_detach", "no_grad_body",
      "step_lr_every_step", "repeated_sample_batch", "wrong_label_batch", "bf16_rounded_away"]),
]  # fmt: skip
ELSEWHERE = [
    (
        "DDP replicas out of sync (a rank-dependent update, a buffer never broadcast)",
        "`replica_divergence`, tested with 2 gloo processes in the DDP tests of that rule (not repeated here)",
    ),
    (
        "Post-LN without warm-up stalling at chance (blind spot, no case)",
        "a 6-layer Post-LN `nn.TransformerEncoder` (d_model 64, Adam at 1e-3 from step 0) against its Pre-LN twin on"
        " a 4-class token task, 200 steps with every step sampled: both losses stay near chance (means of the last 10"
        " steps 1.34 and 1.25, ln 4 = 1.39), the first layer's output gradient is 0.16x the head's (Pre-LN: 0.29x),"
        " attention logits at most 5.1: no statistic separates them and no rule fires on either. The stall of"
        " Xiong et al. (2020) needs depth and width beyond a CPU test's budget to reproduce",
    ),
]


def _words(message: str, n: int = 14) -> str:
    words = message.split()
    return " ".join(words[:n]) + (" ..." if len(words) > n else "")


def _said(case: Case, findings: list[Finding]) -> str:
    if not findings:
        return "nothing"
    hits = [f for f in findings if f.rule == case.rule and f.layer == case.layer]
    same_rule = [f for f in findings if f.rule == case.rule]
    first = (hits or same_rule or findings)[0]
    more = len(findings) - 1
    tail = f" (+{more} more)" if more else ""
    return f"`{first.rule}` on `{first.layer}` at step {first.step}: {_words(first.message)}{tail}".replace("|", "/")


def _first_step(case: Case, findings: list[Finding]) -> int | None:
    hits = [f.step for f in findings if f.rule == case.rule and f.layer == case.layer]
    return hits[0] if hits else None


def _zoo_false_alarms() -> tuple[int, int, list[str]]:
    import transformers
    from helpers import make_trainer
    from helpers.zoo import ZOO, zoo_module

    transformers.logging.set_verbosity_error()
    flagged = []
    for name in ZOO:
        torch.manual_seed(0)
        module = zoo_module(name, n=8 * ZOO_STEPS)
        callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
        trainer = make_trainer([callback], ZOO_STEPS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' and Lightning's notes on tiny runs
            trainer.fit(module)
        if callback.findings:
            flagged.append(f"{name}: {callback.findings[0].message}")
    return len(flagged), len(ZOO), flagged


@dataclass
class Result:
    """What the callback said on one case: the bug, its twin, and the bug at the default interval."""

    case: Case
    sick: list[Finding]
    twin: list[Finding]
    default: list[Finding] | None
    default_steps: int

    @property
    def named(self) -> bool:
        """Named by its rule at the right layer within the fit (``every_n_steps=1`` unless the case sets it)."""
        return self.case.rule is not None and _first_step(self.case, self.sick) is not None

    @property
    def named_default(self) -> bool:
        """Named by its rule at the right layer with ``every_n_steps=50``, within ``default_steps``."""
        return self.default is not None and _first_step(self.case, self.default) is not None


def _measure(case: Case) -> Result:
    steps = max(case.max_steps, DEFAULT_EVERY + 1)
    sick = run(case, sick=True).findings
    twin = run(case, sick=False).findings
    default = run(case, sick=True, max_steps=steps, every_n_steps=DEFAULT_EVERY).findings if case.rule else None
    return Result(case, sick, twin, default, steps)


def _row(r: Result) -> str:
    case = r.case
    expected = (
        f"`{case.rule}` on `{case.layer}`"
        if case.rule
        else "(known miss" + (f": `{case.layer}`)" if case.layer else ")")
    )
    at = None if r.default is None else _first_step(case, r.default)
    if r.default is None:
        default_cell = "-"
    elif at is None:
        first = r.default[0] if r.default else None
        default_cell = "missed" + (f" (`{first.rule}` on `{first.layer}` at step {first.step})" if first else "")
    else:
        default_cell = f"step {at} of {r.default_steps}"
    found = case.rule is not None and any(f.rule == case.rule for f in r.sick)
    twin = "yes" if not r.twin else "NO: " + _said(case, r.twin)
    return (
        f"| {case.name} | {case.principle} | {case.bug} | {expected} | {_said(case, r.sick)} |"
        f" {'yes' if found else 'no'} | {'yes' if r.named else 'no'} | {twin} | {default_cell} |"
    )


def _table(results: list[Result]) -> list[str]:
    return [
        "| bug | principle | how it arises | expected (a known miss: where a right diagnosis points) |"
        f" what the callback says (first finding) | detected? | named at the right layer? | twin silent? |"
        f" with every_n_steps={DEFAULT_EVERY} |",
        "|---|---|---|---|---|---|---|---|---|",
        *[_row(r) for r in results],
    ]


def _by_principle(results: list[Result]) -> list[str]:
    out = [
        f"| principle | types | named at the right layer, every_n_steps=1 | named, every_n_steps={DEFAULT_EVERY} |"
        " twins silent | missed |",
        "|---|---:|---:|---:|---:|---|",
    ]
    totals = [0, 0, 0, 0]
    for principle in PRINCIPLES:
        group = [r for r in results if r.case.principle == principle]
        if not group:
            continue
        named = sum(r.named for r in group)
        named_default = sum(r.named_default for r in group)
        quiet = sum(not r.twin for r in group)
        missed = ", ".join(f"`{r.case.name}`" for r in group if not r.named) or "-"
        out.append(f"| {principle} | {len(group)} | {named} | {named_default} | {quiet} | {missed} |")
        for i, v in enumerate((len(group), named, named_default, quiet)):
            totals[i] += v
    n, named, named_default, quiet = totals
    out.append(
        f"| **all** | **{n}** | **{named} ({100 * named / n:.0f} %)** |"
        f" **{named_default} ({100 * named_default / n:.0f} %)** | **{quiet}** | |"
    )
    return out


def _new_types_line(types: list[Result]) -> str:
    # Issue 38's measure: the share of bugs never described to the rules' authors that is named at the right layer.
    new = [r for r in types if r.case in PRINCIPLE_CASES]
    named = sum(r.named for r in new)
    return (
        f"Of the {len(new)} types written for issue 38 (`principles.py`, as a user would write them, not to fit a"
        f" rule), {named} are named at the right layer ({100 * named / len(new):.0f} %), with every twin"
        f" {'silent' if not any(r.twin for r in new) else 'NOT silent'}."
    )


def main() -> None:
    """Run every case, the ports and the zoo; print the markdown tables."""
    start = time.perf_counter()
    results = [_measure(case) for case in CASES]
    types = [r for r in results if not r.case.source]
    ports = [r for r in results if r.case.source]
    zoo_flagged, zoo_total, zoo_messages = _zoo_false_alarms()
    countable = [r for r in types if r.case.rule is not None]
    detected = sum(any(f.rule == r.case.rule for f in r.sick) for r in countable)
    named = sum(r.named for r in types)
    twins_loud = sum(bool(r.twin) for r in results)
    n, n_rule = len(types), len(countable)
    out = [
        "# The bug benchmark",
        "",
        "Generated by `benchmarks/bugs.py` from the cases of `tests/bugs/` (`cases.py`, `misses.py`,",
        "`principles.py`, and TrainCheck's bugs ported in `traincheck.py`): each bug is a small real Lightning fit in",
        "which the bug arises as it does for users, next to its fixed twin. Settings: `every_n_steps=1` unless the",
        "case sets otherwise (the spike cases run with 50, as the sentinel catches them between sampled steps); the",
        "deadline is the case's own `max_steps`. The default-interval column reruns the bug with",
        f"`every_n_steps={DEFAULT_EVERY}` for at least {DEFAULT_EVERY + 1} steps.",
        "Each type names its class of principle: issue 38's six principles (1-6), then the field's other classes. A",
        "known miss (no rule yet) names where a right diagnosis points and says what the callback reports today.",
        "What each rule measures and cannot see: [rules.md](rules.md).",
        "",
        "## By principle",
        "",
        f"{n} bug types (TrainCheck's ports apart, below):",
        "",
        *_by_principle(types),
        "",
        f"TrainCheck's bugs: {len(ports)} ported of {len(ports) + len(NOT_PORTED)} entries (its artifact publishes 18",
        "bugs; `tc_pytorch_84803` also stands for baichuan2-86 and pytorch-96600, which TrainCheck reproduces the same",
        "way):",
        "",
        *_by_principle(ports),
        "",
        f"**Totals:** of {n} bug types, {named} are named at the right layer ({100 * named / n:.0f} %); the rules"
        f" detect {detected}/{n_rule} and name {sum(r.named for r in countable)}/{n_rule} of the bugs a rule is meant"
        f" to see; {n - n_rule} are known misses or blind spots. False alarms on {twins_loud}/{len(results)} fixed"
        f" twins (ports included) and on {zoo_flagged}/{zoo_total} healthy zoo models ({ZOO_STEPS} steps, every step"
        " sampled).",
        "",
        _new_types_line(types),
        "",
        "| | this benchmark | DeepDiagnosis (ICSE 2022) |",
        "|---|---|---|",
        f"| bugs identified | {detected}/{n} | {DEEPDIAGNOSIS['identified'][0]}/{DEEPDIAGNOSIS['identified'][1]} |",
        f"| bugs localised | {named}/{n} | {DEEPDIAGNOSIS['localised'][0]}/{DEEPDIAGNOSIS['localised'][1]} |",
        f"| healthy models flagged | {zoo_flagged}/{zoo_total} zoo, {twins_loud}/{len(results)} twins |"
        f" {DEEPDIAGNOSIS['healthy flagged'][0]}/{DEEPDIAGNOSIS['healthy flagged'][1]} |",
        "",
        "The benchmarks differ (DeepDiagnosis's 53 Keras models from Stack Overflow and GitHub against these small",
        "Lightning fits), so the comparison is of rates, not of bugs.",
        "",
        "## Every bug type",
        "",
        *_table(types),
        "",
        "## TrainCheck's bugs (OSDI 2025), ported",
        "",
        *_table(ports),
        "",
        "Sources: " + ", ".join(f"`{r.case.name}` <{r.case.source}>" for r in ports) + ".",
        "",
        "Not ported, and why:",
        "",
        "| TrainCheck bug | source | why not |",
        "|---|---|---|",
        *[f"| {bug} | <{url}> | {why} |" for bug, url, why in NOT_PORTED],
    ]
    out += ["", "## Categories", "", "| category | what | cases |", "|---|---|---|"]
    out += [f"| {cat} | {what} | {', '.join(f'`{n}`' for n in names)} |" for cat, what, names in CATEGORIES]
    missed = [c for c in CASES if c.rule is not None and c.default_step is None]
    if missed:
        out += ["", f"## Missed at every_n_steps={DEFAULT_EVERY}, and what the sentinel's every-step signals show", ""]
        out += [f"- `{c.name}`: {c.default_note}." for c in missed]
    out += ["", "## Known misses and blind spots, by principle", ""]
    for principle in PRINCIPLES:
        for c in (r.case for r in results if r.case.rule is None and r.case.principle == principle):
            out.append(f"- {principle}: `{c.name}` ({c.bug}): {c.blind}.")
    out += [f"- {what}: {where}." for what, where in ELSEWHERE]
    if zoo_messages:
        out += ["", "## False alarms on the zoo", "", *[f"- {m}" for m in zoo_messages]]
    out += ["", f"_{time.perf_counter() - start:.0f} s on {torch.get_num_threads()} thread(s)._"]
    print("\n".join(out))


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny models: one thread is faster than two, and leaves a core to the rest
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # Lightning's notes would interleave the table
    warnings.simplefilter("ignore")
    main()
