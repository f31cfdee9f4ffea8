"""trioserve's synchronous engine: no trio, actors or web here.

Packages, from the top down (each imports only those below it; the
contracts in pyproject.toml's ``[tool.importlinter]`` say so and CI checks):

- ``core``: requests, the scheduler, KV blocks and the prefix cache, EngineCore
- ``parallel``: tensor parallelism, worker processes, placement
- ``runtime``: running a planned step on a model
- ``loading``: checkpoints and GGUF files into models
- ``models``: the models' math, one module per family
- ``sampling``: sampling parameters, the sampler, grammars, speculative decoding
- ``text``: tokenizers, detokenizing, chat templates
- ``kernels``: compressed weights, native kernels and their choice, CPU capability
- ``layers``: the blocks families are built of, in plain torch (attention, rotary, KV cache)

Beside them, the base modules every package may use: ``config``, ``errors``,
``faults``, ``validators``, ``plugins`` and ``heap_trim``.
"""
