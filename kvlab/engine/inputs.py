"""What ``LLM.generate`` accepts as prompts and sampling parameters, normalised.

A prompt becomes ``(kind, value, cache_salt)``: ``("text", str, salt)``, ``("ids", list, salt)``
or ``("bad", prompt, None)`` (the engine turns the last into an error for that request only).
"""
from __future__ import annotations

import operator

from kvlab.engine.sampling_params import SamplingParams

PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}     # of a prompt given as a dict


def is_token_list(x) -> bool:
    """A list of integers (token ids), bools excluded."""
    return isinstance(x, (list, tuple)) and all(isinstance(as_token_id(t), int) and not isinstance(t, bool) for t in x)


def as_token_id(t):
    """``t`` as an int if it is an integer of another type (numpy's, a one-element tensor's);
    anything else as it is, for the engine to refuse with the prompt's other faults."""
    if isinstance(t, int) or isinstance(t, bool):
        return t
    try:
        return operator.index(t)
    except TypeError:
        return t


def prompt_item(p):
    """One prompt as ``(kind, value, cache_salt)``: ``("text", str, salt)``, ``("ids", list, salt)``
    or ``("bad", p, None)``."""
    kind, value = _prompt_kind(p)
    return kind, value, p.get("cache_salt") if isinstance(p, dict) else None


def _prompt_kind(p):
    if isinstance(p, str):
        return ("text", p)
    if isinstance(p, dict):
        if set(p) - PROMPT_KEYS:
            return ("bad", p)
        if "prompt_token_ids" in p:
            return _prompt_kind(list(p["prompt_token_ids"])) if is_token_list(p["prompt_token_ids"]) else ("bad", p)
        if "prompt" in p:
            return _prompt_kind(p["prompt"])
    if isinstance(p, (list, tuple)) and all(not isinstance(t, (list, tuple, str, dict)) for t in p):
        return ("ids", list(p))          # ids are checked against the vocabulary later
    return ("bad", p)


def prompt_items(prompts, prompt_token_ids) -> list:
    """``generate``'s ``prompts`` or ``prompt_token_ids`` as a list of prompt items."""
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("pass prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        if is_token_list(prompt_token_ids) and prompt_token_ids:
            return [("ids", list(prompt_token_ids))]
        return [prompt_item(list(p)) if isinstance(p, (list, tuple)) else ("bad", p, None) for p in prompt_token_ids]
    if prompts is None:
        raise ValueError("generate needs prompts (or prompt_token_ids)")
    if isinstance(prompts, (str, dict)) or (is_token_list(prompts) and prompts):
        return [prompt_item(prompts)]
    return [prompt_item(p) for p in prompts]


def params_per_prompt(sampling_params, num_prompts: int) -> list:
    """One SamplingParams per prompt: ``sampling_params`` is None, one for all, or a list."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != num_prompts:
            raise ValueError(f"{len(sampling_params)} sampling_params for {num_prompts} prompts: give one, "
                             f"or one per prompt")
        return list(sampling_params)
    return [sampling_params] * num_prompts
