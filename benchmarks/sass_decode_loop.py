"""How many instructions does paged_decode's loop take, per warp and tile? (no GPU needed)

    python benchmarks/sass_decode_loop.py [--kv-cache-dtype fp8|int8|bf16] [--block-n N]
                                          [--num-warps N] [--num-stages N] [--maxnreg N] [--ops 12]
                                          [--scale-layout engine|contiguous]

Compiles the launcher's decode kernel for the format (``decode_split_kernel`` for bf16,
``decode_streams_kernel`` for fp8 and int8, one stream of keys a warp) for an H200 (sm_90) with
the Triton installed here (its wheel carries ``ptxas`` and ``nvdisasm``), at the benchmarks'
shape (32 query / 8 KV heads, head_dim 128, pages of 16; a quantised cache's scales laid out as
the engine keeps them, per page and KV head, or contiguous per slot), and counts the machine instructions
(SASS) of its loop over tiles: what one warp executes per tile of keys, by opcode, per key over
all of a program's warps (to compare launches), and how many programs an SM can hold with the
registers and shared memory the kernel takes (what hides a loop's latency is warps in flight).
The counts in ``benchmarks/RESULTS.md`` (from 2026-12-02's fourth session on) came from Triton
3.6, the GPU machine's version, which needs nothing else:

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python benchmarks/sass_decode_loop.py --kv-cache-dtype fp8

The kernel's source is read from ``kernels/`` rather than imported: importing kvlab on a
machine without a GPU switches Triton to its CPU interpreter, and needs torch.
"""
from __future__ import annotations

import argparse
import ast
import collections
import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
CODES = {"fp8": "fp8e4nv", "int8": "i8", "bf16": "bf16"}


def jit_functions(workdir: Path, *files: str):
    """A module of the ``@triton.jit`` functions of ``files`` (in ``kernels/``) and the
    ``tl.constexpr`` constants they read, their source copied into ``workdir`` (Triton reads a
    kernel's source from its file)."""
    text = ["import triton", "import triton.language as tl", ""]
    for name in files:
        if not (KERNELS / name).exists():    # an older checkout
            continue
        lines = (KERNELS / name).read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body:
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                start = min(d.lineno for d in node.decorator_list)
                text += lines[start - 1:node.end_lineno] + ["", ""]
            elif isinstance(node, ast.Assign) and "tl.constexpr(" in ast.unparse(node.value):
                text += lines[node.lineno - 1:node.end_lineno] + [""]
    path = workdir / "decode_kernels.py"
    path.write_text("\n".join(text))
    spec = importlib.util.spec_from_file_location("decode_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The scales' strides (block, slot, KV head) at 8 KV heads and pages of 16, as the launcher passes
# them: the engine's layout keeps a page's scales of one head together, a contiguous tensor a slot's.
SCALE_STRIDES = {"engine": (8 * 16, 1, 16), "contiguous": (16 * 8, 8, 1)}


def compile_decode(workdir: Path, fmt: str, block_n: int, num_warps: int, num_stages: int,
                   maxnreg: int | None = None, scale_layout: str = "engine"):
    """The launcher's kernel for ``fmt``: ``decode_split_kernel`` (bf16) or ``decode_streams_kernel``
    (fp8, int8: one stream a warp)."""
    kernels = jit_functions(workdir, "dequant.py", "paged_decode.py")
    quant = fmt != "bf16"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": "*" + CODES[fmt], "v_cache_ptr": "*" + CODES[fmt]}
    strides = {}
    if quant:
        sig.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        # Triton specialises an int argument equal to 1 into a constant, and tells the compiler
        # which are multiples of 16: so the two layouts compile to different address arithmetic
        strides = dict(zip(("scale_block_stride", "scale_slot_stride", "scale_head_stride"),
                           SCALE_STRIDES[scale_layout]))
        sig.update({name: "constexpr" if value == 1 else "i32" for name, value in strides.items()})
    sig.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*fp32", lse_ptr="*fp32", sm_scale="fp32",
               stride_qt="i32", stride_qh="i32", stride_table="i32", num_kv_heads="i32", num_splits="i32")
    # the launcher pads the GQA group to the MMA tile's narrowest side: 8 columns (streams), 16 rows
    constexprs = dict(GROUP=4, GROUP_PAD=8 if quant else 16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=block_n,
                      WRITE_FINAL=False, DOT_PRECISION="tf32")
    if quant:
        kernel = kernels.decode_streams_kernel
        constexprs.update(QUANT_DOT=tl.float16, CODES_PTX={"fp8": "e4m3", "int8": "int8"}[fmt], STREAMS=num_warps)
    else:
        kernel = kernels.decode_split_kernel
    sig.update({name: "constexpr" for name in constexprs})
    constexprs.update({name: 1 for name, value in strides.items() if value == 1})
    # What the launcher's specialisation tells the compiler: pointers and strides are multiples of 16.
    names = list(sig)
    aligned = [n for n in names if sig[n].startswith("*")] + ["stride_qt", "stride_qh", "stride_table"] \
        + [n for n, value in strides.items() if value != 1 and value % 16 == 0]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))


def loop_opcodes(cubin: bytes, workdir: Path) -> tuple[list[str], str]:
    """The opcodes of the longest loop (the span of its backward branch) in ``cubin``, and the
    tool's report of registers."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    path = workdir / "decode.cubin"
    path.write_bytes(cubin)
    listing = subprocess.run([tools / "nvdisasm", "-c", path], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tools / "cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
    labels, pending, code = {}, [], []
    for line in listing.splitlines():
        if m := re.match(r"^\s*\.(L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            address = int(m.group(1), 16)
            labels.update({label: address for label in pending})
            pending = []
            code.append((address, m.group(2)))
    loops = [(labels[m.group(1)], address) for address, text in code
             if (m := re.search(r"BRA\b.*?\.(L_x_\d+)", text)) and labels.get(m.group(1), address + 1) < address]
    if not loops:
        raise SystemExit("no loop found in the compiled kernel")
    start, end = max(loops, key=lambda span: span[1] - span[0])
    ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for address, text in code
           if start <= address <= end]
    registers = re.search(r"REG:(\d+)", usage)
    return ops, registers.group(1) if registers else "?"


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> tuple[int, int]:
    """How many programs of this kernel one H200 SM (sm_90) holds: (by registers, by shared memory).

    An SM has 65,536 registers, given out to each warp in blocks of 256, and 228 KB of shared
    memory, 1 KB of it reserved per program; it holds at most 64 warps and 32 programs."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (per_warp * num_warps)
    by_shared = 228 * 1024 // (shared_bytes + 1024)
    cap = min(32, 64 // num_warps)
    return min(by_registers, cap), min(by_shared, cap)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", choices=list(CODES), default="fp8")
    parser.add_argument("--block-n", type=int, default=None, help="default: the launcher's (64 quantised, 128 bf16)")
    parser.add_argument("--num-warps", type=int, default=None,
                        help="default: the launcher's (2 quantised, one a stream; 8 bf16)")
    parser.add_argument("--num-stages", type=int, default=None, help="default: the launcher's (3 quantised, 2 bf16)")
    parser.add_argument("--maxnreg", type=int, default=None, help="cap the registers a thread (ptxas spills the rest)")
    parser.add_argument("--ops", type=int, default=12, help="how many opcodes to list")
    parser.add_argument("--scale-layout", choices=list(SCALE_STRIDES), default="engine",
                        help="a quantised cache's scales: per page and KV head (the engine's) or per slot")
    args = parser.parse_args()
    warps = args.num_warps or (8 if args.kv_cache_dtype == "bf16" else 2)
    block_n = args.block_n or (128 if args.kv_cache_dtype == "bf16" else 32 * warps)
    stages = args.num_stages or (2 if args.kv_cache_dtype == "bf16" else 3)
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_decode(Path(tmp), args.kv_cache_dtype, block_n, warps, stages, args.maxnreg,
                                  args.scale_layout)
        ops, registers = loop_opcodes(compiled.asm["cubin"], Path(tmp))
    counts = collections.Counter(ops)
    shared = compiled.metadata.shared
    by_registers, by_shared = programs_per_sm(int(registers), shared, warps)
    programs = min(by_registers, by_shared)
    layout = f", {args.scale_layout} scales" if args.kv_cache_dtype != "bf16" else ""
    print(f"Triton {triton.__version__}, sm_90: {compiled.name}, {args.kv_cache_dtype}, block_n {block_n}, "
          f"{warps} warps, {stages} stages{layout}" + (f", maxnreg {args.maxnreg}" if args.maxnreg else ""))
    print(f"loop: {len(ops)} instructions per warp and tile ({len(ops) * warps / block_n:.1f} per key, all "
          f"warps); {registers} registers a thread, {shared} bytes of shared memory")
    print(f"an SM holds {programs} programs ({by_registers} by registers, {by_shared} by shared memory): "
          f"{programs * warps} warps, when the grid has that many programs")
    if counts["STL"] or counts["LDL"]:
        print(f"spilled: {counts['STL']} stores and {counts['LDL']} loads of local memory per tile")
    print("  ".join(f"{op} {n}" for op, n in counts.most_common(args.ops)))


if __name__ == "__main__":
    main()
