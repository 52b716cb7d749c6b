"""Train the course's own tiny models: a *target* and a *draft* decoder sharing one tokenizer.

No model can be downloaded where the course runs, so it ships two small Llama-style models
trained here, from a corpus every Python installation already holds::

    python -m kvlab.train --out models/ --device cuda          # both models, ~1.5 min on an H200
    python -m kvlab.train --out /tmp/smoke --smoke              # CPU, seconds: tests the pipeline

What it does, reproducibly (fixed seed, fixed file order, fixed step counts):

1. **Corpus**: every ``.py`` file of the Python standard library of the interpreter that runs
   the script (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded), read as UTF-8,
   in sorted path order. One file in 50 is held out for validation. The corpus is (c) Python
   Software Foundation and distributed under the PSF License Agreement (Python Software
   Foundation License Version 2), which allows redistribution of derived works provided the
   PSF copyright notice is retained; the script copies the installation's ``LICENSE.txt`` next
   to the models and names the corpus (Python version, file count, a SHA-256 of its content)
   in a model card. Installations differ: a full CPython install carries its test suite
   (about 31 MB of source, 8.5M tokens), a Debian/Ubuntu one leaves most of it out (10 MB, 2.6M
   tokens), so the models depend on the Python that trains them; the log records which.
   ``--corpus DIR`` trains on another folder of ``.py`` files.
2. **Tokenizer**: a byte-level BPE (``tokenizers``), 8192 entries, token 0 ``<|endoftext|>``
   (separates files; it is both BOS and EOS). Reused from ``OUT/tokenizer.json`` when present.
3. **Models** (tied embeddings, bf16 on disk): the *target* (8 layers, hidden 384, 8 query
   heads of 64 over 2 KV heads, MLP 1024: 16.5M parameters, 33 MB) and the *draft* (4 layers,
   hidden 128, 2 query heads of 64 over 1 KV head, MLP 384: 1.8M parameters, 3.7 MB), each
   trained on random 1024-token windows with AdamW, warm-up and cosine decay, under bf16
   autocast and ``torch.compile`` on a GPU. Positions up to 2048 are accepted, but the models
   never saw a window longer than 1024 tokens. The corpus is small for these models: the
   step counts stop near the lowest validation loss measured on the 2.6M-token corpus
   (target 1300 steps of 16 windows, draft 1000 steps of 64); training much longer makes
   them recite the standard library and lose on unseen code.
4. **Outputs**: ``OUT/kvlab-tiny-target/`` and ``OUT/kvlab-tiny-draft/`` as HF-format checkpoints
   (:func:`kvlab.models.save_model`; ``kvlab.models.load_model`` and ``transformers`` both
   read them), ``OUT/train_log.json`` (settings, corpus, loss curves, validation loss,
   draft/target agreement, sample completions), ``OUT/README.md`` (the model card).

Same seed and corpus give the same data order and initial weights; GPU kernels may still
differ in the last bits between runs (atomic reductions), so losses agree closely, not
bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kvlab.models.config import ModelConfig
from kvlab.models.llama import LlamaForCausalLM
from kvlab.models.loader import save_model

EOT = "<|endoftext|>"
PROMPTS = ["def __init__(self", "import os\n", "for i in range(", "class Queue:\n    def ", "    return "]


VOCAB_SIZE, SMOKE_VOCAB_SIZE = 8192, 400


def tiny_llama(hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
               head_dim: int = 64, max_position_embeddings: int = 2048, vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    """The course's model family: Llama, tied embeddings, token 0 (``<|endoftext|>``) as BOS and EOS, bf16."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, torch_dtype="bfloat16")


@dataclass
class Recipe:
    """One model's shape (a :class:`ModelConfig`) and training schedule."""

    model: ModelConfig
    steps: int
    batch_size: int          # sequences per step
    seq_len: int             # tokens per sequence
    lr: float
    warmup: int
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1

    def model_config(self, vocab_size: int, eot_id: int) -> ModelConfig:
        """The model to train, for the trained tokenizer's vocabulary and end-of-text token."""
        return replace(self.model, vocab_size=vocab_size, bos_token_id=eot_id, eos_token_id=eot_id)


RECIPES = {
    "target": Recipe(tiny_llama(hidden_size=384, intermediate_size=1024, num_layers=8, num_heads=8, num_kv_heads=2),
                     steps=1300, batch_size=16, seq_len=1024, lr=2e-3, warmup=100),
    "draft": Recipe(tiny_llama(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=2, num_kv_heads=1),
                    steps=1000, batch_size=64, seq_len=1024, lr=3e-3, warmup=100),
}
SMOKE_RECIPES = {
    "target": Recipe(tiny_llama(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=32, max_position_embeddings=256, vocab_size=SMOKE_VOCAB_SIZE),
                     steps=6, batch_size=4, seq_len=64, lr=3e-3, warmup=2),
    "draft": Recipe(tiny_llama(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
                               head_dim=32, max_position_embeddings=256, vocab_size=SMOKE_VOCAB_SIZE),
                    steps=4, batch_size=4, seq_len=64, lr=3e-3, warmup=1),
}


# -- corpus -----------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, smoke: bool = False) -> list[Path]:
    """The ``.py`` files under ``root`` in sorted order (no site-packages, no caches).

    Smoke mode takes a small deterministic slice: 40 files of 2-12 kB.
    """
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if smoke:
        files = [p for p in files if 2_000 <= p.stat().st_size <= 12_000][:40]
    return files


def read_corpus(root: Path, smoke: bool = False):
    """``(train_texts, val_texts, info)``: one file in 50 goes to validation."""
    texts, names, digest = [], [], hashlib.sha256()
    for path in corpus_files(root, smoke):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
        if len(text) > 400_000 or not text.strip():
            continue  # generated tables, empty __init__ files
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
        texts.append(text)
        names.append(rel)
    if len(texts) < 2:
        raise RuntimeError(f"found {len(texts)} usable .py files under {root}: need a larger corpus")
    every = 50 if not smoke else 10
    val = [t for i, t in enumerate(texts) if i % every == every // 2]
    train = [t for i, t in enumerate(texts) if i % every != every // 2]
    info = {"root_name": root.name, "python": platform.python_version(), "files": len(texts),
            "train_files": len(train), "val_files": len(val), "bytes": sum(len(t.encode()) for t in texts),
            "sha256": digest.hexdigest(), "license": "PSF License Agreement (Python Software Foundation "
            "License Version 2); Copyright (c) 2001 Python Software Foundation"}
    return train, val, info


# -- tokenizer --------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE over ``texts`` with ``<|endoftext|>`` as token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=16,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_corpus(tok, texts: list[str]) -> torch.Tensor:
    """All texts as one int32 tensor of ids, each file followed by ``<|endoftext|>``."""
    eot = tok.token_to_id(EOT)
    parts = [torch.tensor(enc.ids + [eot], dtype=torch.int32) for enc in tok.encode_batch(texts)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


# -- training ---------------------------------------------------------------------------
def lr_at(step: int, r: Recipe) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    progress = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator, device):
    """``batch`` random windows of ``seq_len + 1`` tokens: inputs and next-token targets."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx.to(data.device)].long().to(device)
    return window[:, :-1], window[:, 1:]


def make_loss_fn(model, compile_model: bool):
    def loss_fn(x, y):
        pos = torch.arange(x.shape[1], device=x.device).expand_as(x)
        logits = model.compute_logits(model(x, pos))
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    return torch.compile(loss_fn) if compile_model else loss_fn


@torch.no_grad()
def evaluate(model, batches, autocast) -> float:
    model.eval()
    losses = []
    for x, y in batches:
        with autocast():
            pos = torch.arange(x.shape[1], device=x.device).expand_as(x)
            logits = model.compute_logits(model(x, pos))
        losses.append(float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten())))
    model.train()
    return sum(losses) / len(losses)


def train_one(name: str, recipe: Recipe, config: ModelConfig, train_data, val_batches, args, deadline,
              log) -> LlamaForCausalLM:
    device = torch.device(args.device)
    torch.manual_seed(args.seed + (0 if name == "target" else 1))
    model = LlamaForCausalLM(config)
    model.reset_parameters(std=0.02, seed=args.seed + (0 if name == "target" else 1))
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95),
                            eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))
    autocast = _autocast(device)
    compile_model = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    loss_fn = make_loss_fn(model, compile_model)
    gen = torch.Generator().manual_seed(args.seed + (10 if name == "target" else 11))
    entry = {"params": model.num_parameters(), "recipe": asdict(replace(recipe, model=config)),
             "compiled": compile_model, "curve": [], "stopped_early": False}
    tokens_per_step = recipe.batch_size * recipe.seq_len
    print(f"\n== {name}: {entry['params'] / 1e6:.2f}M parameters, {recipe.steps} steps of "
          f"{tokens_per_step} tokens on {device} ==", flush=True)
    t0 = time.time()
    t_log, tokens_since = t0, 0
    step = 0
    for step in range(recipe.steps):
        if time.time() > deadline:
            entry["stopped_early"] = True
            print(f"time budget reached: {name} stops after {step} of {recipe.steps} steps", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        x, y = sample_batch(train_data, recipe.batch_size, recipe.seq_len, gen, device)
        try:
            with autocast():
                loss = loss_fn(x, y)
            loss.backward()
        except Exception as exc:  # torch.compile can fail on an unusual stack: train eagerly
            if not compile_model or step > 0:
                raise
            print(f"torch.compile failed ({type(exc).__name__}: {exc}); training without it", flush=True)
            compile_model, entry["compiled"] = False, False
            opt.zero_grad(set_to_none=True)
            loss_fn = make_loss_fn(model, False)
            with autocast():
                loss = loss_fn(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_since += tokens_per_step
        if step % args.log_every == 0 or step == recipe.steps - 1:
            value = float(loss.detach())  # syncs
            now = time.time()
            rate = tokens_since / max(now - t_log, 1e-9)
            t_log, tokens_since = now, 0
            point = {"step": step, "loss": round(value, 4), "lr": lr_at(step, recipe),
                     "tokens_per_s": round(rate), "elapsed_s": round(now - t0, 1)}
            if args.eval_every and step and step % args.eval_every == 0:
                point["val_loss"] = round(evaluate(model, val_batches, autocast), 4)
            entry["curve"].append(point)
            extra = f"  val {point['val_loss']:.3f}" if "val_loss" in point else ""
            print(f"{name} step {step:5d}  loss {value:.3f}{extra}  lr {point['lr']:.2e}  "
                  f"{rate / 1e3:8.1f}k tok/s  {now - t0:6.1f}s", flush=True)
    entry["steps_done"] = step + 1 if not entry["stopped_early"] else step
    entry["train_seconds"] = round(time.time() - t0, 1)
    entry["tokens_seen"] = entry["steps_done"] * tokens_per_step
    entry["val_loss"] = round(evaluate(model, val_batches, autocast), 4)
    print(f"{name}: validation loss {entry['val_loss']:.3f} after {entry['train_seconds']}s", flush=True)
    log["models"][name] = entry
    return model.eval()


def _autocast(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


@torch.no_grad()
def agreement(target, draft, batches, autocast) -> float:
    """How often the draft's next-token argmax equals the target's (a proxy for the
    acceptance rate of greedy speculative decoding)."""
    same = total = 0
    for x, _ in batches:
        pos = torch.arange(x.shape[1], device=x.device).expand_as(x)
        with autocast():
            a = target.compute_logits(target(x, pos)).argmax(-1)
            b = draft.compute_logits(draft(x, pos)).argmax(-1)
        same += int((a == b).sum())
        total += a.numel()
    return same / total


def completions(model, tok, max_new_tokens: int) -> dict[str, str]:
    out = {}
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        out[prompt] = tok.decode(model.generate(ids, max_new_tokens=max_new_tokens))
    return out


# -- entry point ------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvlab.train", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (kvlab-tiny-target/, kvlab-tiny-draft/, train_log.json); "
                        "kvlab/models/weights replaces the shipped models")
    p.add_argument("--size", choices=["target", "draft", "both"], default="both")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=15.0,
                   help="time budget for the whole run; a model still training when it runs out stops "
                        "early (recorded in the log). The default steps take well under it on an H200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny models, a few steps, 40 small corpus files: checks the pipeline in seconds")
    p.add_argument("--corpus", type=Path, default=None, help="folder of .py files (default: the stdlib)")
    p.add_argument("--steps", type=int, default=None, help="override both recipes' step counts")
    p.add_argument("--target-steps", type=int, default=None, help="override the target's step count")
    p.add_argument("--draft-steps", type=int, default=None, help="override the draft's step count")
    p.add_argument("--batch-size", type=int, default=None, help="override the sequences per step")
    p.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile the training step (auto: on a GPU)")
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--retrain-tokenizer", action="store_true", help="ignore an existing OUT/tokenizer.json")
    p.add_argument("--sample-tokens", type=int, default=None, help="tokens per sample completion")
    args = p.parse_args(argv)
    if args.log_every is None:
        args.log_every = 1 if args.smoke else 50
    if args.eval_every is None:
        args.eval_every = 0 if args.smoke else 500
    if args.sample_tokens is None:
        args.sample_tokens = 8 if args.smoke else 48
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device (use --device cpu, or --smoke)")
    return args


def checkpoint_folder(name: str) -> str:
    """``"target"`` -> ``"kvlab-tiny-target"``: the names the engine and the course load."""
    return f"kvlab-tiny-{name}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.time()
    deadline = start + 60 * args.minutes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    recipes = {k: replace(r) for k, r in (SMOKE_RECIPES if args.smoke else RECIPES).items()}
    for name, r in recipes.items():
        steps = getattr(args, f"{name}_steps") or args.steps
        if steps is not None:
            r.steps = steps
            r.warmup = min(r.warmup, max(1, steps // 10))
        if args.batch_size is not None:
            r.batch_size = args.batch_size
        if args.lr is not None:
            r.lr = args.lr
    names = ["target", "draft"] if args.size == "both" else [args.size]

    root = args.corpus if args.corpus is not None else stdlib_root()
    train_texts, val_texts, corpus = read_corpus(root, smoke=args.smoke)
    print(f"corpus: {corpus['files']} files, {corpus['bytes'] / 1e6:.1f} MB of Python {corpus['python']} "
          f"standard library source" if args.corpus is None else f"corpus: {corpus['files']} files from {root}",
          flush=True)

    from tokenizers import Tokenizer

    tok_file = out / "tokenizer.json"
    if tok_file.is_file() and not args.retrain_tokenizer:
        tok = Tokenizer.from_file(str(tok_file))
        print(f"tokenizer: reusing {tok_file.name} ({tok.get_vocab_size()} entries)", flush=True)
    else:
        t = time.time()
        tok = train_tokenizer(train_texts, SMOKE_VOCAB_SIZE if args.smoke else VOCAB_SIZE)
        tok.save(str(tok_file))
        print(f"tokenizer: {tok.get_vocab_size()} entries trained in {time.time() - t:.1f}s", flush=True)
    eot = tok.token_to_id(EOT)
    if eot is None:
        raise RuntimeError(f"{tok_file} has no {EOT} token")
    t = time.time()
    device = torch.device(args.device)
    train_data = encode_corpus(tok, train_texts)
    val_data = encode_corpus(tok, val_texts)
    corpus.update(train_tokens=train_data.numel(), val_tokens=val_data.numel(),
                  bytes_per_token=round(corpus["bytes"] / (train_data.numel() + val_data.numel()), 2))
    print(f"encoded: {train_data.numel():,} train and {val_data.numel():,} validation tokens "
          f"({corpus['bytes_per_token']} bytes/token) in {time.time() - t:.1f}s", flush=True)
    train_data = train_data.to(device)

    log = {"args": {k: str(v) for k, v in vars(args).items()}, "corpus": corpus,
           "tokenizer": {"vocab_size": tok.get_vocab_size(), "eot_id": eot},
           "torch": torch.__version__, "device": _device_name(device), "models": {}}
    val_gen = torch.Generator().manual_seed(args.seed + 100)
    seq = min(r.seq_len for r in recipes.values())
    val_source = val_data if val_data.numel() > seq + 1 else train_data.cpu()
    num_val = 2 if args.smoke else 16
    val_batches = [sample_batch(val_source, 16 if not args.smoke else 2, seq, val_gen, device)
                   for _ in range(num_val)]

    models = {}
    for i, name in enumerate(names):
        config = recipes[name].model_config(tok.get_vocab_size(), eot)
        # the target may use at most 80% of what is left, so the draft always gets its turn
        share = 0.8 if i + 1 < len(names) else 1.0
        model_deadline = time.time() + share * max(0.0, deadline - time.time())
        model = train_one(name, recipes[name], config, train_data, val_batches, args, model_deadline, log)
        models[name] = model
        path = save_model(model, tok, config, out / checkpoint_folder(name), dtype=torch.bfloat16)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        log["models"][name]["checkpoint_bytes"] = size
        print(f"saved {name} to {path} ({size / 1e6:.1f} MB)", flush=True)

    if len(models) == 2:
        log["draft_target_agreement"] = round(agreement(models["target"], models["draft"], val_batches,
                                                        _autocast(device)), 4)
        print(f"draft/target next-token agreement on validation: {log['draft_target_agreement']:.1%}")
    for name, model in models.items():
        print(f"\n-- {name} completions (greedy) --")
        samples = completions(model, tok, args.sample_tokens)
        log["models"][name]["samples"] = samples
        for prompt, text in samples.items():
            print(f"{prompt!r} -> {text!r}")
    log["total_seconds"] = round(time.time() - start, 1)
    with open(out / "train_log.json", "w") as f:
        json.dump(log, f, indent=2)
        f.write("\n")
    _write_model_card(out, log, root if args.corpus is None else None)
    print(f"\ndone in {log['total_seconds']}s; log: {out / 'train_log.json'}")
    return log


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()})"


def _write_model_card(out: Path, log: dict, stdlib: Path | None) -> None:
    lic = stdlib / "LICENSE.txt" if stdlib is not None else None
    if lic is not None and lic.is_file():
        shutil.copyfile(lic, out / "LICENSE-PYTHON.txt")
    c = log["corpus"]
    lines = ["# kvlab tiny models", "",
             "Two small Llama-style decoders (`LlamaForCausalLM`, HF format, bf16) that share one",
             "byte-level BPE tokenizer, trained by `python -m kvlab.train` for the kvlab course.", ""]
    for name, m in log["models"].items():
        r = m["recipe"]["model"]
        lines.append(f"- **{name}**: {m['params'] / 1e6:.2f}M parameters, {r['num_layers']} layers, hidden "
                     f"{r['hidden_size']}, {r['num_heads']} query / {r['num_kv_heads']} KV heads of "
                     f"{r['head_dim']}, {m['tokens_seen'] / 1e6:.0f}M training tokens, validation loss "
                     f"{m['val_loss']}.")
    if stdlib is None:
        lines += ["", "## Training data", "", f"{c['files']} `.py` files of a custom corpus folder "
                  f"({c['bytes'] / 1e6:.1f} MB, SHA-256 `{c['sha256'][:16]}...`).", ""]
        (out / "README.md").write_text("\n".join(lines))
        return
    lines += ["", "## Training data", "",
              f"The `.py` source files of the Python {c['python']} standard library ({c['files']} files, "
              f"{c['bytes'] / 1e6:.1f} MB, SHA-256 of the content in path order `{c['sha256'][:16]}...`).",
              "Python is Copyright (c) 2001 Python Software Foundation; All Rights Reserved. Its source",
              "is distributed under the PSF License Agreement, reproduced in `LICENSE-PYTHON.txt`. These",
              "weights are derived from that source by training; they contain no other data.", ""]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
