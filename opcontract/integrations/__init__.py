"""Model integrations: instance patches that route a library's model through opcontract ops.

``opcontract.integrations.transformers`` needs the ``[hf]`` extra (transformers, trl).
"""
