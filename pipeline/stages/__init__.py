"""The stage programs, one module or sub-package each (``python -m pipeline.stages.NAME``); a plan
names them by short name (``run = "prep"``, see ``pipeline.run.plan.dag.BUILTIN_STAGES``). A stage never
imports another stage: what two stages share lives in ``pipeline.data``, ``pipeline.eagle3`` or
``pipeline.serving``."""
