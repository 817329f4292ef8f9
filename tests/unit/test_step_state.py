"""The open-step state machine: windows open, finish or are discarded; micro-batches are kept per optimizer step."""

from __future__ import annotations

import pytest

from lightning_hookdiag._step_state import StepMicroBatches, StepState, Trip, Window, plan_trip


def test_a_sampled_step_opens_one_window_that_closes_once():
    state = StepState(every_n_steps=4)
    assert [s for s in range(9) if state.sampled(s)] == [0, 4, 8]
    assert state.window is None
    window = state.open(4)
    assert (window.step, window.layers, window.trip, window.stepped, window.stale) == (4, True, None, set(), None)
    assert state.open_for(4) is window
    assert state.open_for(5) is None  # the open window is step 4's, not step 5's
    assert state.close() is window
    assert state.window is None
    assert state.close() is None  # closing again (a discard after a finish) is a no-op


def test_a_trip_that_cannot_be_replayed_opens_a_parameter_window_and_samples_the_next_step():
    state = StepState(every_n_steps=10)
    window = state.open(3, layers=False)
    state.sample_next = 4
    assert not window.layers
    assert state.sampled(4)
    assert not state.sampled(5)
    state.close()
    assert state.sampled(4)  # the schedule outlives the window: step 4 is hooked when it starts


def test_a_discarded_window_leaves_nothing_for_the_next_one():
    state = StepState(every_n_steps=1)
    first = state.open(2)
    first.trip, first.stale, first.stale_checked = "trip", "stale", True
    assert first.first_call("sgd")
    state.close()  # discarded: a batch skipped by on_train_batch_start returning -1
    second = state.open(2)
    assert second is not first
    assert (second.trip, second.stale, second.stale_checked, second.stepped) == (None, None, False, set())


def test_each_optimizer_is_measured_once_per_window_however_often_its_closure_runs():
    window = Window(step=0)
    sgd, adam = object(), object()
    # LBFGS: the optimizer step hook runs once per closure evaluation; only the first sees the weights before it.
    assert [window.first_call(o) for o in (sgd, sgd, adam, sgd, adam)] == [True, False, True, False, False]
    assert window.stepped == {id(sgd), id(adam)}


def test_the_sentinel_checks_each_step_once():
    state = StepState(every_n_steps=1)
    assert state.first_check(7)
    assert not state.first_check(7)  # the second closure evaluation of step 7
    assert state.first_check(8)
    assert state.checked_step == 8


def test_micro_batches_are_kept_per_optimizer_step():
    micro = StepMicroBatches()
    assert not micro.holds(0)
    micro.keep(0, "a")
    micro.keep(0, "b")  # gradient accumulation: the second micro-batch of step 0
    assert micro.holds(0)
    assert not micro.holds(1)
    assert micro.batches == ["a", "b"]
    micro.keep(1, "c")
    assert (micro.step, micro.batches) == (1, ["c"])
    micro.release()
    assert (micro.step, micro.batches) == (None, [])
    assert not micro.holds(1)  # resumed inside a step: its micro-batches were never seen


def test_a_sampled_step_inside_a_batch_is_observed_on_the_next_batch():
    state = StepState(every_n_steps=3)
    # Two optimizer steps a batch (a GAN): batches start at 0, 2, 4, ...; histograms every 9 steps (step 9 falls
    # inside the batch of steps 8 and 9, so the histograms come with the next sampled batch, at 10).
    found = [(s, state.late, state.due(s, 9)) for s in range(0, 24, 2) if state.sampled(s)]
    assert found == [
        (0, None, True),
        (4, 3, False),
        (6, None, False),
        (10, 9, True),
        (12, None, False),
        (16, 15, False),
        (18, None, True),
        (22, 21, False),
    ]
    # Gradient accumulation: one step starts several batches; each asks again and gets the same answer.
    state = StepState(every_n_steps=3)
    assert [state.sampled(s) for s in (0, 0, 1, 1, 2, 2, 3, 3)] == [True, True, False, False, False, False, True, True]
    # A trip that could not be replayed inside a batch: the step after it falls inside that batch too.
    state = StepState(every_n_steps=10)
    assert not state.sampled(2)
    state.sample_next = 3
    assert state.sampled(4)
    assert state.late == 3
    assert not state.sampled(6)  # once


# ------------------------------------------------------------------------------------------------ the trip plan
NAN = Trip(7, "nonfinite_loss", float("nan"), last_finite_step=6)
SPIKE = Trip(7, "loss_spike", 40.0, baseline=1.0)
MANUAL = "of manual optimization: training_step steps the optimizer itself"


def plan(trip=NAN, sampled=False, traces=True, blocker=None, previous=None, held=True):
    return plan_trip(trip, sampled=sampled, traces=traces, blocker=blocker, previous=previous, held=held)


@pytest.mark.parametrize(
    ("case", "action", "trace", "read_batch"),
    [
        ({}, "replay", True, True),  # an unsampled NaN: replayed, traced, its batch read
        ({"trip": SPIKE, "traces": False}, "replay", False, False),  # a spike: neither traced nor read
        ({"sampled": True}, "trace", False, True),  # the hooks saw it: the trace alone runs again
        ({"sampled": True, "trip": SPIKE, "traces": False}, "observed", False, False),
        ({"sampled": True, "blocker": MANUAL}, "observed", False, True),  # no re-run under manual optimization
        ({"sampled": True, "previous": 6}, "observed", False, True),
        ({"sampled": True, "held": False}, "observed", False, False),  # resumed inside the step: nothing to re-run
    ],
)
def test_a_trip_that_can_be_observed_is_replayed_or_traced(case, action, trace, read_batch):
    got = plan(**case)
    assert (got.action, got.trace, got.read_batch) == (action, trace, read_batch)
    assert got.trip == Trip(**{**vars(case.get("trip", NAN)), "replayed": True})  # no reason: it was observed


@pytest.mark.parametrize(
    ("case", "reason", "read_batch"),
    [
        ({"blocker": MANUAL}, MANUAL, True),
        ({"blocker": "the replay raised RuntimeError: boom"}, "the replay raised RuntimeError: boom", True),
        ({"blocker": MANUAL, "trip": SPIKE}, MANUAL, False),
        ({"held": False}, "its micro-batches were not seen by the callback", False),
    ],
)
def test_a_trip_that_cannot_be_replayed_measures_the_parameters_and_says_why(case, reason, read_batch):
    got = plan(**case)
    assert (got.action, got.trace, got.read_batch) == ("parameters", False, read_batch)
    assert got.trip.reason.startswith(reason)
    assert not got.trip.replayed


@pytest.mark.parametrize("blocker", [None, MANUAL])
def test_a_failure_that_persists_is_only_recorded(blocker):
    got = plan(previous=6, blocker=blocker)  # the previous step tripped too: it was reported there
    assert (got.action, got.trace, got.read_batch, got.trip.replayed) == ("record", False, False, False)
    assert "the previous step tripped too" in got.trip.reason
    assert plan(previous=5).action == "replay"  # an earlier trip, not the previous step's: reported again


@pytest.mark.parametrize(("trip", "traces"), [(NAN, True), (NAN, False), (SPIKE, False)])
def test_a_failed_replay_plans_what_a_step_blocked_for_that_reason_plans(trip, traces):
    replay = plan(trip, traces=traces)
    assert replay.action == "replay"
    failed = replay.failed("the replay raised ValueError: x")
    assert failed == plan(trip, traces=traces, blocker="the replay raised ValueError: x")
    assert (failed.action, failed.trip.replayed, failed.trace) == ("parameters", False, False)
