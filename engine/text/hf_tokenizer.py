"""A model folder's Hugging Face tokenizer: the object ``AutoTokenizer.from_pretrained(folder)`` returns, built
without ``AutoTokenizer``'s config load where the folder declares the class.

``AutoTokenizer`` loads the model's config (``AutoConfig``) to pick the tokenizer class. For a Llama config that import
chain reaches ``transformers.activations`` and ``torch.distributed.tensor``: ~1.1 s of CPU in every fresh process
(each worker actor, each offline engine), where the tokenizer itself takes ~0.3 s. A folder whose
``tokenizer_config.json`` names its class, with no remote code, and whose ``model_type`` is one for which
``AutoTokenizer`` takes that declared class as it is, gets that class's ``from_pretrained`` called directly, as
``AutoTokenizer`` itself ends by calling it. Every other folder goes through ``AutoTokenizer``.
``tests/unit/test_hf_tokenizer.py`` checks both give the same class, Rust tokenizer, special and added tokens, chat
template and ids, for the default model and each family's test checkpoint under each class a family's checkpoints
declare.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any


def _json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing or not an object. Reads a file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def declared_class(folder: Path) -> type | None:
    """The tokenizer class ``AutoTokenizer.from_pretrained(folder)`` would instantiate, when the folder's own files
    decide it the way AutoTokenizer decides it for a declared class; None when AutoTokenizer must decide (no
    ``tokenizer.json``, no declared ``tokenizer_class``, remote code, an unknown ``model_type``, a name AutoTokenizer
    sends to ``TokenizersBackend``, a declared Llama class (AutoTokenizer inspects ``tokenizer.json``'s pre-tokenizer),
    or a ``model_type`` whose registered class differs from the declared one). Reads the folder's JSON files."""
    from transformers.models.auto import configuration_auto, tokenization_auto as auto

    tok_cfg, cfg = _json(folder / "tokenizer_config.json"), _json(folder / "config.json")
    if tok_cfg is None or cfg is None or not (folder / "tokenizer.json").is_file() or "auto_map" in tok_cfg:
        return None
    declared, model_type = tok_cfg.get("tokenizer_class"), cfg.get("model_type")
    if not isinstance(declared, str) or model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        return None
    names = [str(folder).lower()] + ([cfg["_name_or_path"].lower()] if isinstance(cfg.get("_name_or_path"), str) else [])
    if any(fnmatch.fnmatch(n, p) for n in names for p in auto.MODEL_IDS_TO_TOKENIZERS_BACKEND):
        return None
    if declared.removesuffix("Fast") == "LlamaTokenizer":
        return None
    registered = auto.TOKENIZER_MAPPING_NAMES.get(model_type)
    if registered is not None and registered.removesuffix("Fast") != declared.removesuffix("Fast"):
        return None
    # AutoTokenizer's last step for a declared class (transformers 5): the name less "Fast", else with it; its
    # Python backend and an unknown name become TokenizersBackend
    name = declared[:-4] if declared.endswith("Fast") else declared
    cls = auto.tokenizer_class_from_name(name)
    if cls is None and not name.endswith("Fast"):
        cls = auto.tokenizer_class_from_name(name + "Fast")
    if cls is None or cls.__name__ == "PythonBackend":
        cls = auto.TokenizersBackend
    return cls


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer, as ``AutoTokenizer.from_pretrained(str(folder))`` builds it (see the module's
    docstring). Reads the folder."""
    try:
        cls = declared_class(folder)
    except (AttributeError, ImportError, TypeError):  # a transformers release that moved its tables: decide as it does
        cls = None
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    return cls.from_pretrained(str(folder), _from_auto=True)
