"""The models' math: one module per family (``llama``: Llama, Mistral,
Qwen2), and the layers they share (``attention``, ``rotary``, ``kv_cache``,
``forward_batch``).

May import ``engine.kernels`` and engine/'s base modules (config, errors);
nothing of core, loading, sampling, runtime or parallel.
"""
