import pytest
import torch

from gemzoo.errors import JaggedShapeError
from gemzoo.jagged import lengths_to_offsets, positions, seq_ids, validate_offsets
from gemzoo.ops import jagged_to_padded, padded_to_jagged


@pytest.mark.parametrize("offsets,total,rule", [
    (torch.tensor([0, 3, 2, 5]), 5, r"non-decreasing.*offsets\[2\]=2 < offsets\[1\]=3"),
    (torch.tensor([1, 3, 5]), 5, r"offsets\[0\] must be 0"),
    (torch.tensor([0, 3, 4]), 5, r"offsets\[-1\] must equal .* T=5, got 4"),
    (torch.tensor([0, 3, 5], dtype=torch.int32), 5, "dtype torch.int64"),
    (torch.tensor([[0, 5]]), 5, "1-D"),
    ([0, 5], 5, "torch.Tensor"),
])
def test_bad_offsets_name_the_rule(offsets, total, rule):
    with pytest.raises(JaggedShapeError, match=rule):
        validate_offsets(offsets, total)


def test_wrong_device_is_named():
    with pytest.raises(JaggedShapeError, match="meta"):
        validate_offsets(torch.tensor([0, 1]), 1, device="meta")


def test_zero_length_sequences_are_legal():
    off = lengths_to_offsets(torch.tensor([0, 3, 0, 2, 0]))
    validate_offsets(off, 5)
    assert seq_ids(off).tolist() == [1, 1, 1, 3, 3]
    assert positions(off).tolist() == [0, 1, 2, 0, 1]


def test_padded_round_trip_and_gradient():
    off = lengths_to_offsets(torch.tensor([2, 0, 3]))
    x = torch.randn(5, 4, requires_grad=True)
    padded = jagged_to_padded(x, off)
    assert padded.shape == (3, 3, 4)
    assert torch.equal(padded[1], torch.zeros(3, 4))
    back = padded_to_jagged(padded, off)
    assert torch.equal(back, x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_tensor_cache_keys_on_identity_version_and_key():
    from gemzoo.jagged import TensorCache

    cache, calls = TensorCache(size=2), []

    def build(v):
        calls.append(v)
        return v

    a = torch.tensor([0, 3])
    assert cache.get((a,), ("x",), lambda: build(1)) == 1
    assert cache.get((a,), ("x",), lambda: build(2)) == 1  # cached
    assert cache.get((a,), ("y",), lambda: build(3)) == 3  # another key
    a.add_(1)
    assert cache.get((a,), ("x",), lambda: build(4)) == 4  # changed in place: built again
    assert cache.get((a.clone(),), ("x",), lambda: build(5)) == 5  # another tensor, same values
    assert len(cache.entries) == 2  # the oldest went
    with torch.inference_mode():
        b = torch.tensor([0, 1])
    assert cache.get((b,), (), lambda: build(6)) == 6 and cache.get((b,), (), lambda: build(7)) == 7  # never cached
    assert calls == [1, 3, 4, 5, 6, 7]
