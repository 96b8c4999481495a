"""The executor seam, console side: every decision the console makes from a plan's ``[executor] kind``.

The console's commands ask these functions (which transport reaches a plan's run, whether ``aerie
preflight`` runs a pipeline program here, which checks a kind adds to the ssh preflight, whether the
supervisor's GPU samples are the stages' GPUs) instead of comparing kind strings, so a kind's
behaviour is read, and changed, in one table. The plan itself (which settings a kind requires) is
validated by :mod:`pipeline.run.plan.tables`; this module only reads what a valid plan says.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.run.plan.dag import Executor


@dataclass(frozen=True)
class KindTraits:
    """What one executor kind means to the console."""

    host_required: bool  # runs only on its host: the console always reaches it over ssh
    host_over_ssh: bool  # its ``host``, when the plan names one, is reached over ssh
    local_preflight: str | None  # with no host: the pipeline module ``aerie preflight`` runs on this machine
    host_checks: tuple[str, ...]  # checks it adds to the ssh preflight, after the common ones
    gpus_beside_supervisor: bool  # the supervisor's GPU samples are of the stages' GPUs


LOCAL = KindTraits(False, False, "pipeline.serving.local_preflight", (), True)
TRAITS: dict[str, KindTraits] = {
    "local": LOCAL,  # the stages run with this interpreter: SGLang is checked here
    "ssh": KindTraits(True, True, None, (), True),
    # Slurm: from this login node, or from one reached over ssh; the stages' GPUs are on compute nodes.
    "slurm": KindTraits(False, True, "pipeline.run.hosts.slurm.preflight", ("slurm",), False),
}


def traits(kind: str) -> KindTraits:
    """The kind's traits; a kind this console does not know (a newer run's snapshot) reads as local."""
    return TRAITS.get(kind, LOCAL)


def uses_ssh_transport(ex: Executor) -> bool:
    """Whether the console starts and watches the run over ssh: an ssh plan, or any plan naming a host
    (a Slurm login node); else the supervisor runs on this machine (local, or Slurm from this login node)."""
    return traits(ex.kind).host_required or bool(ex.host)


def ssh_host(ex: Executor) -> str | None:
    """The host ``ex`` names when its kind reaches that host over ssh (an ssh connection can be made to it);
    else None (no host, or a kind that is not reached over ssh)."""
    return ex.host if ex.host and traits(ex.kind).host_over_ssh else None


def local_preflight_module(ex: Executor) -> str | None:
    """The pipeline module ``aerie preflight`` runs on this machine for ``ex``, or None when the ssh
    preflight applies (a host is named) or the kind has no checks of its own here."""
    return None if ex.host else traits(ex.kind).local_preflight


def host_preflight_checks(ex: Executor) -> tuple[str, ...]:
    """The names of the checks ``ex``'s kind adds to the ssh preflight on its host, in order."""
    return traits(ex.kind).host_checks


def gpu_telemetry_applies(kind: str) -> bool:
    """Whether the supervisor's GPU samples, for a run of this kind, are of the GPUs its stages use."""
    return traits(kind).gpus_beside_supervisor
