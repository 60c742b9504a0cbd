"""Model integrations: instance patches that route a library's model through opcontract ops.

All need the ``[hf]`` extra (transformers, trl, peft): ``transformers``
(``apply_opcontract``, the KV cache, ``token_logprobs``, ``generate_with_logprobs``), ``trl``
(``enable(trainer)``: TRL's fused LM head on opcontract's), ``lora`` (PEFT's LoRA layers on
``dense_gemm``), ``parity`` (against the stock model in float64), ``tiny`` (a tiny random
Muse Glimmer and a local tokenizer for tests and the demo).
"""
