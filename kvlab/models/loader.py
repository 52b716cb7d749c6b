"""Load and save Hugging Face-format checkpoints from a local folder.

A checkpoint folder holds::

    config.json                      the architecture and its shape (kvlab.models.config)
    model.safetensors                the weights, by HF parameter name ...
    model.safetensors.index.json     ... or an index naming the shard that holds each weight
    tokenizer.json                   a `tokenizers` tokenizer

:func:`load_model` builds the decoder, reads every weight by name (checking that none is
missing, none is left over and every shape fits), and loads the tokenizer; :func:`save_model`
writes the same format, which ``transformers`` reads too. Nothing is ever downloaded.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from kvlab.models.config import ModelConfig
from kvlab.models.llama import LlamaForCausalLM
from kvlab.models.parallel import SINGLE, ParallelContext, shard_weight

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint folder that does not match its config: a weight missing, extra or misshapen."""


def resolve_dtype(dtype) -> torch.dtype:
    """``torch.float32``/``"float32"``/``"bf16"``... as a torch dtype (fp32, bf16 or fp16 only)."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(resolve_dtype(dtype)).removeprefix("torch.")


def load_config(path) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint folder ``path``."""
    path = _folder(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a checkpoint folder needs a {CONFIG_FILE}")
    with open(file) as f:
        return ModelConfig.from_hf(json.load(f))


def load_tokenizer(path, required: bool = True):
    """``tokenizers.Tokenizer`` from ``path/tokenizer.json``; None if absent and not ``required``."""
    file = _folder(path) / TOKENIZER_FILE
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"{file} not found: kvlab reads the tokenizer from a {TOKENIZER_FILE} "
                                    f"(tokenizers library format); pass require_tokenizer=False to load "
                                    f"the weights alone")
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def load_model(path, dtype=None, device="cpu", *, require_tokenizer: bool = True, tp: ParallelContext = SINGLE):
    """Load a HF-format checkpoint folder: returns ``(model, tokenizer, config)``.

    ``dtype``: float32, bfloat16 or float16. ``None`` takes the checkpoint's own dtype on a
    GPU and float32 on the CPU (where bf16/fp16 arithmetic is slow or emulated). The model
    is returned in eval mode. ``tokenizer`` is None only when ``require_tokenizer=False``
    and the folder has no ``tokenizer.json``. With ``tp`` (a rank of a tensor-parallel group)
    each weight is cut to that rank's shard as it is read (:mod:`kvlab.models.parallel`).
    """
    path = _folder(path)
    config = load_config(path)
    device = torch.device(device)
    if dtype is None:
        dtype = config.torch_dtype if (device.type != "cpu" and config.torch_dtype) else torch.float32
        try:
            dtype = resolve_dtype(dtype)
        except ValueError:
            dtype = torch.float32
    else:
        dtype = resolve_dtype(dtype)
    tokenizer = load_tokenizer(path, required=require_tokenizer)

    with _skip_init():
        model = LlamaForCausalLM(config, tp)
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state = {}
    for name, tensor in _read_weights(path):
        if name in expected:
            tensor = shard_weight(name, tensor, tp)
            want = tuple(expected[name].shape)
            if tuple(tensor.shape) != want:
                raise CheckpointError(f"weight {name!r} has shape {list(tensor.shape)}, the config "
                                      f"implies {list(want)}")
            state[name] = tensor.to(device=device, dtype=dtype)
        elif _ignorable(name, config):
            continue
        else:
            raise CheckpointError(f"unexpected weight {name!r} in the checkpoint: this "
                                  f"{config.architecture} config has no such parameter")
    missing = [name for name in expected if name not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"weight {missing[0]!r} is missing from the checkpoint{more}")
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    model.tie_weights()
    model.rotary.tables(device)
    return model.eval(), tokenizer, config


def save_model(model: LlamaForCausalLM, tokenizer, config: ModelConfig | None, path, dtype=None,
               max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``, if given) as a HF-format checkpoint folder.

    ``dtype`` defaults to the model's own. With ``max_shard_bytes`` the weights are split into
    ``model-0000k-of-0000n.safetensors`` shards plus an index, as HF does for large models.
    """
    from safetensors.torch import save_file

    config = model.config if config is None else config
    dtype = model.dtype if dtype is None else resolve_dtype(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # one tensor in memory; HF leaves the tied copy out of the file too
        t = t.detach().to(device="cpu", dtype=dtype)
        # a fused model's q/k/v weights are views into one tensor: safetensors wants each alone
        tensors[name] = t.clone() if t.untyped_storage().nbytes() > t.nbytes else t.contiguous()
    with open(path / CONFIG_FILE, "w") as f:
        json.dump(config.to_hf(torch_dtype=dtype_name(dtype)), f, indent=2)
        f.write("\n")
    meta = {"format": "pt"}
    for stale in [path / WEIGHTS_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        if stale.exists():
            stale.unlink()
    if max_shard_bytes is None:
        save_file(tensors, str(path / WEIGHTS_FILE), metadata=meta)
    else:
        shards, size = [[]], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, str(path / file), metadata=meta)
            weight_map.update({n: file for n in names})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(path / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(str(path / TOKENIZER_FILE))
        _write_tokenizer_config(tokenizer, config, path)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    with open(path / "generation_config.json", "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
        f.write("\n")
    return path


# -- helpers ----------------------------------------------------------------------------
@contextlib.contextmanager
def _skip_init():
    """Build modules without random initialisation: every weight is about to be replaced.

    (Uninitialised CPU memory costs nothing until touched; the meta device would do too, but
    its first use imports much of torch's reference machinery, seconds on a small machine.)
    """
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def _folder(path) -> Path:
    path = Path(os.fspath(path)).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist (kvlab loads local folders only)")
    return path


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that hold nothing to load."""
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True  # a tied head saved anyway: the embeddings are the truth
    return name.endswith("rotary_emb.inv_freq")  # old Llama checkpoints saved this buffer


def _read_weights(path: Path):
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, single file or shards."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        for file in files:
            if not (path / file).is_file():
                raise FileNotFoundError(f"shard {path / file} named in {INDEX_FILE} does not exist")
        seen = set()
        for file in files:
            with safe_open(str(path / file), framework="pt") as f:
                for name in f.keys():
                    if weight_map.get(name) != file:
                        raise CheckpointError(f"weight {name!r} is in shard {file} but {INDEX_FILE} says "
                                              f"{weight_map.get(name)!r}")
                    seen.add(name)
                    yield name, f.get_tensor(name)
        listed = set(weight_map) - seen
        if listed:
            raise CheckpointError(f"weight {sorted(listed)[0]!r} is listed in {INDEX_FILE} but no shard "
                                  f"holds it")
    elif (path / WEIGHTS_FILE).is_file():
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    else:
        present = sorted(p.name for p in path.iterdir())
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {path} (kvlab reads safetensors "
                                f"only; found: {', '.join(present) or 'nothing'})")


def _write_tokenizer_config(tokenizer, config: ModelConfig, path: Path) -> None:
    """A minimal tokenizer_config.json, so that transformers' AutoTokenizer reads the folder too."""
    def token(i):
        return tokenizer.id_to_token(i) if isinstance(i, int) else None

    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(config.bos_token_id),
           "eos_token": token(eos), "model_max_length": config.max_position_embeddings,
           "clean_up_tokenization_spaces": False}
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=2)
        f.write("\n")
