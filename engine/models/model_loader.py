"""Load a Hugging Face checkpoint folder's weights and compute the model fingerprint.

Every load first checks the checkpoint's quantization from its headers (:func:`engine.models.quant_load.check_checkpoint`:
an unsupported or malformed scheme is refused before a weight is read). Unquantized tensors are cast to the engine
dtype; a quantized module's tensors are read as stored and become one ``pdkernels.quant`` weight object under
``<module>.weight`` (:func:`engine.models.quant_load.convert`), which :class:`engine.models.linear.Linear` runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.model_config import ModelConfig
from engine.models.quant_load import check_checkpoint, convert
from engine.models.tp import RankState, head_source, shard_config, shard_plan, shard_state, take, vocab_cut, weight_shape

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _quantized_param(name: str, quantized: set[str]) -> bool:
    """Whether ``name`` is a quantized module's tensor kept as stored (its bias is cast like any float)."""
    module, _, param = name.rpartition(".")
    return module in quantized and param != "bias"


def load_state_dict(folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of ``folder/*.safetensors``, cast to ``dtype``, on ``device`` (read straight onto it); a
    quantized module's tensors as one ``pdkernels.quant`` weight under ``<module>.weight`` instead. Raises
    ``ValueError`` if there are none, or (before reading any weight) for a quantization it cannot run."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder}")
    plan = check_checkpoint(folder, files)
    quantized = set(plan)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():
                t = st.get_tensor(name)
                out[name] = t if _quantized_param(name, quantized) else t.to(dtype)
    convert(out, plan)
    return out


def load_shard(folder: Path, cfg: ModelConfig, dtype: torch.dtype, rank: int, size: int,
               device: torch.device | str = "cpu") -> RankState:
    """Rank ``rank`` of a TP group of ``size``: only its part of every tensor of ``folder/*.safetensors``
    (``engine.models.tp.shard_plan``'s cuts, read as file slices), cast to ``dtype``, on ``device``. Holds what
    ``shard_state`` of the whole checkpoint gives, reading ~1/size of the sharded weights (the replicated ones
    whole); a quantized checkpoint is loaded whole and cut through its weight classes (``engine.models.tp.shard_state``).
    Raises ``ValueError`` as :func:`load_state_dict`, or as ``engine.models.tp.check_tp`` before reading."""
    shard_config(cfg, size)  # what does not divide is refused before anything is read
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder}")
    if check_checkpoint(folder, files):
        # quantized: every rank loads the whole checkpoint (its weight objects) and cuts its part through the
        # classes' rows / cols (engine.models.tp.take_weight), not by file slices
        full = load_state_dict(folder, dtype, device)
        width = weight_shape(full[head_source(cfg)])[0]
        _, tensors = shard_state(cfg, full, rank, size)
        return RankState(rank, size, tensors, width)
    out: dict[str, torch.Tensor] = {}
    width = 0
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():
                part = st.get_slice(name)
                shape = tuple(part.get_shape())
                if name == head_source(cfg):
                    width = shape[0]
                    out["lm_head.weight"] = take(vocab_cut(shape[0], rank, size), part.__getitem__).to(dtype)
                cut = shard_plan(cfg, name, shape, rank, size)
                if cut is not None:
                    out[name] = (st.get_tensor(name) if cut.pieces is None else take(cut, part.__getitem__)).to(dtype)
    if not width:
        raise ValueError(f"model: no {head_source(cfg)} in {folder}")
    return RankState(rank, size, out, width)


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def model_fingerprint(folder: Path, dtype: str) -> str:
    """A short hex id binding config, weight manifest (names, shapes, dtypes, sizes), tokenizer and dtype.

    Two engines share KV or prefix-cache entries only when their fingerprints are equal. Reads headers, not weights,
    so it is cheap; a weight file rewritten with different values but the same manifest and size is not detected.
    """
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        h.update(_safetensors_header(f))
    for name in TOKENIZER_FILES:
        p = folder / name
        if p.exists():
            h.update(name.encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    h.update(dtype.encode())
    return h.hexdigest()[:32]
