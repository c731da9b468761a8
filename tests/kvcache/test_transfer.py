"""A step's host inputs reach the device in one copy (kvcache/transfer.py): packing into one int64 tensor and back
gives every tensor its values, shape and dtype again."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from sluice.kvcache.transfer import packed, tensors_to_device, unpacked

shapes = st.lists(st.integers(0, 5), min_size=1, max_size=2)
dtypes = st.sampled_from([torch.long, torch.int32])


@given(st.lists(st.tuples(shapes, dtypes), min_size=1, max_size=5), st.integers(0, 2**31 - 1))
def test_unpacked_inverts_packed(specs, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.long).to(dtype)
               for shape, dtype in specs]
    back = unpacked(packed(tensors), tensors)
    assert all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t) for b, t in zip(back, tensors,
                                                                                                strict=True))


def test_on_cpu_the_tensors_are_returned_as_they_are():
    tensors = [torch.arange(3), torch.zeros(2, 2, dtype=torch.int32)]
    assert all(a is b for a, b in zip(tensors_to_device(tensors, torch.device("cpu")), tensors, strict=True))
