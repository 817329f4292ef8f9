"""The bug benchmark as a table: what the callback says on each ordinary training bug, and on its fixed twin.

Runs every case of ``tests/bugs/cases.py`` (the bug and its twin, with the case's settings, then the bug again with
the default ``every_n_steps=50``) and the healthy zoo of ``tests/zoo.py`` (every step sampled), and prints a
markdown table with totals next to DeepDiagnosis's figures. The output is kept in ``docs/bugs.md``:

    PYTHONPATH=$PWD python benchmarks/bugs.py > docs/bugs.md

About 10 seconds on 2 CPU cores.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "bugs"), str(ROOT / "tests")]

from cases import CASES, Case, run  # noqa: E402

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
    import lightning.pytorch as pl
    import transformers
    from zoo import ZOO, zoo_module

    transformers.logging.set_verbosity_error()
    flagged = []
    for name in ZOO:
        torch.manual_seed(0)
        module = zoo_module(name, n=8 * ZOO_STEPS)
        callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
        trainer = pl.Trainer(
            callbacks=[callback],
            max_steps=ZOO_STEPS,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' and Lightning's notes on tiny runs
            trainer.fit(module)
        if callback.findings:
            flagged.append(f"{name}: {callback.findings[0].message}")
    return len(flagged), len(ZOO), flagged


def main() -> None:
    """Run every case and the zoo; print the markdown table."""
    start = time.perf_counter()
    rows, detected, localised, twins_loud, blind = [], 0, 0, 0, []
    countable = [c for c in CASES if c.rule is not None]
    for case in CASES:
        sick = run(case, sick=True)
        twin = run(case, sick=False)
        steps = max(case.max_steps, DEFAULT_EVERY + 1)
        default = run(case, sick=True, max_steps=steps, every_n_steps=DEFAULT_EVERY) if case.rule else None
        found = case.rule is not None and any(f.rule == case.rule for f in sick.findings)
        placed = _first_step(case, sick.findings) is not None
        detected += found
        localised += placed
        twins_loud += bool(twin.findings)
        if case.rule is None:
            blind.append(case)
        name = case.name
        expected = f"`{case.rule}` on `{case.layer}`" if case.rule else "(blind spot)"
        at = None if default is None else _first_step(case, default.findings)
        if default is None:
            default_cell = "-"
        elif at is None:
            first = default.findings[0] if default.findings else None
            default_cell = "missed" + (f" (`{first.rule}` on `{first.layer}` at step {first.step})" if first else "")
        else:
            default_cell = f"step {at} of {steps}"
        rows.append(
            f"| {name} | {case.bug} | {expected} | {_said(case, sick.findings)} | {'yes' if found else 'no'} |"
            f" {'yes' if placed else 'no'} | {'yes' if not twin.findings else 'NO: ' + _said(case, twin.findings)} |"
            f" {default_cell} |"
        )
    zoo_flagged, zoo_total, zoo_messages = _zoo_false_alarms()
    n = len(countable)
    out = [
        "# The bug benchmark",
        "",
        "Generated by `benchmarks/bugs.py` from the cases of `tests/bugs/cases.py`: each bug is a small real Lightning",
        "fit in which the bug arises as it does for users, next to its fixed twin. Settings: `every_n_steps=1` unless",
        "the case sets otherwise (the spike cases run with 50, as the sentinel catches them between sampled steps);",
        f"the last column reruns the bug with the default `every_n_steps={DEFAULT_EVERY}` for at least"
        f" {DEFAULT_EVERY + 1} steps. What each rule measures and cannot see: [rules.md](rules.md).",
        "",
        "| bug | how it arises | expected | what the callback says (first finding) | detected? | localised? |"
        f" twin silent? | with every_n_steps={DEFAULT_EVERY} |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"**Totals:** detected {detected}/{n}, localised to the right layer {localised}/{n} (of the {n} bugs a rule"
        f" is meant to see; {len(blind)} more are blind spots), false alarms on {twins_loud}/{len(CASES)} fixed twins"
        f" and on {zoo_flagged}/{zoo_total} healthy zoo models ({ZOO_STEPS} steps, every step sampled).",
        "",
        "| | this benchmark | DeepDiagnosis (ICSE 2022) |",
        "|---|---|---|",
        f"| bugs identified | {detected}/{n} | {DEEPDIAGNOSIS['identified'][0]}/{DEEPDIAGNOSIS['identified'][1]} |",
        f"| bugs localised | {localised}/{n} | {DEEPDIAGNOSIS['localised'][0]}/{DEEPDIAGNOSIS['localised'][1]} |",
        f"| healthy models flagged | {zoo_flagged}/{zoo_total} zoo, {twins_loud}/{len(CASES)} twins |"
        f" {DEEPDIAGNOSIS['healthy flagged'][0]}/{DEEPDIAGNOSIS['healthy flagged'][1]} |",
        "",
        "The benchmarks differ (DeepDiagnosis's 53 Keras models from Stack Overflow and GitHub against these small",
        "Lightning fits), so the comparison is of rates, not of bugs.",
    ]
    out += ["", "## Categories", "", "| category | what | cases |", "|---|---|---|"]
    out += [f"| {cat} | {what} | {', '.join(f'`{n}`' for n in names)} |" for cat, what, names in CATEGORIES]
    missed = [c for c in CASES if c.rule is not None and c.default_step is None]
    if missed:
        out += ["", f"## Missed at every_n_steps={DEFAULT_EVERY}, and what the sentinel's every-step signals show", ""]
        out += [f"- `{c.name}`: {c.default_note}." for c in missed]
    out += ["", "## Blind spots", ""]
    out += [f"- `{c.name}` ({c.bug}): {c.blind}." for c in blind]
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
