"""Entry point of ``python -m pipeline.serve``."""

from pipeline.serve.stage import main

raise SystemExit(main())
