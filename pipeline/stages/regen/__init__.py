"""Response regeneration: ``python -m pipeline.stages.regen --plan PLAN --dataset NAME``.

Prompt-only datasets get their answers from the target model itself (EAGLE-3 learns the target's
distribution): an async OpenAI-compatible client (:mod:`pipeline.stages.regen.client`) asks the inference
server, a resumable log (:mod:`pipeline.stages.regen.store`) keeps every answer, and the stage
(:mod:`pipeline.stages.regen.stage`) tokenises prompt + answer into the same shards as target-native prep.
"""
