"""The compute kernels and their choice: compressed weight formats
(``rtn``), the native C++ kernels (``native`` builds ``csrc/``;
``int4_native``, ``int8_native``, ``native_decode``, ``native_attention``),
ATen's (``int4_pack``, ``int8_pack``, ``int8_dynamic``), oneDNN's float GEMM
(``onednn``), the rule that picks one (``choose``), and what this CPU can run
(``capability``, ``kv_dtype``).

The bottom of engine/: imports only the base modules (errors, config).
"""
