"""A request's values, torch-free: ``sampling_params`` (``SamplingParams``), ``grammar_spec`` (a structured-output
spec), ``sequence`` (a completion's state) and ``outputs`` (``RequestOutput``)."""
