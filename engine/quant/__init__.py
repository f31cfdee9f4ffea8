"""Compressed weights: round-to-nearest formats (``rtn``), one small module
per linear kernel over them (``int8_pack``, ``int4_pack``; ``int8_dynamic``,
fbgemm's, is measured by scripts/bench_qlinear.py but not chosen),
the chooser that picks a kernel by capability and a short measurement
(``choose``), and the projections a model runs with them (``projections``).
GGUF tensors come in through ``gguf_weights``."""
