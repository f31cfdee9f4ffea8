"""More than one device or process: tensor parallelism (``tensor_parallel``,
``tp_runner``, ``distributed``), a runner in a worker process
(``worker_process``) and device placement of replicas (``placement``).

May import runtime, loading, models, kernels, sampling, text and the base
modules; not core.
"""
