"""The score matrix's size, naive attention, and the peak-memory measurement."""
import pytest
import torch

from kvlab import profile
from kvlab.workloads.attention_memory import naive_attention, peak_memory, score_matrix_row
from kvlab.kernels.flash_attention import flash_attention
from kvlab.reference import attention_ref


def test_the_32k_score_matrix():
    row = score_matrix_row(32768, bytes_per_element=2, num_heads=32, num_layers=32)
    assert row.elements == 1_073_741_824                    # 1.07e9
    assert row.matrix_bytes == 2_147_483_648                 # 2.1 GB per head per layer in bf16
    assert row.write_read_bytes == 2 * row.matrix_bytes
    assert row.layer_bytes == 32 * row.matrix_bytes
    assert row.model_traffic_bytes == 2 * row.matrix_bytes * 32 * 32


@pytest.mark.parametrize("kwargs,error", [(dict(seq_len=0), ValueError), (dict(seq_len=1.5), TypeError),
                                          (dict(seq_len=8, num_heads=True), TypeError),
                                          (dict(seq_len=8, bytes_per_element=0), ValueError)])
def test_score_matrix_row_refuses_bad_input(kwargs, error):
    with pytest.raises(error):
        score_matrix_row(**kwargs)


@pytest.mark.parametrize("causal,len_q,len_k,heads,kv_heads", [(True, 20, 20, 4, 2), (True, 5, 20, 2, 2),
                                                               (False, 7, 13, 4, 1)])
def test_naive_attention_matches_reference(causal, len_q, len_k, heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, len_q, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, len_k, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, len_k, 16, generator=gen, dtype=torch.float64)
    got = naive_attention(q, k, v, causal=causal)
    for b in range(2):
        want = attention_ref(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), causal=causal,
                             dtype=torch.float64).transpose(0, 1)
        torch.testing.assert_close(got[b], want)


@pytest.mark.parametrize("args,error", [
    ((torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), [0]), TypeError),
    ((torch.zeros(2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)), ValueError),
    ((torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)), ValueError),
    ((torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8)), ValueError),
    ((torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)), ValueError),   # causal, Lq > Lk
])
def test_naive_attention_refuses_bad_input(args, error):
    with pytest.raises(error):
        naive_attention(*args)


def test_peak_memory_of_naive_attention_is_the_score_matrices():
    length, heads = 256, 2
    q, k, v = (torch.randn(1, heads, length, 16) for _ in range(3))
    peak = peak_memory(lambda: naive_attention(q, k, v, causal=False), "cpu")
    scores = heads * length * length * 4
    assert 2 * scores <= peak.bytes <= 2 * scores + 4 * q.numel() * 4, peak
    assert "CPU" in peak.method


def test_peak_memory_counts_only_new_storage_while_it_lives():
    base = torch.zeros(1000)

    def work():
        tmp = torch.ones(4000)            # 16,000 bytes, freed before the next one
        del tmp
        view = base[10:]                  # a view allocates nothing
        view.add_(1)                      # neither does an in-place op
        return torch.ones(2000)           # 8,000 bytes

    assert peak_memory(work, "cpu").bytes == 16_000


@pytest.mark.skipif(profile.PROFILE != "cpu", reason="the kernel's allocations are counted this way on a CPU")
def test_peak_memory_of_the_kernel_is_its_output():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    peak = peak_memory(lambda: flash_attention(q, k, v), "cpu")
    assert peak.bytes == q.numel() * 4


def test_peak_memory_refuses_bad_input():
    with pytest.raises(TypeError):
        peak_memory(42)
    with pytest.raises(ValueError):
        peak_memory(lambda: None, "meta")
