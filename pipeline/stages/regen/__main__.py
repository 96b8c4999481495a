"""Entry point of ``python -m pipeline.regen``."""

from pipeline.regen.stage import main

raise SystemExit(main())
