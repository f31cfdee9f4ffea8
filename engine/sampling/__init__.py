"""Choosing tokens: request parameters (``sampling_params``), the sampler,
grammar masks for structured output (``grammar``, ``structured_output``),
speculative decoding's proposer and verification (``speculative``).

May import ``engine.text`` and the base modules.
"""
