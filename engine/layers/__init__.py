"""The models' building blocks in plain torch: paged attention
(``attention``), rotary embeddings (``rotary``), the paged KV cache
(``kv_cache``) and the inputs of one forward (``forward_batch``). Kernels
are checked against these; families (``engine.models``) are built of them.

Imports only engine/'s base modules (config, errors).
"""
