"""The model families and what builds them: the decoder (``model``), its config (``model_config``, ``deepseek_config``),
layers (``linear``, ``rope``, ``mla``, ``moe``, ``moe_deepseek``, ``moe_quant``), checkpoint loading
(``model_loader``), quantized loading (``quant_config``, ``quant_load``), the default model (``default_model``) and
the Megatron-style shard of a model (``tp``)."""
