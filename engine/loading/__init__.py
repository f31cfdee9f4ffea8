"""Getting a model into memory: Hugging Face folders and GGUF files
(``loader``), GGUF tensors (``gguf_weights``), compressed projections built as
tensors arrive (``compressed``), the converted-model caches (``gguf_cache``,
``rtn_cache``) and the model's own sampling defaults (``generation_config``).

May import models, kernels, text, sampling and the base modules.
"""
