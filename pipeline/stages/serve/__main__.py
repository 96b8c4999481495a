"""Entry point of ``python -m pipeline.stages.serve``."""

from pipeline.stages.serve.stage import main

raise SystemExit(main())
