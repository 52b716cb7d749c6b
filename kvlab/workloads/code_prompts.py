"""Code prompts from the held-out part of the tiny models' training corpus.

Chapter 7 times speculative decoding on prompts the models never trained on, the same ones on
every machine: they are shipped in ``code_prompts.json`` beside this module. Each prompt is
up to ~1,500 characters of a held-out standard-library file, ending with a ``def`` line (no
newline after it), so the model's continuation is that function's body.

``python -m kvlab.workloads.code_prompts`` rebuilds the file from the corpus
(:func:`kvlab.train.read_corpus`); it refuses a corpus other than the one the shipped models
were trained on (the SHA-256 in their training log), since other files would not be held out.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("code_prompts.json")
DEF_LINE = re.compile(r"^[ \t]*def \w+\(.*\).*:[ \t]*$", re.MULTILINE)


def load_code_prompts() -> list[str]:
    """The shipped prompts (at least 50)."""
    return json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))["prompts"]


def prompts_from_texts(texts: list[str], num_prompts: int = 60, max_chars: int = 1500,
                       min_chars: int = 400) -> list[str]:
    """Up to ``num_prompts`` prompts, taken round-robin from ``texts``: for each file, its
    one-line ``def`` lines with at least ``min_chars`` before them, spread evenly; each prompt
    is the whole lines before the def (at most ``max_chars``) and the def line itself."""
    per_file = []
    for text in texts:
        ends = [m.end() for m in DEF_LINE.finditer(text) if m.start() >= min_chars]
        picks = [ends[round(i * (len(ends) - 1) / 7)] for i in range(8)] if len(ends) > 8 else ends
        per_file.append([_window(text, end, max_chars) for end in dict.fromkeys(picks)])
    prompts = []
    for round_ in range(max(map(len, per_file), default=0)):
        prompts += [file[round_] for file in per_file if round_ < len(file)]
    return prompts[:num_prompts]


def _window(text: str, end: int, max_chars: int) -> str:
    start = max(0, end - max_chars)
    if start:
        start = text.index("\n", start) + 1      # begin on a whole line
    return text[start:end]      # no newline: the tokenizer merges it with the next line's indent


def main(argv=None) -> None:
    import argparse

    from kvlab.train import read_corpus, stdlib_root

    parser = argparse.ArgumentParser(prog="python -m kvlab.workloads.code_prompts", description=__doc__.split("\n")[0])
    parser.add_argument("--any-corpus", action="store_true",
                        help="use this Python's held-out files even if the models trained on another corpus")
    args = parser.parse_args(argv)
    log = json.loads((Path(__file__).resolve().parent.parent / "models" / "weights" / "train_log.json").read_text())
    _, held_out, info = read_corpus(stdlib_root())
    if info["sha256"] != log["corpus"]["sha256"] and not args.any_corpus:
        raise SystemExit(f"this Python's standard library ({info['python']}, {info['files']} files) is not the "
                         f"corpus the shipped models were trained on ({log['corpus']['python']}, "
                         f"{log['corpus']['files']} files): its held-out files would differ")
    prompts = prompts_from_texts(held_out)
    PROMPTS_FILE.write_text(json.dumps({"corpus_sha256": info["sha256"], "python": info["python"],
                                        "held_out_files": len(held_out), "prompts": prompts}, indent=1) + "\n",
                            encoding="utf-8")
    print(f"{len(prompts)} prompts from {len(held_out)} held-out files -> {PROMPTS_FILE.name}")


if __name__ == "__main__":
    main()
