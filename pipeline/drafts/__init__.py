"""Draft methods, one package each (:mod:`.eagle3`, :mod:`.dflash`): the draft's config, model builder, loss,
export and offline-bench decode, gathered in a :class:`~pipeline.drafts.registry.DraftMethod` its ``method``
module defines as ``METHOD``. The train and bench stages look a method up by the plan's ``[train] draft``
(:func:`~pipeline.drafts.registry.draft_method`) and never branch on its name; a method's own plan keys are
its ``settings`` module (standard library only, :class:`~pipeline.run.plan.sections.DraftSettings`); a method outside this package
is registered through ``AERIE_DRAFT_METHODS`` (:mod:`pipeline.run.plan.draft_names`). Shared by the methods:
:mod:`.batch` (the training batch) and :mod:`.acceptance` (the simulated accept length's mean).
"""
