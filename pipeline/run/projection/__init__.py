"""The run-level projection: progress, projected finish, GPU-hours and disk at finish (:mod:`.compute`) and its
words for the console header and ``aerie status`` (:mod:`.text`). Imports the plan and the run directory only."""
