"""The launchers' remembered checks (kvlab.kernels.checks.remembered): a call again on the same,
unchanged tensors skips the checks, their kernel and its read; any change PyTorch sees is
checked again, and a bad value is still refused."""
import pytest
import torch

from kvlab import profile
from kvlab.kernels import attention_checks, checks, copy_blocks, paged_decode, write_kv
from kvlab.reference import paged_attention_ref
from helpers import scattered_tables

DEVICE = profile.DEVICE


class Counting:
    """Stands in for a check kernel: counts its launches, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def decode_checks(monkeypatch):
    checks.forget_checks()
    counting = Counting(attention_checks.paged_decode_check_kernel)
    monkeypatch.setattr(attention_checks, "paged_decode_check_kernel", counting)
    yield counting
    checks.forget_checks()


def decode_args(lens=(5, 40), block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, 2, 32, generator=gen).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, 2, 32, generator=gen).to(DEVICE)
    _, tables = scattered_tables(list(lens), block_size, 3, gen)
    q = torch.randn(len(lens), 4, 32, generator=gen).to(DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def test_a_repeated_call_checks_once_and_still_computes(decode_checks):
    q, k_cache, v_cache, tables, seq_lens = decode_args()
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens.tolist(), dtype=torch.float64)
    for _ in range(3):
        out = paged_decode(q, k_cache, v_cache, tables, seq_lens)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert decode_checks.launches == 1


@pytest.mark.parametrize("write", ["seq_lens", "block_tables", "block_tables view"])
def test_an_in_place_write_is_checked_again(decode_checks, write):
    q, k_cache, v_cache, tables, seq_lens = decode_args()
    paged_decode(q, k_cache, v_cache, tables, seq_lens)
    num_blocks = k_cache.shape[0]
    if write == "seq_lens":
        seq_lens[0] = 10_000
        match = r"seq_lens\[0\] = 10000"
    elif write == "block_tables":
        tables[1, 0] = num_blocks
        match = rf"block_tables\[1, 0\] = {num_blocks}"
    else:                                   # through a view: the base's version moves too
        tables[1].fill_(-3)
        match = r"block_tables\[1, 0\] = -3"
    with pytest.raises(ValueError, match=match):
        paged_decode(q, k_cache, v_cache, tables, seq_lens)
    assert decode_checks.launches == 2


def test_other_arguments_are_checked_afresh(decode_checks):
    """A smaller cache (a new tensor) and a new hint are a new call."""
    q, k_cache, v_cache, tables, seq_lens = decode_args()
    paged_decode(q, k_cache, v_cache, tables, seq_lens)
    highest = int(tables.max())
    with pytest.raises(ValueError, match="out of range"):
        paged_decode(q, k_cache[:highest], v_cache[:highest], tables, seq_lens)
    with pytest.raises(ValueError, match="max_seq_len = 3 is shorter"):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, max_seq_len=3)
    with pytest.raises(ValueError, match="max_seq_len = 3 is shorter"):   # a failed call is never remembered
        paged_decode(q, k_cache, v_cache, tables, seq_lens, max_seq_len=3)
    assert decode_checks.launches == 4


def test_new_tensors_are_checked_even_with_the_same_values(decode_checks):
    q, k_cache, v_cache, tables, seq_lens = decode_args()
    paged_decode(q, k_cache, v_cache, tables, seq_lens)
    paged_decode(q, k_cache, v_cache, tables.clone(), seq_lens.clone())
    del tables, seq_lens                    # a tensor made later at a reused address is a new one
    _, _, _, tables, seq_lens = decode_args()
    paged_decode(q, k_cache, v_cache, tables, seq_lens)
    assert decode_checks.launches == 3


def test_forget_checks_and_inference_tensors_check_every_call(decode_checks):
    q, k_cache, v_cache, tables, seq_lens = decode_args()
    paged_decode(q, k_cache, v_cache, tables, seq_lens)
    checks.forget_checks()
    paged_decode(q, k_cache, v_cache, tables, seq_lens)
    assert decode_checks.launches == 2
    with torch.inference_mode():            # inference tensors keep no version: never remembered
        q, k_cache, v_cache, tables, seq_lens = decode_args()
        paged_decode(q, k_cache, v_cache, tables, seq_lens)
        paged_decode(q, k_cache, v_cache, tables, seq_lens)
        tables[0, 0] = -1
        with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = -1"):
            paged_decode(q, k_cache, v_cache, tables, seq_lens)
    assert decode_checks.launches == 5


def test_lists_and_unhashable_arguments():
    """Tensors inside a list are keyed like the others; a list holding an inference tensor, or an
    argument that cannot be hashed, makes the call one that is checked every time."""
    calls = []
    check = checks.remembered(lambda *args, **kwargs: calls.append(1) or len(calls))
    a, b = torch.zeros(3), torch.zeros(3)
    assert check([a, b], 1) == check([a, b], 1) == 1
    b.add_(1)                                   # a list's tensor changed: checked again
    assert check([a, b], 1) == 2
    with torch.inference_mode():
        c = torch.zeros(3)
    assert (check([a, c], 1), check([a, c], 1)) == (3, 4)
    assert (check(a, {"not": "hashable"}), check(a, {"not": "hashable"})) == (5, 6)
    checks.forget_checks()


def test_write_kv_and_copy_blocks_check_a_changed_mapping_again():
    checks.forget_checks()
    k_cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 5, 9], dtype=torch.int64, device=DEVICE)
    write_kv(key, value, k_cache, v_cache, slots)
    slots[2] = 5                            # two tokens, one slot
    before = k_cache.clone()
    with pytest.raises(ValueError, match="names a slot twice"):
        write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before)
    pairs = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64, device=DEVICE)
    copy_blocks([k_cache, v_cache], pairs)
    pairs[1, 1] = 1                         # two copies into block 1
    with pytest.raises(ValueError, match="into one dst block twice"):
        copy_blocks([k_cache, v_cache], pairs)
    checks.forget_checks()


def test_a_prefill_call_again_reuses_its_running_sum(monkeypatch):
    """paged_prefill without cu_query_lens: the check kernel writes the running sum the first
    time; a call again on the same tensors reuses it, and the output is the same."""
    from kvlab.kernels import paged_prefill
    checks.forget_checks()
    counting = Counting(attention_checks.paged_prefill_check_kernel)
    monkeypatch.setattr(attention_checks, "paged_prefill_check_kernel", counting)
    _, k_cache, v_cache, tables, seq_lens = decode_args(lens=(20, 35))
    query_lens = torch.tensor([4, 9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(13, 4, 32, device=DEVICE)
    first = paged_prefill(q, k_cache, v_cache, tables, seq_lens, query_lens)
    second = paged_prefill(q, k_cache, v_cache, tables, seq_lens, query_lens)
    assert torch.equal(first, second) and counting.launches == 1
    query_lens[1] = 36                      # more new tokens than the sequence holds
    with pytest.raises(ValueError, match=r"query_lens sum to 40|query_lens\[1\] = 36"):
        paged_prefill(q, k_cache, v_cache, tables, seq_lens, query_lens)
    checks.forget_checks()
