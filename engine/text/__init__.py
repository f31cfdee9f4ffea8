"""Text in and out: tokenizers (``tokenizer``, ``fast_tokenizer``),
incremental detokenizing (``detokenizer``) and chat templates
(``chat_template``).

Imports only the base modules.
"""
