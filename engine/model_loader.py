"""Load a Hugging Face checkpoint folder's weights and compute the model fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def load_state_dict(folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of ``folder/*.safetensors``, cast to ``dtype``, on ``device`` (read straight onto it). Raises
    ``ValueError`` if there are none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():
                out[name] = st.get_tensor(name).to(dtype)
    return out


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
