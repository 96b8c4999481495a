"""The GPU experiments and the one harness they share on the lent machine.

The harness: ``runner`` (where the machine keeps things, the log clock, the process groups the bench started,
a pipeline stage run by its command line), ``staging`` (the carried chunk folders joined into SGLang's site
folder), ``server`` (an SGLang server: start, wait healthy, metrics, stop by its own process group), ``results``
(the results files under ``$OUT``) and ``common`` (model shapes, timing, the matmul ceiling). Every other module
is one experiment, launched from the repository root as ``python -m bench.gpu.<experiment>``, or a helper that
names its experiment (``sglang_*``, ``methods_*``, ``specforge_*``). Nothing in the harness imports an experiment.
"""
