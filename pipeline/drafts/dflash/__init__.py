"""DFlash as a draft method (``[train] draft = "dflash"``): a block-parallel drafter conditioned on the target's
hidden states, drafting a whole block per verify step. Its own ``[train]`` keys (:mod:`.settings`, standard
library only: the plan loads it without torch), its config as SGLang reads it (:mod:`.config`), the
model (:mod:`.model`), the builder from the target (:mod:`.build`), the block objective and its simulated
acceptance (:mod:`.loss`), the offline bench's drafter (:mod:`.decode`) and the spec the stages look up (:mod:`.method`).
"""
