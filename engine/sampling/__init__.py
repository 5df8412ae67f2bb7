"""From logits to tokens: ``sampler``, its filters, plan, state and grammar bitmask, counter-based draws (``philox``),
``min_tokens`` and the grammar (``grammar``)."""
