"""The prep stage: one dataset from its source to training rows (target-native) or prompts (prompt-only).

``python -m pipeline.stages.prep --plan PLAN --dataset NAME`` (see :mod:`pipeline.stages.prep.__main__`). The pieces:
:mod:`.settings` (the plan's ``[prep]`` table), :mod:`.rows` (raw row -> outcome), :mod:`.check`
(validate first), :mod:`.run` (shards, resume, events). Sources live in :mod:`pipeline.data.sources`; the
tokenising and shard format shared with the regeneration stage in :mod:`pipeline.data.tokenise`.
"""
