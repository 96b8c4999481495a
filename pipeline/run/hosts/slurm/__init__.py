"""The Slurm executor: the only place Aerie runs Slurm's commands (:mod:`.commands`), an attempt as a Slurm job
(:mod:`.jobs`) and the login-node preflight (:mod:`.preflight`)."""
