"""The run machinery: the plan, the run directory, events, process identity, the supervisor and
its launcher, control requests, admission checks (disk budget, GPU guard) and the remote agent.
Needs only the standard library (and NVML, optionally): the console imports its data modules."""
