"""The engine's core: what to run next and where its KV lives.

Requests and their state (``sequence``, ``new_request``, ``outputs``), the
scheduler that plans each step (``scheduler``, with ``request_queues``,
``step_planner``, ``kv_ledger``, ``drafts``, ``chunks``,
``scheduler_output``, ``scheduling_policy``), the paged KV blocks with their
prefix cache (``block_manager``, ``block_tables``, ``prefix_hash``,
``kv_batch``, ``kv_budget``, ``kv_pool``), and ``EngineCore``, which owns
the KV pool and ties them to a model runner and to the processors of a
request's input and output (``input_processor``, ``output_processor``).

The top of engine/: it may import every other engine package.
"""
