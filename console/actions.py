"""The console's actions, one table: for each, its key, its words, whether it asks first, what it sends to
the host, and what a read-only console does with it.

Everything an operator reads about an action is generated from :data:`ACTIONS`: the app's Textual
bindings and their footer words (:func:`bindings`), the help sheet's lines (each binding's ``tooltip``)
and its "Control the selected stage" group (:data:`CONTROL_NAMES`), the command palette's entries
(:func:`palette_entries`), a read-only console's refusal (:func:`refusal`, :data:`READ_ONLY_NOTE`) and the
``aerie`` CLI's control verbs (:data:`CTL_VERBS`, :data:`CTL_FLAGS`). A read-only console is a browser
session's too (``aerie serve --read-only``, a view token: it runs ``aerie attach --read-only``), so its
refusals are these.

An action that sends something (``sends``) is a control action: a read-only console hides its key from
the footer and answers it — key or palette — with :func:`refusal`, sending nothing; every other action
(views, filter, help, quit) works the same in a read-only console.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class ConsoleAction:
    """One action of the board's screen (the app's ``action_<name>``)."""

    name: str  # the app's action: ``action_<name>``
    key: str | None  # its key (None: the palette only)
    label: str = ""  # the footer's word
    help: str = ""  # the help sheet's line (the binding's tooltip)
    palette: str = ""  # the command palette's title ("": not there)
    palette_help: str = ""
    show: bool = True  # in the footer (while allowed)
    sends: tuple[
        str, ...
    ] = ()  # the ``pipeline.run.supervise.ctl`` verbs it sends (the first names it); () a view
    flags: tuple[str, ...] = ()  # what the verb is sent with (``retry --fresh``)
    confirm: str = ""  # the question asked first ({id} {pgid} {pid} {plan}); "" sends at once
    wrong_state: str = ""  # why the selected stage's state refuses it (after "<id> is <state>: ")
    replaces: str = ""  # the framework's palette command this one stands in for (Textual's "Quit")
    flag_help: str = ""  # what the CLI says of ``flags`` (``aerie retry --fresh``)

    @property
    def mutating(self) -> bool:
        """A control action: refused (nothing sent) by a read-only console."""
        return bool(self.sends)

    @property
    def verb(self) -> str:
        """The words a refusal, a notification and the audit log call it by: ``retry --fresh``."""
        return " ".join((self.sends[0], *self.flags)) if self.sends else self.name

    def question(self, **facts: object) -> str:
        """The confirmation's text for a stage (``id``, ``pgid``, ``pid``, ``plan`` as the template needs)."""
        return self.confirm.format(**facts)


ACTIONS: tuple[ConsoleAction, ...] = (
    ConsoleAction(
        "pause",
        "p",
        "Pause/resume",
        "pause the selected stage at its next safe point (SIGSTOP after the grace period); again to resume",
        "Pause / resume stage",
        "pause the selected stage at a safe point, or resume it",
        sends=("pause", "resume"),
        wrong_state="only a running stage can be paused",
    ),
    ConsoleAction(
        "kill",
        "k",
        "Kill",
        "kill: SIGTERM to the stage's recorded process group, SIGKILL after the grace (asks first)",
        "Kill stage",
        "SIGTERM then SIGKILL to the selected stage's process group (asks)",
        sends=("kill",),
        confirm="Kill {id}?\n\nSIGTERM to its process group {pgid} (pid {pid}), SIGKILL after the grace "
        "period. Its children die too; nothing else is touched.",
        wrong_state="nothing to kill",
    ),
    ConsoleAction(
        "retry",
        "r",
        "Retry",
        "retry a failed/killed/skipped stage; it resumes from what is done",
        "Retry stage",
        "start the next attempt of a failed/killed/skipped stage",
        sends=("retry",),
    ),
    ConsoleAction(
        "retry_fresh",
        "R",
        "Retry fresh",
        "retry from scratch: clears the stage's outputs in the run dir first (asks first)",
        "Retry stage from scratch",
        "clear its outputs, then retry (asks)",
        show=False,
        sends=("retry",),
        flags=("--fresh",),
        flag_help="clear the stage's outputs (inside the run dir) first",
        confirm="Retry {id} from scratch?\n\nIts outputs in the run directory (stages/{id}/out) are deleted first.",
    ),
    ConsoleAction(
        "skip",
        "s",
        "Skip",
        "skip a stage that has not started (its dependants treat it as done)",
        "Skip stage",
        "mark a stage that has not started as skipped",
        show=False,
        sends=("skip",),
    ),
    ConsoleAction(
        "force",
        "F",
        "Force",
        "start a stage held by an admission check (disk budget, foreign GPU process) anyway, once (asks first); "
        "on a stage already forced (⚑), disarms it",
        "Force stage",
        "start a stage held by an admission check, once (asks)",
        show=False,
        sends=("force",),
        confirm="Force {id}?\n\n{plan}.\n\nThe override is recorded in its events and the audit log; an alert "
        "says when it starts.",
        wrong_state="only a waiting stage can be forced",
    ),
    ConsoleAction(
        "unforce",
        None,
        "Disarm force",
        "disarm the force armed on the selected stage (F again on a stage marked ⚑)",
        "Disarm force",
        "the selected stage waits for the admission checks again (F on a stage marked ⚑)",
        show=False,
        sends=("force",),
        flags=("--cancel",),
        flag_help="disarm a force armed on the stage before it starts (it waits for the admission checks again)",
        wrong_state="no force is armed on it",
    ),
    ConsoleAction(
        "log",
        "l",
        "Log",
        "the selected stage's full log (follow, search, filter, wrap)",
        "Open stage log",
        "the selected stage's full log",
    ),
    ConsoleAction(
        "server_log",
        "L",
        "Server log",
        "the inference server's log (the serve stage)",
        "Open server log",
        "the inference server's log",
        show=False,
    ),
    ConsoleAction(
        "datasets",
        "d",
        "Datasets",
        "per-dataset progress: rows/quota, rate, ETA, rejects",
        "Dataset progress",
        "per-dataset rows, rate, ETA, rejects",
    ),
    ConsoleAction(
        "metrics",
        "m",
        "Metrics",
        "curves of the selected stage's metrics (loss, acc_0…, tokens/s), or one metric across attempts",
        "Metrics",
        "curves of the selected stage's metrics; compare attempts",
    ),
    ConsoleAction(
        "audit",
        "A",
        "Audit",
        "the audit log: who paused, killed, retried or skipped what, from where, and the outcome",
        "Audit log",
        "who did what to which stage, from where, and the outcome",
        show=False,
    ),
    ConsoleAction(
        "filter",
        "slash",
        "Filter",
        "filter stages by id or state; Esc clears",
        "Filter stages",
        "filter the board by id or state",
    ),
    ConsoleAction(
        "fold_family",
        None,
        palette="Fold / unfold family",
        palette_help="the selected family: its running and failed stages stay listed",
    ),
    ConsoleAction(
        "fold_all_families",
        None,
        palette="Fold / unfold all families",
        palette_help="every family of the board",
    ),
    ConsoleAction(
        "alert_stage",
        "a",
        "Alerts",
        "the run's alerts with their evidence (failures, disk, a stalled stage, a NaN loss, idle "
        "GPUs ...), open ones first; Enter selects the alert's stage",
        "Alerts",
        "the run's alerts, with evidence; Enter selects the stage",
        show=False,
    ),
    ConsoleAction(
        "ack_alert",
        "K",
        "Ack",
        "acknowledge the selected stage's newest open alert (else the run's): every console and aerie status "
        "show who and when",
        "Acknowledge alert",
        "the selected stage's newest alert not yet acknowledged (the run's, if it has none)",
        show=False,
        sends=("ack",),
    ),
    ConsoleAction(
        "silence_alert",
        "S",
        "Silence",
        "silence the selected stage's newest alert not yet silenced (else the run's): acknowledged, and no hook "
        "runs for later alerts of its kind on its stage",
        "Silence alert",
        "acknowledge it, and run no hook for later alerts of its kind on its stage",
        show=False,
        sends=("silence",),
    ),
    ConsoleAction(
        "help", "question_mark", "Help", "every key of this screen", "Help", "every key of this screen"
    ),
    ConsoleAction(
        "toggle_bell",
        None,
        palette="Toggle alert bell",
        palette_help="ring the terminal bell on failures (on/off)",
    ),
    ConsoleAction(
        "quit_console",
        "q",
        "Quit",
        "quit the console: stages keep running; `aerie attach RUN` re-attaches",
        "Quit console",
        "close the console; stages keep running",
        replaces="Quit",
    ),
    ConsoleAction("clear_filter", "escape", "Clear filter", "clear the stage filter", show=False),
)

ACTION = {a.name: a for a in ACTIONS}
CONTROLS = tuple(a for a in ACTIONS if a.mutating)
CONTROL_NAMES = tuple(a.name for a in CONTROLS)
# The ``aerie`` CLI's control verbs (``aerie pause RUN STAGE`` ...), and the flags a verb takes with the
# help the CLI prints for each (``retry --fresh``).
CTL_VERBS = tuple(dict.fromkeys(v for a in CONTROLS for v in a.sends))
CTL_FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    verb: tuple((f, a.flag_help) for a in CONTROLS if a.sends[0] == verb for f in a.flags)
    for verb in CTL_VERBS
}
# What ``--read-only`` refuses, in words: "pause, kill, retry, skip, force".
CONTROL_WORDS = ", ".join(dict.fromkeys(a.sends[0] for a in CONTROLS))
READ_ONLY_NOTE = (
    f"read-only console: the control keys ({' '.join(str(a.key) for a in CONTROLS if a.key)}) are refused and "
    "nothing is sent"
)


def refusal(action: str, stage_id: str | None) -> str:
    """What a read-only console answers to a control action (key or palette): nothing was sent, and how to act."""
    on = f" {stage_id}" if stage_id else ""
    return (
        f"read-only: this console only watches; {ACTION[action].verb}{on} was not sent "
        "(attach without --read-only, or use the control token, to act)"
    )


def wrong_state(action: str, stage_id: str, state: str) -> str:
    """Why the selected stage cannot take ``action`` now (said before anything is sent)."""
    return f"{stage_id} is {state}: {ACTION[action].wrong_state}"


BindingList = list[Binding | tuple[str, str] | tuple[str, str, str]]  # what ``App.BINDINGS`` holds


def bindings() -> BindingList:
    """The app's bindings, in the table's order, then a read-only console's refusals on the control keys
    (``check_action`` makes one of each pair live)."""
    out: BindingList = [
        Binding(a.key, a.name, a.label, show=a.show, tooltip=a.help) for a in ACTIONS if a.key is not None
    ]
    out += [
        Binding(str(a.key), f"read_only('{a.name}')", show=False, tooltip=READ_ONLY_NOTE)
        for a in CONTROLS
        if a.key is not None  # a palette-only control is refused by its action method
    ]
    return out


def palette_entries() -> list[ConsoleAction]:
    """The palette's own entries in order (those that replace a framework command go in its place)."""
    return [a for a in ACTIONS if a.palette and not a.replaces]
