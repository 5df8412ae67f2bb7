"""``pdcluster bench``: a load generator for any OpenAI-compatible server.

Pure parts (no I/O, unit-tested on fake inputs): ``datasets`` (seeded prompts of counted lengths), ``arrivals``
(Poisson / gamma schedules), ``sweep`` (the points a run visits), ``stats`` (percentiles, goodput), ``openai_stream``
(request bodies, SSE chunks), ``report`` (the table). The shell: ``client`` (one streamed HTTP request), ``runner``
(one sweep point on asyncio), ``progress`` (the stderr bar), ``plot``, ``cli``.
"""
