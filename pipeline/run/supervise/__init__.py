"""The supervisor and its control verbs: scheduling and enforcing a run from its files (:mod:`.supervisor`), each
stage's derived state (:mod:`.stage_state`), admission by disk budget and GPUs (:mod:`.budget`), one supervisor per run
(:mod:`.liveness`), its own faults (:mod:`.faults`), the control entry point (:mod:`.ctl`), run set-up and the run's
projection on its host (:mod:`.run_projection`). The top of the run machinery: nothing else in it imports this."""
