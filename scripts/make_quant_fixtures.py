"""Make the tiny quantized test checkpoints under ``tests/data/quant/`` with llmcompressor (run by hand, never by CI).

The fixtures are real checkpoints in the formats our users deploy, made by the tool that makes most of them, so the
loader's tests (issue 44) read what vLLM, SGLang and transformers read rather than files we wrote to match our own
reading of a spec. One tiny random Llama (hidden 128, intermediate 256, 2 layers, 4 heads of 64, 2 KV heads, tied
embeddings over the 320-token byte-level BPE of ``tests/factories.py``) is saved unquantized and then quantized
data-free by ``oneshot`` + ``QuantizationModifier(targets="Linear", ignore=["lm_head"], ...)`` and
``save_pretrained(dir, save_compressed=True)``, one folder per scheme:

=====================  ==========================================================================================
folder                 what it holds
=====================  ==========================================================================================
``base/``              the float32 original (the reference every scheme is judged against)
``w8a8/``              compressed-tensors ``int-quantized``: INT8 weights per output channel, INT8 activations per
                       token, dynamic, symmetric (preset ``W8A8``)
``w4a16/``             ``pack-quantized``: INT4 weights in groups of 64 along K, symmetric (``config_groups``: the
                       ``W4A16`` preset's groups are 128)
``w4a16_asym/``        ``pack-quantized``: INT4 weights in groups of 64, asymmetric (zero points)
``fp8_dynamic/``       ``float-quantized``: FP8 e4m3 weights per channel, FP8 activations per token, dynamic
                       (preset ``FP8_DYNAMIC``)
``fp8_static/``        ``float-quantized``: FP8 weights per tensor, FP8 activations per tensor with a static scale
                       (preset ``FP8``); the activation scale needs calibration, done on 4 sequences of 64 token
                       ids drawn from the tokenizer's vocabulary in this script (nothing downloaded)
``fp8_block/``         ``float-quantized``: FP8 weights in 128x128 blocks, FP8 activations per group of 128, dynamic
                       (preset ``FP8_BLOCK``)
``fp8_native_block/``  the same block FP8 weights rewritten in the native ``quant_method: "fp8"`` format
                       DeepSeek-V3 and Qwen3-*-FP8 ship: ``weight`` float8_e4m3fn, ``weight_scale_inv`` float32
                       [ceil(N/128), ceil(K/128)] (w = weight * weight_scale_inv per block), config
                       ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}``
=====================  ==========================================================================================

The quantized folders are made from a bfloat16 copy of the base model, as real checkpoints are (SmolLM2, Llama and
Qwen ship bfloat16): their unquantized tensors (embedding, norms) and their compressed-tensors scales are bfloat16,
which keeps the set under 5 MB (4.7 MB, 1.7 of it the float32 base). Every linear's in- and out-features are
multiples of 128 (head_dim 64, not 128 / 4 = 32: 2 KV heads of 32 would give k_proj and v_proj 64 rows, a partial
128-row block inside the fused q|k|v, which vLLM refuses for block FP8 and no shipped block-FP8 checkpoint has), so
FP8's 128x128 blocks tile every weight.

Run it in a venv holding llmcompressor, beside the project's (it pins its own transformers)::

    python3 -m venv /work/venvs/llmc
    /work/venvs/llmc/bin/pip install torch==2.13.0      # first: a bare torch pulls a multi-GB CUDA build
    /work/venvs/llmc/bin/pip install llmcompressor      # 0.14.0.1 (compressed-tensors 0.19.0, transformers 5.17)
    /work/venvs/llmc/bin/python scripts/make_quant_fixtures.py [--out tests/data/quant]

It rewrites every folder; the random weights and the tokenizer are seeded, the output is the same on every run with
the same package versions. ``tests/unit/test_quant_fixtures.py`` checks that the committed folders are what this
docstring says.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 320
LLAMA = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
             eos_token_id=0, rope_theta=10000.0, tie_word_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
NATIVE_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _int4_groups(symmetric: bool) -> dict[str, Any]:
    """A ``config_groups`` recipe for INT4 weights in groups of 64 (the presets' groups are 128)."""
    return {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 64}}}


# folder -> the QuantizationModifier's scheme arguments (a preset name or config_groups), and whether it calibrates
SCHEMES: dict[str, tuple[dict[str, Any], bool]] = {
    "w8a8": ({"scheme": "W8A8"}, False),
    "w4a16": ({"config_groups": _int4_groups(symmetric=True)}, False),
    "w4a16_asym": ({"config_groups": _int4_groups(symmetric=False)}, False),
    "fp8_dynamic": ({"scheme": "FP8_DYNAMIC"}, False),
    "fp8_static": ({"scheme": "FP8"}, True),
    "fp8_block": ({"scheme": "FP8_BLOCK"}, False),
}


def make_base(out: Path) -> None:
    """Write the float32 random Llama and its tokenizer to ``out`` (weights larger than the default init, as the
    test factories make them, so greedy has clear favourites)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from factories import build_tokenizer  # type: ignore[import-not-found]
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(out, vocab_size=VOCAB)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    # transformers 5 writes its 5-only "TokenizersBackend"; the generic fast class loads in 4.x (vLLM's venv) too
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            elif name.endswith("norm.weight"):
                p.add_(torch.empty_like(p).uniform_(-0.3, 0.3))
    model.save_pretrained(str(out), safe_serialization=True)


def calibration_set(n: int = 4, length: int = 64) -> Any:
    """``n`` sequences of ``length`` token ids drawn (seeded) from the vocabulary, as a datasets.Dataset."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (n, length), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * length for _ in ids]})


def quantize(base: Path, out: Path, scheme_args: dict[str, Any], calibrate: bool) -> None:
    """Quantize a bfloat16 copy of ``base`` with llmcompressor and save it compressed, with the tokenizer."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16).eval()
    recipe = QuantizationModifier(targets="Linear", ignore=["lm_head"], **scheme_args)
    extra: dict[str, Any] = {}
    if calibrate:
        extra = dict(dataset=calibration_set(), num_calibration_samples=4, max_seq_length=64)
    oneshot(model=model, recipe=recipe, **extra)
    model.save_pretrained(str(out), save_compressed=True)
    copy_tokenizer(base, out)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def to_native_fp8(block: Path, out: Path) -> None:
    """Rewrite the compressed-tensors FP8_BLOCK folder ``block`` as DeepSeek-V3 / Qwen3-FP8's native format: each
    quantized ``weight_scale`` [ceil(N/128), ceil(K/128)] becomes ``weight_scale_inv`` in float32 (the same factor:
    the dequantized weight is ``weight * weight_scale_inv`` per block), activation scale entries are dropped, and the
    config's quantization_config becomes NATIVE_FP8."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(block / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            if key.endswith(".weight_scale"):
                tensors[key[: -len("weight_scale")] + "weight_scale_inv"] = t.to(torch.float32).contiguous()
            elif key.endswith((".input_scale", ".input_zero_point", ".weight_zero_point")):
                continue
            else:
                tensors[key] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((block / "config.json").read_text())
    config["quantization_config"] = dict(NATIVE_FP8)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json", *TOKENIZER_FILES):
        if (block / name).is_file():
            shutil.copy(block / name, out / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "quant")
    ap.add_argument("--only", default="", help="comma-separated folders to (re)make, besides base (default: all)")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    base = args.out / "base"
    shutil.rmtree(base, ignore_errors=True)
    make_base(base)
    for name, (scheme_args, calibrate) in SCHEMES.items():
        if only and name not in only:
            continue
        folder = args.out / name
        shutil.rmtree(folder, ignore_errors=True)
        print(f"[fixtures] {name}: {scheme_args}", flush=True)
        quantize(base, folder, scheme_args, calibrate)
    if not only or "fp8_native_block" in only:
        shutil.rmtree(args.out / "fp8_native_block", ignore_errors=True)
        to_native_fp8(args.out / "fp8_block", args.out / "fp8_native_block")
    for folder in sorted(p for p in args.out.iterdir() if p.is_dir()):
        for f in folder.iterdir():
            f.chmod(0o644)  # safetensors writes owner-only files
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"[fixtures] {folder.name}: {size / 1024:.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
