"""The architecture, checked: no import cycles (of modules or of packages), the layers of ``pipeline``
in their order, the console's view of ``pipeline`` is the run model only, stages never import each other,
and the container side never imports the console."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What the console may import from pipeline/: the run model's data modules (plan, events, run dir, the
# log index, the preflight check report) and the SGLang log parser for the board's server line; ``pipeline`` itself only to find
# the package to upload to a host.
CONSOLE_ALLOWED = {
    "pipeline",
    "pipeline.run.plan.dag",
    "pipeline.run.plan.sections",  # the plan's typed settings (aerie plan check --show-defaults)
    "pipeline.run.plan.schema",  # PlanError's home
    "pipeline.run.rundir.events",
    "pipeline.run.rundir.layout",
    "pipeline.run.rundir.logscan",
    "pipeline.run.rundir.stage_row",  # a stage's state.json row and its states: one definition
    "pipeline.run.rundir.protocol",  # the typed events and their one decoder
    "pipeline.run.rundir.stage_reducer",  # the one reducer from a stage's events to its facts
    "pipeline.run.hosts.checks",  # the SSH preflight's report is the one every preflight prints
    "pipeline.run.projection.compute",  # the run's finish, GPU-hours and disk at finish: one computation
    "pipeline.run.projection.text",  # … and its words, the same in the header and in aerie status
    "pipeline.run.rundir.audit",  # the audit log's entries: one format for the CLI and the console
    "pipeline.run.supervise.force_text",  # what `force` will do and when: the supervisor's answer, the console's question
    "pipeline.run.rundir.state_file",  # state.json or, when corrupt, one line and rows from the stages' files
    "pipeline.run.rundir.growth",  # the rotated generations' names and how many are kept: one definition
    "pipeline.run.alerts.record",  # the run's alert records: raised on the host, read by every front end
    "pipeline.run.alerts.hooks",  # aerie watch runs the user's hooks with the host's runner (none in console/)
    "pipeline.run.rundir.event_lines",  # whole lines, over-long and torn lines: the supervisor's reader's rules
    "pipeline.serving.sglang_log",
}


def modules() -> dict[str, Path]:
    out = {}
    for top in ("pipeline", "console"):
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module ``path`` imports, anywhere in the file (function-level and
    TYPE_CHECKING imports included: a cycle hidden in a function is still a cycle)."""

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] in ("pipeline", "console") and (r := resolve(n)):
                found.add(r)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    g = {m: imports_of(p, known) - {m} for m, p in known.items()}
    # A package's __init__ runs whenever a submodule is imported: a parent package is an implicit edge.
    for m in g:
        parent = m.rpartition(".")[0]
        if parent in g and parent not in ("pipeline", "console"):
            g[m].add(parent)
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        colour[v] = 1
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if colour.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in colour and (c := visit(w)):
                return c
        stack.pop()
        colour[v] = 2
        return None

    for v in sorted(g):
        if v not in colour and (c := visit(v)):
            return c
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_pipeline_or_console() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_console_imports_only_the_run_model_from_pipeline() -> None:
    g = graph()
    bad = {
        f"{m} imports {d}"
        for m, deps in g.items()
        if m.startswith("console")
        for d in deps
        if d.startswith("pipeline") and d not in CONSOLE_ALLOWED
    }
    assert not bad, sorted(bad)


# The alert rules' thresholds (pipeline/run/plan/sections.py AlertsSection): read only where a rule is evaluated.
RULE_THRESHOLDS = {
    "stall_minutes",
    "diverge_factor",
    "diverge_window",
    "accept_window",
    "accept_drop",
    "gpu_idle_minutes",
    "gpu_idle_util",
    "throughput_fraction",
    "throughput_window",
    "accept_gap",
}
# What running a hook takes: its AERIE_ALERT_* environment, a shell, a wait bounded by a timeout.
HOOK_MARKS = ("AERIE_ALERT_", "/bin/sh")


def rules_or_hooks_in(source: str) -> list[str]:
    """What in ``source`` evaluates an alert rule or runs a hook: a threshold read, a ``*Rule`` class, a
    function that builds a hook's environment or starts a shell."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in RULE_THRESHOLDS
            and isinstance(node.ctx, ast.Load)
        ):
            found.append(f"line {node.lineno}: reads the rule threshold {node.attr}")
        elif (
            isinstance(node, ast.ClassDef)
            and node.name.endswith(("Rule", "Watcher"))
            and "Alert" in ast.unparse(node)
        ):
            found.append(f"line {node.lineno}: class {node.name}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(HOOK_MARKS)
        ):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Name | ast.Attribute) and _name_of(node) in SHELL_STARTERS:
            found.append(f"line {node.lineno}: {_name_of(node)}")
        elif isinstance(node, ast.Attribute) and ast.unparse(node) in ("os.system", "os.popen"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.keyword) and node.arg == "shell" and ast.unparse(node.value) != "False":
            found.append(f"line {node.value.lineno}: shell={ast.unparse(node.value)}")
        elif (
            isinstance(node, ast.Subscript)
            and _string_key(node) in RULE_THRESHOLDS
            and isinstance(node.ctx, ast.Load)
        ):
            found.append(f"line {node.lineno}: reads the rule threshold [{_string_key(node)!r}]")
        elif (
            isinstance(node, ast.Call)
            and _name_of(node.func) == "get"
            and node.args
            and _string_key(node) in RULE_THRESHOLDS
        ):
            found.append(f"line {node.lineno}: reads the rule threshold get({_string_key(node)!r})")
    return found


# What starts a shell or another program without a fixed argv: a hook runner's tools.
SHELL_STARTERS = frozenset({"create_subprocess_shell", "create_subprocess_exec", "Popen"})


def _name_of(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _string_key(node: ast.Subscript | ast.Call) -> str:
    key = node.slice if isinstance(node, ast.Subscript) else node.args[0]
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else ""


def test_the_rule_and_hook_finder_finds_them() -> None:
    assert rules_or_hooks_in("def f(r):\n    return r.stall_minutes * 60\n")
    assert rules_or_hooks_in("env = {'AERIE_ALERT_KIND': 'x'}\n")
    assert rules_or_hooks_in("import subprocess\nsubprocess.run(['/bin/sh', '-c', cmd])\n")
    assert rules_or_hooks_in("class LossRule:\n    def feed(self) -> Alert: ...\n")
    assert rules_or_hooks_in("import subprocess\nsubprocess.run(cmd, shell=True)\n")
    assert rules_or_hooks_in("import os\nos.system(cmd)\n")
    assert rules_or_hooks_in("async def f(c):\n    await asyncio.create_subprocess_exec('sh', '-c', c)\n")
    assert rules_or_hooks_in("def late(cfg):\n    return cfg['stall_minutes']\n")
    assert rules_or_hooks_in("def idle(cfg):\n    return cfg.get('gpu_idle_util', 5)\n")
    assert not rules_or_hooks_in("from pipeline.run.alerts.hooks import run_hook\nrun_hook(c, env, 5)\n")
    assert not rules_or_hooks_in("def hide(b):\n    return b.system\n")


def test_no_alert_rule_or_hook_runner_lives_in_the_console() -> None:
    """Issue 44: the executing host evaluates every rule and runs the plan's hooks (pipeline/run/alerts/); the
    console only displays the records and sends ack/silence (``aerie watch`` calls pipeline's runner)."""
    allowed = {
        "console/browser_server.py": "create_subprocess_shell",  # starts the console's own pty shell
        "console/transport.py": "create_subprocess_exec",  # runs pipeline's ctl with a fixed argv
    }
    bad = []
    for p in sorted((ROOT / "console").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        bad += [f"{rel} {hit}" for hit in rules_or_hooks_in(p.read_text()) if allowed.get(rel) not in hit]
    assert not bad, bad


def test_pipeline_never_imports_the_console() -> None:
    g = graph()
    bad = {
        f"{m} imports {d}"
        for m, deps in g.items()
        if m.startswith("pipeline")
        for d in deps
        if d.startswith("console")
    }
    assert not bad, sorted(bad)


# The layers of pipeline/, bottom first (docs/design.md, "The tree"): a module may import its own layer and
# the layers below, never one above. manifests/ is the stages' contracts, read by everything above it. run/ is what every run needs whatever it runs; data/ and serving/ are
# libraries on it (side by side: neither imports the other); eagle3/ builds on data/; drafts/ (one package
# per draft method) builds on eagle3/; stages/ are the programs that use them all.
LAYERS: dict[str, int] = {
    # the stages' manifests (typed contracts, stdlib only): below run/, whose disk budget reads them
    "pipeline.manifests": -1,
    "pipeline": 0,  # the package itself (its __init__)
    "pipeline.tested_versions": 0,
    "pipeline.run": 0,
    "pipeline.data": 1,
    "pipeline.serving": 1,
    "pipeline.eagle3": 2,
    "pipeline.drafts": 3,
    "pipeline.stages": 4,
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "console":
        return "console"
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def test_every_pipeline_package_has_a_layer() -> None:
    unplaced = {layer_of(m) for m in modules() if m.startswith("pipeline")} - set(LAYERS) - {"pipeline.plans"}
    assert not unplaced, f"add {sorted(unplaced)} to LAYERS (and to docs/design.md's tree)"


def layer_violations(g: dict[str, set[str]]) -> set[str]:
    bad = set()
    for m, deps in g.items():
        if not m.startswith("pipeline"):
            continue
        for d in deps:
            a, b = layer_of(m), layer_of(d)
            if a == b or not d.startswith("pipeline"):
                continue
            if LAYERS.get(b, 99) >= LAYERS.get(a, 99):
                bad.add(f"{m} ({a}) imports {d} ({b})")
    return bad


def test_the_layer_check_finds_an_upward_import() -> None:
    assert layer_violations({"pipeline.run.supervise.budget": {"pipeline.data.model_assets"}}) == {
        "pipeline.run.supervise.budget (pipeline.run) imports pipeline.data.model_assets (pipeline.data)"
    }
    assert layer_violations({"pipeline.data.x": {"pipeline.serving.y"}}), (
        "side by side: neither imports the other"
    )
    assert not layer_violations({"pipeline.eagle3.x": {"pipeline.data.y", "pipeline.run.z"}})


def test_each_layer_imports_only_the_layers_below_it() -> None:
    bad = layer_violations(graph())
    assert not bad, sorted(bad)


def test_no_import_cycle_between_packages() -> None:
    g = graph()
    packages: dict[str, set[str]] = {}
    for m, deps in g.items():
        packages.setdefault(layer_of(m), set()).update(
            layer_of(d) for d in deps if layer_of(d) != layer_of(m)
        )
    cycle = find_cycle(packages)
    assert cycle is None, "package cycle: " + " -> ".join(cycle or [])


# pipeline/run/'s sub-packages, bottom first (pipeline/run/__init__.py): the plan knows nothing of a run
# directory; the run directory's files know nothing of hosts; hosts and the projection are read by the
# stage-side helpers and the supervisor, never the other way round.
RUN_LAYERS: dict[str, int] = {
    "pipeline.run": -1,  # the package's __init__: a docstring, imported with every sub-package
    "pipeline.run.plan": 0,
    "pipeline.run.rundir": 1,
    "pipeline.run.hosts": 2,
    "pipeline.run.projection": 2,
    "pipeline.run.stage_side": 3,
    "pipeline.run.alerts": 3,  # the alert rules, records and hooks: run by the supervisor
    "pipeline.run.supervise": 4,
}


def run_part_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["pipeline", "run"]:
        return None
    return ".".join(parts[:3]) if len(parts) > 2 else "pipeline.run"


def run_layer_violations(g: dict[str, set[str]]) -> set[str]:
    bad = set()
    for m, deps in g.items():
        a = run_part_of(m)
        for d in deps:
            b = run_part_of(d)
            if a is None or b is None or a == b:
                continue
            if RUN_LAYERS.get(b, 99) >= RUN_LAYERS.get(a, 99):
                bad.add(f"{m} ({a}) imports {d} ({b})")
    return bad


def test_every_run_module_lives_in_a_placed_sub_package() -> None:
    loose = [
        m for m in modules() if run_part_of(m) == "pipeline.run" and m != "pipeline.run"
    ]  # a module directly in run/ would have no layer
    unplaced = {run_part_of(m) for m in modules()} - set(RUN_LAYERS) - {None}
    assert not loose and not unplaced, f"place {loose or sorted(unplaced)} in RUN_LAYERS' sub-packages"


def test_the_run_layer_check_finds_an_upward_import() -> None:
    assert run_layer_violations({"pipeline.run.rundir.events": {"pipeline.run.hosts.procs"}}) == {
        "pipeline.run.rundir.events (pipeline.run.rundir) imports pipeline.run.hosts.procs (pipeline.run.hosts)"
    }
    assert run_layer_violations({"pipeline.run.hosts.gpus": {"pipeline.run.projection.compute"}}), (
        "side by side"
    )
    assert not run_layer_violations({"pipeline.run.supervise.ctl": {"pipeline.run.hosts.procs"}})


def test_run_sub_packages_import_only_those_below_them() -> None:
    bad = run_layer_violations(graph())
    assert not bad, sorted(bad)


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["pipeline", "stages"] else None


def test_no_stage_imports_another_stage() -> None:
    g = graph()
    bad = {
        f"{m} imports {d}"
        for m, deps in g.items()
        if (s := stage_of(m))
        for d in deps
        if stage_of(d) not in (None, s)
    }
    assert not bad, sorted(bad)


def test_libraries_and_the_run_machinery_never_import_a_stage() -> None:
    g = graph()
    bad = {
        f"{m} imports {d}"
        for m, deps in g.items()
        if m.split(".")[:2] in (["pipeline", k] for k in ("run", "data", "eagle3", "drafts", "serving"))
        for d in deps
        if d.startswith("pipeline.stages")
    }
    assert not bad, sorted(bad)


def test_every_pipeline_subpackage_says_what_it_is() -> None:
    # The tree is the design: each sub-package and module opens with a docstring saying its role.
    missing = [
        m
        for m, p in modules().items()
        if m.startswith("pipeline")
        and ast.get_docstring(ast.parse(p.read_text())) is None
        and p.name != "__main__.py"
    ]
    assert not missing, missing


def test_a_module_over_450_lines_says_why_at_its_top() -> None:
    """Large files are split where they hold several jobs; one that stays big says why in its docstring."""
    silent = []
    for name, path in modules().items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > 450 and "Over 450 lines" not in doc:
            silent.append(f"{name} ({lines} lines)")
    assert not silent, f"split these, or say why they stay whole: {silent}"


# bench/ is a harness over the project: it may import pipeline/ and console/, they never import it, its modules
# form no cycle, and bench/gpu's harness (the device runner every GPU experiment shares) imports no experiment.
BENCH_GPU_HARNESS = {
    "bench.gpu",
    "bench.gpu.runner",
    "bench.gpu.staging",
    "bench.gpu.server",
    "bench.gpu.results",
}
BENCH_GPU_HARNESS |= {"bench.gpu.common"}


def bench_import_graph() -> dict[str, set[str]]:
    """Every module of bench/, pipeline/ and console/ -> the project modules it imports (function-level included),
    with a package's ``__init__`` as an implicit edge of its submodules."""
    known: dict[str, Path] = {}
    for top in ("bench", "pipeline", "console"):
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            known[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    g: dict[str, set[str]] = {}
    for m, path in known.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found |= {
                r for n in names if n.split(".")[0] in ("bench", "pipeline", "console") and (r := resolve(n))
            }
        parent = m.rpartition(".")[0]
        g[m] = (found | ({parent} if parent in known and parent.count(".") else set())) - {m}
    return g


def test_bench_has_no_import_cycle_and_nothing_imports_bench() -> None:
    g = bench_import_graph()
    assert "bench.gpu.runner" in g and "bench.record" in g, "the graph must see bench/ (and bench/gpu/)"
    in_bench = {
        m: {d for d in deps if d.startswith("bench")} for m, deps in g.items() if m.startswith("bench")
    }
    cycle = find_cycle(in_bench)
    assert cycle is None, "import cycle in bench/: " + " -> ".join(cycle or [])
    upward = sorted(
        f"{m} imports {d}"
        for m, deps in g.items()
        if not m.startswith("bench")
        for d in deps
        if d.startswith("bench")
    )
    assert not upward, upward


def test_the_gpu_harness_imports_no_experiment() -> None:
    g = bench_import_graph()
    bad = sorted(
        f"{m} imports {d}"
        for m in BENCH_GPU_HARNESS
        for d in g[m]
        if d.startswith("bench") and d not in BENCH_GPU_HARNESS
    )
    assert not bad, bad


# No function over 80 lines in console/, pipeline/ or bench/ (def to last line, docstring included): a longer
# one holds several steps that want names. The allow-list is at most 3 entries, each with why it stays whole.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def long_functions(source: str, where: str) -> list[str]:
    """``where:line name (N lines)`` for each function in ``source`` over :data:`MAX_FUNCTION_LINES`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_the_length_check_finds_a_long_function_nested_or_not() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n", "m.py") == ["m.py:1 f (81 lines)"]
    assert long_functions(
        f"class C:\n    async def g(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n", "c.py"
    )
    assert not long_functions("def f():\n" + "\n".join(body.splitlines()[:-1]) + "\n", "m.py")


def test_no_function_over_80_lines_in_console_pipeline_or_bench() -> None:
    assert len(LONG_FUNCTIONS_ALLOWED) <= 3, "the allow-list is for at most 3 functions"
    too_long = []
    for top in ("console", "pipeline", "bench"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            for hit in long_functions(p.read_text(), rel):
                if f"{rel} {hit.split(' ')[1]}" not in LONG_FUNCTIONS_ALLOWED:
                    too_long.append(hit)
    assert not too_long, f"split these into named steps: {too_long}"
