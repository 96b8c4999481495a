"""The ``aerie`` command: the console, headless mode and the scriptable CLI, one supervisor.

    aerie demo [--headless]                 the embedded demo run (bundled data, no GPU, no SSH)
    aerie run PLAN [--headless]             create/attach the plan's run, start its supervisor, watch it
                                            --detach: start it with no front end (print the run dir)
    aerie attach RUN [--headless]           watch an existing run (stages keep running either way)
                                            --read-only: watch only; every control key is refused
                                            --compare DIR[,DIR]: overlay those runs' metrics (m)
                                            RUN may be ssh://[user@]host[:port]/path or an ssh PLAN
    aerie preflight PLAN                    ssh plans: bootstrap the host and check it, start nothing;
                                            slurm plans: sinfo, a probe job (shared run dir, imports)
    aerie serve RUN [--port 8000]           the console in a web browser, on 127.0.0.1 (textual-serve)
                                            --read-only, or a view-only token: --view-token-file
    aerie status RUN [--json]               one line (or JSON object) per stage, then the audit log's last entries
    aerie pause|resume|kill|retry|skip|force RUN STAGE   control one stage (retry --fresh clears outputs)
    aerie ack|silence RUN ALERT_ID          acknowledge an alert (silence: no hook for its kind on its stage)
    aerie watch RUN                         headless notifier: run your own hooks for the run's alerts
    aerie plan check PLAN                   validate a plan and print its DAG (--show-defaults: every setting)

Exit codes: 0 ok (headless: every stage succeeded); 1 the run finished with stages not succeeded;
2 usage error, bad plan, unknown run or stage; 3 the action was refused (e.g. pausing a stage
that is not running); 4 the supervisor did not answer in time; 5 the run directory cannot be written or read
on the host (the action was not queued); 130 interrupted (stages keep running).
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

from console import executors
from console.actions import CONTROL_WORDS, CTL_FLAGS, CTL_VERBS
from console.cli_common import (
    aerie_home,
    closed_pipe_exit,
    err,
    open_run,
    remote,
    run_ctl,
    stdout_closed,
)
from console.cli_serve import add_serve_command, bad_theme
from console.cli_status import cmd_status
from console.cli_watch import add_watch_command
from console.transport import LocalTransport, Transport, start_local_run
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.sections import render_settings
from pipeline.run.rundir import audit

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_TIMEOUT = 0, 1, 2, 3, 4


def demo_plan_path() -> Path:
    return Path(str(resources.files("pipeline") / "plans" / "demo.toml"))


def _watch(
    run_root: Path | Transport,
    headless: bool,
    theme: str | None,
    poll_s: float,
    read_only: bool = False,
    via: str = "console",
    compare: str = "",
) -> int:
    transport = LocalTransport(str(run_root)) if isinstance(run_root, Path) else run_root
    if headless:
        from console.headless import run_headless

        return run_headless(transport, read_only=read_only)
    from console.app import AerieApp

    if theme and bad_theme(theme):
        return EXIT_USAGE
    from console.compare import CompareError, open_other

    try:
        others = [open_other(p) for p in compare.split(",") if p.strip()]
    except CompareError as exc:
        err(f"--compare {exc}")
        return EXIT_USAGE
    app = AerieApp(transport, poll_s=poll_s, theme=theme, read_only=read_only, via=via, compare=others)
    rc = app.run()
    return rc or 0


def _start(plan_path: Path, run_dir: Path | None) -> Path | Transport | int:
    try:
        plan = plan_mod.load(plan_path, run_dir=run_dir)
    except plan_mod.PlanError as exc:
        err(str(exc))
        return EXIT_USAGE
    if executors.uses_ssh_transport(plan.executor):
        return _start_remote(plan)
    # local, or slurm from this (login) node: the supervisor runs here (and submits the stages' jobs)
    rc, out, stderr = start_local_run(plan_path, run_dir)
    if rc != 0:
        err(stderr.replace("error: ", "") or f"could not start the run (exit {rc})")
        return EXIT_USAGE
    return Path(out.splitlines()[-1])


def _start_remote(plan: plan_mod.Plan) -> Transport | int:
    from console.ssh.commands import start_remote

    return start_remote(plan)


def cmd_demo(args: argparse.Namespace) -> int:
    run_dir = (
        Path(args.run_dir) if args.run_dir else aerie_home() / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")
    )
    started = _start(demo_plan_path(), run_dir)
    if isinstance(started, int):
        return started
    print(f"aerie demo: run directory {started}", file=sys.stderr)
    return _watch(started, args.headless, args.theme, args.poll)


def cmd_run(args: argparse.Namespace) -> int:
    started = _start(Path(args.plan), Path(args.run_dir) if args.run_dir else None)
    if isinstance(started, int):
        return started
    if args.detach:  # no front end: the supervisor alone watches the run and runs the plan's hooks
        where = (
            str(started) if isinstance(started, Path) else f"ssh://{started.status.host}{started.run_root}"
        )
        print(where)
        print(
            f"started with no front end: the supervisor runs every stage, alert rule and [alerts] command.\n"
            f"  watch:   aerie attach {where}      (or --headless; aerie status {where})\n"
            f"  notify:  aerie watch {where}       (runs your own alert hooks here)",
            file=sys.stderr,
        )
        return EXIT_OK
    return _watch(started, args.headless, args.theme, args.poll)


def cmd_attach(args: argparse.Namespace) -> int:
    if remote(args.run):
        from console.ssh.commands import attach_transport

        t = attach_transport(args.run)
        if isinstance(t, int):
            return t
        return _watch(t, args.headless, args.theme, args.poll, args.read_only, args.via, args.compare)
    run = open_run(args.run)
    if run is None:
        return EXIT_USAGE
    return _watch(run.root, args.headless, args.theme, args.poll, args.read_only, args.via, args.compare)


def cmd_control(args: argparse.Namespace) -> int:
    extra = [flag for flag, _ in CTL_FLAGS[args.action] if getattr(args, flag.lstrip("-").replace("-", "_"))]
    extra += ["--via", "cli", "--who", audit.identity()]
    if remote(args.run):
        from console.ssh.commands import remote_ctl

        res = remote_ctl(args.run, args.action, args.stage, *extra)
        if isinstance(res, int):
            return res
        rc, out, stderr = res.returncode, res.stdout, res.stderr
    else:
        run = open_run(args.run)
        if run is None:
            return EXIT_USAGE
        rc, out, stderr = run_ctl(run, args.action, args.stage, *extra)
    if out.strip():
        print(out.strip())
    if stderr.strip():
        print("aerie: " + stderr.strip(), file=sys.stderr)
    return rc


def cmd_preflight(args: argparse.Namespace) -> int:
    try:
        plan = plan_mod.load(args.plan)
    except plan_mod.PlanError as exc:
        err(str(exc))
        return EXIT_USAGE
    module = executors.local_preflight_module(plan.executor)
    if module is not None:
        # Slurm from this login node: the checks need the Slurm commands, so they run as a pipeline program.
        import subprocess

        from console.transport import child_env

        p = subprocess.run(
            [sys.executable, "-m", module, str(plan.path)],
            env=child_env(),
            stdin=subprocess.DEVNULL,
        )
        return EXIT_OK if p.returncode == 0 else EXIT_USAGE
    from console.ssh.commands import cmd_preflight as preflight

    return preflight(args)


def cmd_plan_check(args: argparse.Namespace) -> int:
    try:
        plan = plan_mod.load(args.plan)
    except plan_mod.PlanError as exc:
        err(str(exc))
        return EXIT_USAGE
    print(plan_mod.render_dag(plan))
    if args.show_defaults:
        print("\nsettings (the plan's values, then every default it left out):\n")
        print(render_settings(plan.settings, plan.raw))
    print(f"\nok: {len(plan.stages)} stages")
    if not args.deep:
        return EXIT_OK
    # The EAGLE-3 chain needs torch and transformers: it runs as its own process (the console
    # imports only the run model), on this machine; `aerie preflight` runs it on an ssh plan's host.
    import subprocess

    from console.transport import child_env

    if plan.executor.host:
        print(
            f"note: {plan.path} runs on {plan.executor.host}; this checks the target as found on this machine "
            "(aerie preflight runs the same check on the host)"
        )
    p = subprocess.run([sys.executable, "-m", "pipeline.eagle3.chain_check", str(plan.path)], env=child_env())
    return EXIT_OK if p.returncode == 0 else EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="aerie",
        description="Operations console for EAGLE-3 draft-model training runs.",
        epilog="Exit codes:" + __doc__.split("Exit codes:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_watch_commands(sub)
    add_serve_command(sub)
    _add_control_commands(sub)
    add_watch_command(sub)
    _add_plan_commands(sub)
    return ap


def _add_watch_options(p: argparse.ArgumentParser) -> None:
    """The options of every command that watches a run: --headless, --theme, --poll."""
    p.add_argument(
        "--headless", action="store_true", help="no UI: print progress lines; exit 0 iff all succeeded"
    )
    p.add_argument("--theme", default=None, help="console theme")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between reads of the run directory")


def _add_watch_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """demo, run and attach: the commands that start or find a run, then watch it."""
    p = sub.add_parser("demo", help="run the embedded demo (bundled data, no GPU, no SSH)")
    p.add_argument("--run-dir", help="run directory (default: a new one under $AERIE_HOME/runs)")
    _add_watch_options(p)
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("run", help="start (or re-attach to) the run a plan describes")
    p.add_argument("plan")
    p.add_argument("--run-dir", help="override the plan's [run] dir")
    p.add_argument(
        "--detach",
        action="store_true",
        help="start the run with no front end (its supervisor only), print the run dir and how to attach",
    )
    _add_watch_options(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("attach", help="watch an existing run")
    p.add_argument("run")
    _add_watch_options(p)
    p.add_argument(
        "--read-only",
        action="store_true",
        help=f"watch only: every control action ({CONTROL_WORDS}) is refused, nothing is sent",
    )
    p.add_argument("--via", choices=("console", "browser"), default="console", help=argparse.SUPPRESS)
    p.add_argument(
        "--compare",
        default="",
        metavar="RUN_DIR[,…]",
        help="other runs whose metrics the metrics view (m) draws beside this run's: run directories here, "
        "or ssh://[user@]host[:port]/path (comma-separated)",
    )
    p.set_defaults(fn=cmd_attach)


def _add_control_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """status and the control verbs (pause, resume, kill, retry, skip, force) on one run's stages."""
    p = sub.add_parser(
        "status",
        help="print every stage's state",
        description="Every stage (state, attempt, progress, reason; ⚑ an armed force), then the supervisor "
        "(running, silent or dead, and its alerts), the run's projection (progress, finish, GPU-hours, disk at "
        "finish), the anomalies going on now with their evidence, and the audit log's last entries. A state.json "
        "that cannot be read is one warning line, the stages then shown from their own files.",
    )
    p.add_argument("run")
    p.add_argument(
        "--json",
        action="store_true",
        help='a first {"error": …} line when state.json cannot be read; one JSON object per stage; then '
        '{"projection": …, "supervisor": …}, {"anomalies": […]} and {"audit": …} lines',
    )
    p.set_defaults(fn=cmd_status)

    for verb in CTL_VERBS:  # the console's action table: the same verbs, flags and words
        on_alert = verb in ("ack", "silence")  # an alert of the run (aerie status lists their ids)
        p = sub.add_parser(verb, help=f"{verb} one {'alert' if on_alert else 'stage'}")
        p.add_argument("run")
        p.add_argument("stage", metavar="ALERT_ID" if on_alert else "STAGE")
        for flag, flag_help in CTL_FLAGS[verb]:
            p.add_argument(flag, action="store_true", help=flag_help)
        p.set_defaults(fn=cmd_control, action=verb)


def _add_plan_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """preflight and plan check: the commands that check a plan, starting nothing."""
    p = sub.add_parser(
        "preflight",
        help="ssh plans: bootstrap the host and check it; slurm plans: sinfo and a "
        "probe job (starts nothing)",
    )
    p.add_argument("plan")
    p.set_defaults(fn=cmd_preflight)

    p = sub.add_parser("plan", help="plan tools")
    psub = p.add_subparsers(dest="plan_cmd", required=True)
    pc = psub.add_parser("check", help="validate a plan and print its DAG")
    pc.add_argument("plan")
    pc.add_argument(
        "--deep",
        action="store_true",
        help="also check the EAGLE-3 chain against the target's config and tokenizer (no weights loaded): "
        "architecture, aux layers, draft config, draft vocab, chat template, disk, GPU memory per rank",
    )
    pc.add_argument(
        "--show-defaults",
        action="store_true",
        help="also print every settings section as resolved: the plan's values and the defaults it left out",
    )
    pc.set_defaults(fn=cmd_plan_check)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # here, not at exit: a reader that went away is seen below
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if stdout_closed():  # the SIGPIPE convention: quiet (another pipe, a socket: a real error)
            return closed_pipe_exit()
        raise


if __name__ == "__main__":
    raise SystemExit(main())
