"""The command palette's entries for the screen it was opened on: each screen's own actions, by name."""

from __future__ import annotations

from collections.abc import Callable

from textual.screen import Screen

from console.screens.audit import AuditScreen
from console.screens.datasets import DatasetsScreen
from console.screens.logview import LogScreen
from console.screens.metrics import MetricsScreen

Command = tuple[str, str, Callable[[], object]]


def screen_commands(screen: Screen) -> list[Command]:
    """(title, help, action) for every action of ``screen``; nothing for the board (the app adds its own)."""
    cmds: list[Command] = []
    if isinstance(screen, LogScreen):
        cmds += [
            ("Log: follow", "follow the end of the log (auto-scroll)", screen.action_follow),
            ("Log: top", "go to the first line", screen.action_top),
            ("Log: wrap", "wrap long lines on/off", screen.action_wrap),
            ("Log: timestamps", "hide/show leading timestamps", screen.action_timestamps),
            ("Log: search", "search with a regex", screen.action_search),
            ("Log: next match", "next match below", screen.action_next),
            ("Log: previous match", "previous match above", screen.action_previous),
            ("Log: filter", "show only lines matching a regex", screen.action_filter),
            ("Log: clear filter", "show every line again", lambda: screen.set_filter(None)),
            ("Log: first error", "jump to the first error or traceback", screen.action_first_error),
            ("Log: back", "back to the board", screen.action_close),
        ]
    if isinstance(screen, DatasetsScreen):
        cmds += [
            ("Datasets: open log", "the selected stage's log", screen.action_log),
            ("Datasets: back", "back to the board", screen.action_close),
        ]
    if isinstance(screen, AuditScreen):
        cmds += [
            ("Audit: newest entry", "follow the newest entry", screen.action_follow),
            ("Audit: back", "back to the board", screen.action_close),
        ]
    if isinstance(screen, MetricsScreen):
        cmds += [
            (
                "Metrics: show/hide metric",
                "tick or untick the highlighted metric",
                screen.action_toggle_metric,
            ),
            (
                "Metrics: compare attempts",
                "the highlighted metric, a curve per attempt",
                screen.action_attempts,
            ),
            (
                "Metrics: compare with another run",
                "overlay the same metrics from another run directory (empty: stop comparing)",
                screen.action_compare_run,
            ),
            ("Metrics: previous stage", "the previous stage with metrics", screen.action_previous_stage),
            ("Metrics: next stage", "the next stage with metrics", screen.action_next_stage),
            ("Metrics: back", "back to the board", screen.action_close),
        ]
    return cmds
