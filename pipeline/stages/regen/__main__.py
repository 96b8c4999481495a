"""Entry point of ``python -m pipeline.stages.regen``."""

from pipeline.stages.regen.stage import main

raise SystemExit(main())
