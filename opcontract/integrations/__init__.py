"""Model integrations: instance patches that route a library's model through opcontract ops.

All need the ``[hf]`` extra (transformers, trl): ``transformers`` (``apply_opcontract``, the
KV cache, ``token_logprobs``, ``generate_with_logprobs``), ``trl`` (``enable(trainer)``: TRL's
fused LM head on opcontract's), ``parity`` (against the stock model in float64), ``tiny`` (a
tiny random Muse Glimmer and a local tokenizer for tests and the demo).
"""
