"""Where a stage's attempt runs: the executor seam (:mod:`.executor`) and its local implementation, process identity
and the only place signals are sent (:mod:`.procs`), GPUs, out-of-memory and full-disk diagnosis, the remote agent the
console talks to, preflight reports, and Slurm (:mod:`.slurm`). Imports the plan and the run directory only."""
