"""The profile switch, and the interpreter it sets up on a machine without a GPU."""
import pytest
import torch

from kvlab import profile


def test_pick_and_resolve():
    assert profile.pick(cpu=1, gpu=2) == (2 if profile.PROFILE == "gpu" else 1)
    assert profile.resolve("cpu") == "cpu"
    with pytest.raises(ValueError, match="profile must be one of"):
        profile.resolve("tpu")


@pytest.mark.skipif(not profile.INTERPRETED, reason="only the interpreter runs kernels this way")
def test_a_computed_loop_bound_runs_in_the_interpreter():
    """range() over a bound computed from program_id: what every causal kernel does. Triton 3.6's
    interpreter needs kvlab's squeeze for it under NumPy >= 2.4."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def count_up_to(out_ptr, limit, STEP: tl.constexpr):
        end = tl.minimum((tl.program_id(0) + 1) * STEP, limit)
        total = 0
        for start in range(0, end, STEP):
            total += start
        tl.store(out_ptr + tl.program_id(0), total)

    assert getattr(interpreter._patch_lang_tensor, "squeezes_scalars", False)
    out = torch.full((3,), -1, dtype=torch.int32)
    count_up_to[(3,)](out, 40, STEP=16)
    assert out.tolist() == [0, 0 + 16, 0 + 16 + 32]
