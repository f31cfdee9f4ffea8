"""Stand-ins for tests and scripts that need a real engine but not a real
model: a tiny random-weight Llama with the default model's tokenizer, and
engine configs sized for it. The test suite and ``trioserve bench actors
--tiny`` both import it."""

from .tiny_model import BLOCK_SIZE, VOCAB_SIZE, engine_config, tiny_loaded, tiny_model_config, tokenizer

__all__ = ["BLOCK_SIZE", "VOCAB_SIZE", "engine_config", "tiny_loaded", "tiny_model_config", "tokenizer"]
