"""The inference-server stage: ``python -m pipeline.stages.serve --plan PLAN [--mode plain|eagle3]``.

A service stage (``service = true``): it checks the port and the plan's GPUs, starts the server as
its child (SGLang on the container, or the ``local`` backend, ``transformers serve`` on the CPU,
for the demo and CI), follows its log (passed through to the stage log and parsed into metrics),
polls ``/health`` and reports ``starting`` / ``ready`` / ``unhealthy`` / ``stopped`` health events.
When ready it writes ``out/endpoint.json`` (the URL clients use). SIGTERM (the supervisor stopping
an idle service, or an operator kill) stops the server and everything it started, then exits.
"""
