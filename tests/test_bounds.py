"""kernels.bounds: under the interpreter, an access outside the tensor it reaches into stops the
launch with an error that names it, before any memory is read or written."""

import pytest
import torch
import triton
import triton.language as tl

from kernels.runtime import INTERPRET

pytestmark = pytest.mark.skipif(
    not INTERPRET, reason="the check runs under Triton's interpreter (CPU mode) only"
)


@triton.jit
def _double(x_ptr, out_ptr, n, shift, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK) + shift
    if MASKED:
        mask = (offsets >= 0) & (offsets < n)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)
    else:
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * 2)


@triton.jit
def _count(count_ptr, slot):
    tl.atomic_add(count_ptr + slot, 1)


def _launch(n, block, masked, shift=0, x=None):
    x = torch.randn(n) if x is None else x
    out = torch.full_like(x, -1.0)
    _double[(triton.cdiv(n, block),)](x, out, n, shift, BLOCK=block, MASKED=masked)
    return x, out


@pytest.mark.parametrize("n, block", [(3, 1024), (1, 128), (129, 64), (256, 128)])
def test_masked_accesses_pass_and_compute(n, block):
    x, out = _launch(n, block, masked=True)
    assert torch.equal(out, x * 2)


def test_an_unmasked_kernel_that_stays_inside_passes():
    x, out = _launch(256, 128, masked=False)
    assert torch.equal(out, x * 2)


def test_an_unmasked_tail_stops_at_the_load_and_names_the_tensor():
    with pytest.raises(Exception, match=r"tl\.load past the end of x_ptr: element 3, where it"):
        _launch(3, 1024, masked=False)


def test_the_message_counts_the_elements_outside_and_says_what_to_do():
    with pytest.raises(Exception) as caught:
        _launch(129, 64, masked=False)
    message = str(caught.value)
    assert "element 129, where it has 129 (63 of this access's 64 elements outside it)" in message
    assert "Mask it" in message


def test_a_negative_offset_is_before_the_start():
    with pytest.raises(Exception, match=r"tl\.load before the start of x_ptr: element -1"):
        _launch(64, 64, masked=False, shift=-1)


def test_a_store_past_the_end_is_stopped_before_it_writes():
    """The whole access is refused: even out's own elements keep their values."""
    x, out = torch.randn(8), torch.full((3,), -1.0)
    with pytest.raises(Exception, match=r"tl\.store past the end of out_ptr: element 3"):
        _double[(1,)](x, out, 3, 0, BLOCK=8, MASKED=False)
    assert torch.equal(out, torch.full((3,), -1.0))


def test_a_view_may_reach_the_rest_of_its_storage():
    """A view's kernel may read its whole storage (a strided layout does): only the storage's
    ends are checked."""
    base = torch.randn(16)
    out = torch.empty(8)
    _double[(1,)](base[4:7], out, 3, 0, BLOCK=8, MASKED=False)
    assert torch.equal(out, base[4:12] * 2)


def test_an_atomic_past_the_end_is_stopped():
    count = torch.zeros(4, dtype=torch.int32)
    _count[(1,)](count, 3)
    assert count.tolist() == [0, 0, 0, 1]
    with pytest.raises(Exception, match="an atomic past the end of count_ptr: element 4"):
        _count[(1,)](count, 4)


def test_tensors_passed_by_keyword_are_known_by_their_names():
    x, out = torch.randn(3), torch.empty(3)
    with pytest.raises(Exception, match=r"tl\.store past the end of out_ptr: element 3"):
        _double[(1,)](x_ptr=torch.randn(8), out_ptr=out, n=3, shift=0, BLOCK=8, MASKED=False)
    _double[(1,)](x, out_ptr=out, n=3, shift=0, BLOCK=8, MASKED=True)
    assert torch.equal(out, x * 2)
