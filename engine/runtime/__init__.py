"""Running a planned step on a model: ``model_runner`` (one forward and
sampling), CUDA graphs (``cuda_graphs``), the thread steps run on
(``step_thread``), plugins, the C heap's trimming and a small generation loop
for the command line (``generate``).
"""
