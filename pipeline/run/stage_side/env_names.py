"""The ``AERIE_*`` environment variables the launcher sets for a stage and the stage side reads.

Names only, standard library only and nothing imported: the launcher reads them without loading the plan's
modules, so each launch starts quickly (a supervisor launching thousands of stages pays this per launch).
"""

ENV_RUN = "AERIE_RUN_DIR"
ENV_STAGE = "AERIE_STAGE_ID"
ENV_ATTEMPT = "AERIE_ATTEMPT"
ENV_OUT = "AERIE_OUT"
ENV_INPUTS = "AERIE_INPUTS"
ENV_PLAN = "AERIE_PLAN"
ENV_THREADS = "AERIE_CPU_THREADS"  # set when Aerie chose OMP_NUM_THREADS from the stage's CPU slots
