"""The supervisor at any scale or write speed (issue 46): it says "slow" when it is slow and "cannot write"
only when a write failed; a stage without a log yet logs nothing; a fast writer never stalls its
heartbeat nor passes the stage log's bound; 10,000 stages stay operable."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pipeline.run.rundir.layout import RunDir, write_json
from pipeline.run.supervise.liveness import STALE_S, liveness, try_lock
from tests.runs import make_run


def _held_run(tmp_path: Path) -> RunDir:
    return make_run(tmp_path, '[run]\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n')


def test_a_slow_supervisor_is_called_slow_and_a_failed_write_cannot_write(tmp_path: Path) -> None:
    """A supervisor that holds the lock but wrote no snapshot for a while: "slow" while nothing failed;
    "cannot write" only with a failed write's alert (its text)."""
    run = _held_run(tmp_path)
    lock = try_lock(run.root)
    assert lock is not None
    try:
        write_json(run.supervisor_path, {"pid": os.getpid(), "t": time.time()})
        state = {"supervisor": {"pid": os.getpid(), "t": time.time() - STALE_S - 20, "alerts": []}}
        rep = liveness(run, state)
        assert rep["verdict"] == "silent", rep
        assert "slow" in rep["text"] and "cannot write" not in rep["text"], rep["text"]
        state["supervisor"]["alerts"] = [  # type: ignore[index]
            {"code": "tick_failed", "text": "supervisor error (ValueError: x)", "resolved": None},
        ]
        assert "cannot write" not in liveness(run, state)["text"]
        state["supervisor"]["alerts"].append(  # type: ignore[index]
            {"code": "write_failed", "text": "cannot write the run directory: EIO", "resolved": None}
        )
        rep = liveness(run, state)
        assert "cannot write: cannot write the run directory: EIO" in rep["text"], rep["text"]
    finally:
        for fd in lock:
            if fd is not None:
                os.close(fd)
