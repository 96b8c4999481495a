"""``python -m pipeline.stages.train``: see :mod:`pipeline.stages.train`."""

import sys

from pipeline.stages.train.loop import main

sys.exit(main())
