"""EAGLE-3 as a draft method (``[train] draft = "eagle3"``, EAGLE-3.1's switches included): the chain drafter,
trained with training-time test. Its model and config are the EAGLE-3 library's
(:mod:`pipeline.eagle3.draft_model`, :mod:`pipeline.eagle3.draft_config`, built from the target by
:func:`pipeline.eagle3.trainer_inputs.build_draft`, which SpecForge's trainer in ``bench/`` shares); this
package holds its objective (:mod:`.loss`: soft-label cross-entropy, :mod:`.head_loss`, or the LK losses,
:mod:`.lk_loss`), its simulated acceptance (:mod:`.acceptance`) and the spec the stages look up (:mod:`.method`).
"""
