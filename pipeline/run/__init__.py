"""The run machinery, cut by role (bottom first; a sub-package imports only those before it, tests/test_layout.py):

- :mod:`.plan`: the plan file, its typed tables and the DAG;
- :mod:`.rundir`: the run directory, its files, events and status rows;
- :mod:`.hosts`: where an attempt runs (executor seam, processes and signals, GPUs, the remote agent, Slurm);
- :mod:`.projection`: the run's finish, GPU-hours and disk at finish;
- :mod:`.stage_side`: what runs with a stage (launcher, runtime context, metric sinks, ranks);
- :mod:`.supervise`: the supervisor, admission, liveness and the control verbs.

Needs only the standard library (and NVML, optionally): the console imports the plan, run-directory and projection
modules."""
