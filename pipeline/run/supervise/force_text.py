"""What ``aerie force`` will do and when, in words: the supervisor's answer to ``force`` and the console's
confirmation say the same thing (standard library only: the console imports it).

``force`` overrides the admission checks (disk budget, GPU guard) for the stage's current attempt, once. It
does not start a stage early: a stage waiting for its dependencies, for a service, or for CPU/GPU slots held
by running stages still waits for them, and the override is used when it starts — so the operator is told
that, not just "ok" (``docs/operating.md``, "Forcing a stage").
"""

from __future__ import annotations

CHECKS = "the disk-budget and GPU-guard checks"


def force_message(
    sid: str, attempt: int, waiting_on: list[tuple[str, str]], reason: str = "", armed: str = "is armed"
) -> str:
    """The answer to ``force sid``: armed, and when the stage will start. ``waiting_on`` lists its unfinished
    dependencies with their states; ``reason`` is what else holds it now (a service not ready, CPU/GPU slots),
    or the admission check the override lifts (said as what held it). ``armed``: "is armed" (the supervisor's
    answer) or "will be armed" (the console's question)."""
    armed = f"--force {armed} for attempt {attempt}"
    if waiting_on:
        deps = ", ".join(f"{d} ({state})" for d, state in waiting_on[:3]) + (
            " …" if len(waiting_on) > 3 else ""
        )
        return f"{sid} is waiting for {deps}: {armed}; when its dependencies finish it will start without {CHECKS}"
    if reason.startswith(("waiting for CPU slots", "waiting for GPUs")):
        return (
            f"{sid} is {reason}: {armed}; when they are free it will start without {CHECKS} "
            "(--force never takes slots that running stages hold)"
        )
    if reason.startswith("waiting for "):  # a service it uses is not ready yet
        return f"{sid} is {reason}: {armed}; once it is ready {sid} will start without {CHECKS}"
    held = f" (held by: {reason})" if reason else ""
    return (
        f"{sid}: admission checks overridden, {armed}: it starts at the supervisor's next tick without "
        f"{CHECKS}{held}"
    )
