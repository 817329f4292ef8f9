"""The packed all-reduce helper without a process group (test_aggregation_sync.py runs it on 2 and 4 processes)."""

import re

import pytest
import torch

from lightning_hookdiag._distributed import all_reduce_max, all_reduce_packed, pack, unpack


def test_pack_round_trips_shapes_and_dtypes_exactly():
    parts = [torch.tensor([[1.5, -2.0]]), torch.tensor([3.25], dtype=torch.float64), torch.tensor(float("-inf"))]
    buffer = pack(parts)
    assert buffer.dtype == torch.float64
    assert buffer.tolist() == [1.5, -2.0, 3.25, float("-inf")]
    back = unpack(buffer, parts)
    for got, want in zip(back, parts, strict=True):
        assert got.shape == want.shape
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_without_a_process_group_values_come_back_unchanged():
    assert not torch.distributed.is_initialized()
    x = torch.arange(3.0)
    (y,) = all_reduce_packed([x], "sum")
    assert torch.equal(y, x)
    assert all_reduce_packed([], "max") == []


@pytest.mark.parametrize(
    ("call", "facts"),
    [
        (lambda: all_reduce_packed([torch.zeros(1)], "avg"), ["op", "['max', 'min', 'sum']", "'avg'"]),
        (lambda: pack([]), ["pack", "at least one tensor"]),
        (lambda: unpack(torch.zeros(3), [torch.zeros(4)]), ["unpack", "3 elements", "tensors 4"]),
    ],
    ids=["op", "pack", "unpack"],
)
def test_bad_arguments_are_named(call, facts):
    with pytest.raises(ValueError, match=re.escape(facts[0])) as error:
        call()
    assert all(fact in str(error.value) for fact in facts), (facts, str(error.value))


def test_all_reduce_max_without_a_process_group_is_the_identity():
    x = torch.tensor([1.0, -2.0])
    assert torch.equal(all_reduce_max(x), x)
