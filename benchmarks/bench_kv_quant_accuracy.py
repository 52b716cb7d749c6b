"""What a quantised KV cache costs in accuracy (CPU or GPU; writes ``kv_quant_accuracy.json``).

    python benchmarks/bench_kv_quant_accuracy.py [--out DIR] [--windows N] [--window-len L]

On the shipped target model, for ``kv_cache_dtype`` "auto", "fp8" and "int8":

* perplexity on held-out code: ``--windows`` windows of ``--window-len`` tokens from the
  validation files of the training corpus (one stdlib file in 50, never trained on), each run
  as one prompt through a paged cache of that format, so every token attends to quantised K/V;
* the logits' relative error against the "auto" cache on the same windows;
* greedy agreement: the share of 256 generated tokens equal to "auto"'s, and the first position
  where they differ, for a few prompts cut from the same files.

"auto" is the model's dtype: float32 in the cpu profile, bfloat16 in the gpu profile.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import arguments, save  # noqa: E402
from kvlab import LLM, SamplingParams, profile  # noqa: E402
from kvlab.models.context import build_attention_context  # noqa: E402
from kvlab.paging.kv_cache import allocate_kv_cache  # noqa: E402
from kvlab.train import encode_corpus, read_corpus, stdlib_root  # noqa: E402

FORMATS = ("auto", "fp8", "int8")


def held_out_windows(tokenizer, count: int, length: int) -> torch.Tensor:
    """``[count, length]`` token ids: consecutive windows of the validation files' tokens."""
    _, val_texts, _ = read_corpus(stdlib_root())
    ids = encode_corpus(tokenizer, val_texts)
    if ids.numel() < count * length:
        raise ValueError(f"the held-out files have {ids.numel()} tokens, fewer than {count} x {length}")
    stride = ids.numel() // count
    return torch.stack([ids[i * stride:i * stride + length] for i in range(count)])


@torch.inference_mode()
def window_logits(model, window: torch.Tensor, kv_cache_dtype: str, block_size: int = 16) -> torch.Tensor:
    """Logits of every position of ``window``, computed as one prompt through a paged cache."""
    length = window.numel()
    num_blocks = -(-length // block_size)
    config = model.config
    cache = allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                              dtype=model.dtype, device=model.device, kv_cache_dtype=kv_cache_dtype)
    backend = "triton" if model.device.type == "cuda" else "torch"
    ctx = build_attention_context(cache, [list(range(num_blocks))], [0], [length], list(range(length)),
                                  backend=backend)
    ids = window.long().to(model.device)
    hidden = model(ids, torch.arange(length, device=model.device), ctx)
    return model.compute_logits(hidden).float()


def main() -> None:
    parser = arguments()
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(max_num_seqs=args.prompts, max_model_len=1024)
    model, tokenizer = llm.model_runner.model, llm.tokenizer
    windows = held_out_windows(tokenizer, args.windows, args.window_len)
    logits = {}
    rows = []
    for fmt in FORMATS:
        nll, total, out = 0.0, 0, []
        for window in windows:
            lg = window_logits(model, window, fmt)
            out.append(lg)
            targets = window[1:].long().to(lg.device)
            nll += torch.nn.functional.cross_entropy(lg[:-1], targets, reduction="sum").item()
            total += targets.numel()
        logits[fmt] = out
        row = {"kv_cache_dtype": fmt, "perplexity": round(float(torch.exp(torch.tensor(nll / total))), 4),
               "tokens": total}
        if fmt != "auto":
            err = [((a - b).norm() / b.norm()).item() for a, b in zip(out, logits["auto"])]
            row["logits_rel_err"] = round(sum(err) / len(err), 5)
        rows.append(row)
        print(row, flush=True)
    auto_ppl = rows[0]["perplexity"]
    for row in rows[1:]:
        row["perplexity_vs_auto"] = round(row["perplexity"] / auto_ppl - 1, 5)
    prompts = [w[:64].tolist() for w in windows[:args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    greedy = {}
    for fmt in FORMATS:
        engine = LLM(kv_cache_dtype=fmt, max_num_seqs=args.prompts, max_model_len=1024)
        greedy[fmt] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        del engine
    for row in rows[1:]:
        pairs = list(zip(greedy["auto"], greedy[row["kv_cache_dtype"]]))
        row["greedy_agreement"] = round(sum(sum(x == y for x, y in zip(a, b)) for a, b in pairs)
                                        / sum(len(a) for a, _ in pairs), 4)
        row["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                   for a, b in pairs]
        print(row, flush=True)
    result = {"profile": profile.PROFILE, "device": str(model.device), "model_dtype": str(model.dtype),
              "windows": args.windows, "window_len": args.window_len, "new_tokens": args.new_tokens,
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    save("kv_quant_accuracy", result, args.out)


if __name__ == "__main__":
    main()
