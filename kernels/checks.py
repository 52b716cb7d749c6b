"""Argument checks of the kernels' launchers: they run before any launch. Here: the shared helpers
and the checks of write_kv and copy_blocks; the attention launchers' (flash_attention,
paged_prefill, paged_decode) are in :mod:`kvlab.kernels.attention_checks`.

A launcher called with its defaults (``validate=True``) refuses a bad argument with a
TypeError or ValueError that names the argument and the rule, and writes nothing. There are
two kinds of rule, and they cost very different amounts:

* **metadata** (types, shapes, strides, dtypes, devices) is known on the host: plain Python,
  nothing read from the GPU;
* **values** (lengths in range, block-table entries that name real blocks, no slot written
  twice) live on the GPU. Reading GPU data on the host waits for the GPU to get there and
  costs a round trip; a PyTorch op per rule costs a launch each. On an H200 each of those
  takes about as long as a small kernel, and the checks once cost 8x the kernel they guarded.

So each launcher's value rules are computed by ONE small Triton *check kernel*: its programs
share the data, and each writes one row of numbers (smallest and largest lengths, smallest
and largest table entries, "found a pair" flags); the host reads all the rows in one
``.tolist()`` and merges them. What the grid needs (the longest sequence, say) comes from the
same read. Only when a rule is broken are more reads made, to name the first offending entry
in the message. (On an H200 machine, a check kernel's launch plus the read cost about as much
host time as three or four small PyTorch ops; the same rules written as PyTorch ops take six
to ten of them, plus the read. ``benchmarks/bench_default_calls.py`` measures what is left.)

A launcher called again on the same, unchanged arguments (a timing loop) is not checked again:
each ``check_*_args`` is :func:`remembered`, by its arguments' identity and PyTorch's count of
their in-place writes. Otherwise the metadata checks alone cost more host time than a small
kernel, and the read makes the host wait for the GPU at every call.
"""
from __future__ import annotations

import functools
import math
import numbers
import weakref

import torch
import triton
import triton.language as tl

from kvlab import profile
from kvlab.quantization import QUANTIZED_DTYPES

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHECK_PROGRAMS = 64                   # at most this many programs per check kernel (the host merges their rows)
SCAN = tl.constexpr(1024)             # entries a check program reads per step of a scan
PAIRS_I = tl.constexpr(64)            # a step of a pairwise search compares PAIRS_I x PAIRS_J entries
PAIRS_J = tl.constexpr(128)
BIG = tl.constexpr(2 ** 62)           # "the min of nothing": larger than any length, index or slot


# -- metadata: host only ------------------------------------------------------------------------
def check_kv_cache_pair(k_cache, v_cache) -> tuple[int, int, int, int]:
    """Check a K/V cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {t.dim()} dims")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {list(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{list(v_cache.shape)} {v_cache.dtype} must match")
    return tuple(k_cache.shape)


def check_same_device(**tensors: torch.Tensor) -> None:
    """All tensors on one device, else a ValueError naming the odd one out."""
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}, {first_name} is on {first.device}")


def _check_tensor(name, t, dims, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {what}, got shape {list(t.shape)}")


def _check_supported_dtype(name, t):
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if t.dtype == torch.bfloat16 and profile.INTERPRETED:
        raise TypeError(f"{name} is bfloat16, which Triton's CPU interpreter cannot compute with: "
                        "use float32 or float16 there")


def _check_dtypes(**tensors):
    (first_name, first), *rest = tensors.items()
    _check_supported_dtype(first_name, first)
    for name, t in rest:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, {first_name} has {first.dtype}: they must match")


def _check_heads(num_heads, num_kv_heads, q_name, kv_name):
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{q_name} has {num_heads} heads, which is not a multiple of {kv_name}'s "
                         f"{num_kv_heads} (each KV head serves an equal group of query heads)")


def _check_head_dim(head_dim, kv_head_dim, kv_name):
    if head_dim != kv_head_dim:
        raise ValueError(f"q has head_dim {head_dim}, {kv_name} has {kv_head_dim}: they must match")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two from 16 to 256 (whole rows are loaded "
                         f"without a mask, and tl.dot needs 16 at least), got {head_dim}")


def _check_rows_contiguous(**tensors):
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {list(t.stride())}")


def _check_sm_scale(sm_scale):
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be finite and positive, got {sm_scale}")


def _check_out(out, q):
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q ({list(q.shape)}, {q.dtype}, {q.device}), got "
                         f"{list(out.shape)}, {out.dtype}, {out.device}")
    _check_rows_contiguous(out=out)


def check_out_tensor(out, shape: list[int], x: torch.Tensor) -> None:
    """An ``out`` argument: None, or a tensor of ``shape`` with ``x``'s dtype and device and
    contiguous rows."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != x.dtype:
        raise TypeError(f"out has dtype {out.dtype}, x has {x.dtype}")
    if list(out.shape) != list(shape):
        raise ValueError(f"out must have shape {list(shape)}, got {list(out.shape)}")
    if out.numel() and out.stride(-1) != 1:
        raise ValueError(f"out must have contiguous rows (last stride 1), got strides {list(out.stride())}")
    check_same_device(x=x, out=out)


def _check_int32_vector(name, t, length, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor of {what}, got shape {list(t.shape)}")


def check_length_hint(name: str, hint: int | None, longest: int) -> None:
    """A caller's hint of the longest length (it spares a read) must not be shorter than the truth."""
    if hint is not None and hint < longest:
        raise ValueError(f"{name} = {hint} is shorter than the longest length it stands for, {longest}: "
                         "the rows or tokens past it would never be computed")


def grid_length(lengths: torch.Tensor, hint: int | None, name: str, check: bool) -> int:
    """The longest of ``lengths``, which sizes a launch's grid.

    ``hint`` (the caller knows it) spares the read back to the host; with ``check`` it is still
    read and compared: a hint that is too short would leave work undone, silently.
    """
    if hint is not None and not check:
        return hint
    longest = int(lengths.max()) if lengths.numel() else 0
    check_length_hint(name, hint, longest)
    return longest if hint is None else hint


# -- checks passed, remembered ---------------------------------------------------------------------
MEMO_SIZE = 64
_PASSED: dict = {}        # key of a call whose checks passed -> (weak references to its tensors, result)


def remembered(check):
    """Wrap a launcher's ``check`` so that a call with the same arguments as one that passed
    returns that call's result at once: no metadata checks, no check kernel, no read.

    "The same" means the same tensor objects (held by weak references, so a new tensor at a
    reused address never matches) at the same *version*: PyTorch counts every in-place write to
    a tensor or to a view of it (``t[i] = x``, ``copy_``, ``out=``, ``transpose_``), so a
    changed argument is checked again; plain arguments must be equal. A call that fails is
    never remembered. Not remembered: calls with tensors that keep no version (made under
    ``torch.inference_mode``). Not noticed: a write PyTorch does not see (by a kernel of one's
    own, or through ``.data`` or NumPy's view of a CPU tensor); after one, :func:`forget_checks`.
    """
    @functools.wraps(check)
    def checked(*args, **kwargs):
        tensors = []
        key = _key(check, args, kwargs, tensors)
        if key is not None:
            try:
                hit = _PASSED.get(key)
            except TypeError:                 # an unhashable argument: this call is not remembered
                hit = key = None
            if hit is not None and all(ref() is t for ref, t in zip(hit[0], tensors)):
                return hit[1]
        result = check(*args, **kwargs)
        if key is not None:
            if len(_PASSED) >= MEMO_SIZE:
                del _PASSED[next(iter(_PASSED))]      # the oldest
            _PASSED[key] = (tuple(weakref.ref(t) for t in tensors), result)
        return result

    return checked


def _key(check, args, kwargs, tensors: list):
    """An image of a call to look up (None: not to be remembered), hashable unless an argument is
    not; the call's tensors go to ``tensors``. A tensor is (id, version, address): every in-place
    change of its shape or strides bumps the version too, and the address catches ``.data = other``."""
    try:
        return (check, tuple(kwargs), *_parts((*args, *kwargs.values()), tensors))
    except RuntimeError:                 # an inference tensor keeps no version
        return None


def _parts(values, tensors: list) -> list:
    """The key's parts for ``values``: each tensor's (id, version, address), lists and tuples
    recursed into, anything else as it is."""
    parts = []
    for a in values:
        if a is None:                      # most optional arguments: the cheapest test first
            parts.append(a)
        elif isinstance(a, torch.Tensor):
            tensors.append(a)
            parts.append((id(a), a._version, a.data_ptr()))
        elif isinstance(a, (list, tuple)):
            parts.append(tuple(_parts(a, tensors)))
        else:
            parts.append(a)
    return parts


def forget_checks() -> None:
    """Forget every call that passed: each launcher checks its next call in full."""
    _PASSED.clear()


# -- values: one check kernel, one read ----------------------------------------------------------
def read_check(kernel, reduce, programs: int, *args, **constexprs) -> list[int]:
    """Launch a check kernel with ``programs`` programs and read its results back: the call's one
    device->host read.

    Program ``p`` writes row ``p`` of a ``[programs, len(reduce)]`` int64 tensor, one number per
    statistic over its share of the data; ``reduce[i]`` (``min``, ``max`` or ``sum``) merges
    column ``i`` on the host. The first of ``args`` is a tensor on the device the kernel runs on.
    """
    stats = torch.empty(programs, len(reduce), dtype=torch.int64, device=args[0].device)
    kernel[(programs,)](stats, *args, **constexprs)
    rows = stats.tolist()                 # waits for the GPU: the one read
    if programs == 1:
        return rows[0]
    return [op(column) for op, column in zip(reduce, zip(*rows))]


def _programs(items: int, per_program: int) -> int:
    """Programs for ``items`` entries, ``per_program`` at a step: enough to spread them, at most CHECK_PROGRAMS."""
    return max(1, min(CHECK_PROGRAMS, -(-items // per_program)))


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True of ``mask`` (row-major): only ever read to word an error."""
    return tuple(mask.nonzero()[0].tolist())


@triton.jit
def _min_max(ptr, n, pid, programs):
    """Smallest and largest of ``ptr[0 .. n - 1]`` in this program's share of the blocks
    (blocks ``pid``, ``pid + programs``, ...); ``BIG`` and ``-BIG`` if the share is empty."""
    lo = tl.full([SCAN], BIG, tl.int64)
    hi = tl.full([SCAN], -BIG, tl.int64)
    for start in range(pid * SCAN, n, programs * SCAN):
        offs = start + tl.arange(0, SCAN)
        inside = offs < n
        x = tl.load(ptr + offs, mask=inside, other=0).to(tl.int64)
        lo = tl.minimum(lo, tl.where(inside, x, BIG))
        hi = tl.maximum(hi, tl.where(inside, x, -BIG))
    return tl.min(lo, axis=0), tl.max(hi, axis=0)


@triton.jit
def _any_equal_pair(a_ptr, b_ptr, n, stride, pid, programs, LATER_ONLY: tl.constexpr):
    """1 if some ``a[i] >= 0`` equals some ``b[j]`` (with ``j > i`` if ``LATER_ONLY``), for the
    rows ``i`` of this program's share, else 0. Entry ``k`` of a or b is at ``ptr + k * stride``.

    A pairwise search, ``n * n`` comparisons in tiles of ``PAIRS_I x PAIRS_J``: no sort, no
    scratch memory, and a few microseconds for the few thousand entries of a step."""
    found = tl.zeros([PAIRS_I], tl.int32)
    for i0 in range(pid * PAIRS_I, n, programs * PAIRS_I):
        i = i0 + tl.arange(0, PAIRS_I)
        a = tl.load(a_ptr + i * stride, mask=i < n, other=-1).to(tl.int64)     # -1: never counted
        if LATER_ONLY:
            j_start = i0                    # pairs (i, j > i): each unordered pair once
        else:
            j_start = 0
        for j0 in range(j_start, n, PAIRS_J):
            j = j0 + tl.arange(0, PAIRS_J)
            b = tl.load(b_ptr + j * stride, mask=j < n, other=-2).to(tl.int64)  # -2: matches no a >= 0
            hit = (a[:, None] == b[None, :]) & (a[:, None] >= 0)
            if LATER_ONLY:
                hit = hit & (j[None, :] > i[:, None])
            found = tl.maximum(found, tl.max(hit.to(tl.int32), axis=1))
    return tl.max(found, axis=0).to(tl.int64)


# -- write_kv ---------------------------------------------------------------------------------------
@triton.jit
def write_kv_check_kernel(stats_ptr, slot_mapping_ptr, num_tokens):
    """Row ``pid`` of ``stats``: min and max of slot_mapping, and 1 if two tokens name one slot."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lo, hi = _min_max(slot_mapping_ptr, num_tokens, pid, programs)
    twice = _any_equal_pair(slot_mapping_ptr, slot_mapping_ptr, num_tokens, 1, pid, programs, True)
    row = stats_ptr + pid * 3
    tl.store(row + 0, lo)
    tl.store(row + 1, hi)
    tl.store(row + 2, twice)


def check_kv_scales(k_cache, v_cache, k_scale, v_scale) -> bool:
    """A quantised cache (float8_e4m3fn or int8) comes with its scales, float32
    ``[num_blocks, block_size, num_kv_heads]`` in any layout the two share (the kernels follow the
    strides; the engine keeps a page's scales of one head together); any other cache without.
    True if quantised."""
    quantized = k_cache.dtype in QUANTIZED_DTYPES
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are given but the cache is {k_cache.dtype}, not quantised "
                             "(float8_e4m3fn or int8)")
        return False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"the cache is {k_cache.dtype}, quantised: {name} (its scales) must be given "
                             "(write_kv_quantized writes such a cache)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.shape != k_cache.shape[:3]:
            raise ValueError(f"{name} must be a [num_blocks, block_size, num_kv_heads] = "
                             f"{list(k_cache.shape[:3])} tensor, got {list(t.shape)}")
    check_same_device(k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale)
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"k_scale and v_scale must share one layout: strides {k_scale.stride()} and "
                         f"{v_scale.stride()}")
    return True


@remembered
def check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Raise TypeError/ValueError naming the first argument of write_kv (or write_kv_quantized,
    with the scales) that breaks a rule."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache_pair(k_cache, v_cache)
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    for name, (k, v) in (("cache", (k_cache, v_cache)), ("scale", (k_scale, v_scale))):
        if k is not None and k.data_ptr() == v.data_ptr():
            raise ValueError(f"k_{name} and v_{name} must be two tensors: one would overwrite the other")
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}] to match the "
                             f"cache, got {list(t.shape)}")
        if quantized and t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if not quantized and t.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, the cache has {k_cache.dtype}")
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be contiguous within a token (strides [*, {head_dim}, 1]), "
                             f"got strides {list(t.stride())}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, value has {value.shape[0]}")
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape [{key.shape[0]}] (one slot per token), "
                         f"got {list(slot_mapping.shape)}")
    if slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous (the kernel reads slot t at t), "
                         f"got stride {slot_mapping.stride(0)}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    lo, hi, twice = read_check(write_kv_check_kernel, (min, max, max), _programs(num_tokens, PAIRS_I.value),
                               slot_mapping, num_tokens)
    num_slots = num_blocks * block_size
    if lo < -1 or hi >= num_slots:
        (i,) = _first((slot_mapping < -1) | (slot_mapping >= num_slots))
        raise ValueError(f"slot_mapping[{i}] = {int(slot_mapping[i])} is out of range: slots are -1 "
                         f"(padding) or 0..{num_slots - 1}")
    if twice:
        raise ValueError("slot_mapping names a slot twice: two tokens would race for one slot")


# -- copy_blocks ------------------------------------------------------------------------------------
@triton.jit
def copy_blocks_check_kernel(stats_ptr, pairs_ptr, num_pairs):
    """Row ``pid`` of ``stats``: min and max of every block id, 1 if two pairs share a dst, and
    1 if a dst is also some pair's src. ``pairs`` is ``[num_pairs, 2]``: (src, dst) rows."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lo, hi = _min_max(pairs_ptr, 2 * num_pairs, pid, programs)
    dst_twice = _any_equal_pair(pairs_ptr + 1, pairs_ptr + 1, num_pairs, 2, pid, programs, True)
    dst_is_src = _any_equal_pair(pairs_ptr + 1, pairs_ptr, num_pairs, 2, pid, programs, False)
    row = stats_ptr + pid * 4
    tl.store(row + 0, lo)
    tl.store(row + 1, hi)
    tl.store(row + 2, dst_twice)
    tl.store(row + 3, dst_is_src)


@remembered
def check_copy_blocks_args(caches, block_mapping) -> None:
    """Raise TypeError/ValueError naming the first argument of copy_blocks that breaks a rule."""
    if not isinstance(caches, (list, tuple)) or not caches:
        raise TypeError("caches must be a non-empty list of cache tensors")
    for i, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"caches[{i}] must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dim() not in (4, 5) or not cache.is_contiguous():
            raise ValueError(f"caches[{i}] must be a contiguous [num_layers,] num_blocks, block_size, "
                             f"num_kv_heads, head_dim tensor, got shape {list(cache.shape)}")
        if cache.shape[-4] != caches[0].shape[-4]:
            raise ValueError(f"caches[{i}] has {cache.shape[-4]} blocks, caches[0] has {caches[0].shape[-4]}")
    if not isinstance(block_mapping, torch.Tensor):
        raise TypeError(f"block_mapping must be a torch.Tensor, got {type(block_mapping).__name__}")
    if block_mapping.dtype != torch.int64:
        raise TypeError(f"block_mapping must be int64, got {block_mapping.dtype}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2 or not block_mapping.is_contiguous():
        raise ValueError(f"block_mapping must be a contiguous [num_pairs, 2] tensor of (src, dst), "
                         f"got shape {list(block_mapping.shape)}")
    check_same_device(block_mapping=block_mapping, **{f"caches[{i}]": c for i, c in enumerate(caches)})
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    lo, hi, dst_twice, dst_is_src = read_check(copy_blocks_check_kernel, (min, max, max, max),
                                               _programs(num_pairs, PAIRS_I.value), block_mapping, num_pairs)
    num_blocks = caches[0].shape[-4]
    if lo < 0 or hi >= num_blocks:
        row, col = _first((block_mapping < 0) | (block_mapping >= num_blocks))
        raise ValueError(f"block_mapping[{row}, {col}] = {int(block_mapping[row, col])} is out of range "
                         f"0..{num_blocks - 1}")
    if dst_twice:
        raise ValueError("block_mapping copies into one dst block twice")
    if dst_is_src:
        raise ValueError("block_mapping uses a block as both a src and a dst: the copies would race")


# -- the attention launchers' checks, still importable from here ------------------------------------
_MOVED_TO_ATTENTION_CHECKS = ("check_flash_attention_args", "check_paged_prefill_args", "check_paged_decode_args",
                              "flash_varlen_check_kernel", "paged_prefill_check_kernel", "paged_decode_check_kernel")


def __getattr__(name):
    """``from kvlab.kernels.checks import check_paged_decode_args`` (and the like) keeps working:
    those names live in attention_checks, which imports this module (so: looked up lazily)."""
    if name in _MOVED_TO_ATTENTION_CHECKS:
        from kvlab.kernels import attention_checks
        return getattr(attention_checks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
