"""SSH round trips: one persistent agent channel vs a command per channel vs a fresh ``ssh`` per command.

    python bench/ssh_rtt.py [--n 40] [--drops 5] [--down 2.0] [--link loopback|veth|bad]

Starts a private OpenSSH sshd on 127.0.0.1 (``tests/sshd.py``: own host key, authorised test key)
and a small run directory, then measures, all in this one run:

* **agent ping** — ``SshTransport.ping()``: one JSON line each way on the live agent channel;
* **agent poll** — ``read_many`` of state.json + 2 event files from their offsets (a console tick);
* **exec per command** — ``conn.run("true")`` on the live connection: a new channel and the
  user's login shell each time (what ``ssh host cmd`` costs without the handshake);
* **fresh ssh per command** — ``ssh -p PORT host true`` as a subprocess: handshake + auth + shell
  (the baseline: what scripts without a persistent connection pay);
* **re-attach after a drop** — sshd and its connections killed, restarted after ``--down``
  seconds; time from the restart until a poll succeeds again, with the console's default
  reconnect backoff (0.5 s doubling to 15 s) and with a 0.1 s one (the floor: handshake + agent start).

Prints medians, p90 and p99 in ms and how many times faster than the baseline each is.

``--link veth`` puts sshd in a private network namespace behind a veth pair (tests/netlink.py; root
needed); ``--link bad`` also applies ``tc netem`` delay 150 ms ± 30 ms and 2 % loss each way (the bad
link of docs/reliability.md; the kernel needs ``sch_netem``), and reports the console's poll latency
p50/p99 over it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from impaired_proxy import ImpairedProxy  # noqa: E402
from netlink import BadLink  # noqa: E402
from sshd import LoopbackSshd  # noqa: E402

from console.ssh.connection import HostConnection, SshTarget  # noqa: E402
from console.ssh.transport import RemoteLayout, SshTransport  # noqa: E402
from pipeline.run.plan import dag as plan_mod  # noqa: E402
from pipeline.run.supervise.run_setup import create_run  # noqa: E402

PLAN = """
[run]
name = "bench"
dir = "run"
[[stage]]
id = "a"
command = "true"
[[stage]]
id = "b"
command = "true"
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def timed(n: int, fn) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def reattach(
    server: LoopbackSshd, target: SshTarget, layout: RemoteLayout, backoff: tuple[float, float], down_s: float
) -> float:
    conn = HostConnection(target, backoff_s=backoff)
    transport = SshTransport(conn, layout)
    reqs = [("state.json", 0)]
    await transport.read_many(reqs)
    server.drop()
    await asyncio.sleep(down_s)
    server.start()
    t0 = time.perf_counter()
    while True:
        try:
            await transport.read_many(reqs)
            break
        except Exception:  # noqa: BLE001 - NotConnected until the reconnect lands
            await asyncio.sleep(0.01)
    dt = (time.perf_counter() - t0) * 1000
    await transport.close()
    return dt


async def main(args: argparse.Namespace) -> None:
    if args.link == "loopback":
        await bench(args, None)
        return
    with BadLink() as link:
        if args.link == "bad" and not link.impair(150, 30, 2.0):
            # No sch_netem in this kernel: the same impairment made by a user-space relay (tests/impaired_proxy.py).
            print(f"--link bad: {link.netem_error}; using the user-space relay instead")
            await bench(args, link, relay=True)
            return
        await bench(args, link)


async def bench(args: argparse.Namespace, link: BadLink | None, relay: bool = False) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="aerie-ssh-bench-"))
    server = (
        LoopbackSshd(tmp / "sshd", listen=link.remote, netns=link.ns) if link else LoopbackSshd(tmp / "sshd")
    )
    server.start()
    proxy = ImpairedProxy(server.listen, server.port, 150, 30, 2.0).__enter__() if relay else None
    try:
        host, port = ("127.0.0.1", proxy.port) if proxy else (server.listen, server.port)
        kh = tmp / "known_hosts"
        kh.write_text(f"[{host}]:{port} {server.host_pubkey()}\n")
        (tmp / "plan.toml").write_text(PLAN)
        run = create_run(plan_mod.load(tmp / "plan.toml", run_dir=tmp / "run"), tmp / "run")
        for sid in ("a", "b"):
            run.stage(sid).events.write_text('{"type":"started","t":1}\n' * 50)
        (run.root / "state.json").write_text('{"stages": []}\n' * 20)
        target = SshTarget(
            host=host, port=port, user=server.user, identity=str(server.client_key), known_hosts=str(kh)
        )
        layout = RemoteLayout(root=str(run.root), python=sys.executable, pythonpath=str(ROOT))
        conn = HostConnection(target)
        t0 = time.perf_counter()
        await conn.connect()
        connect_ms = (time.perf_counter() - t0) * 1000
        transport = SshTransport(conn, layout)
        t0 = time.perf_counter()
        await transport.ping()  # starts the agent
        agent_start_ms = (time.perf_counter() - t0) * 1000
        size = run.stage("a").events.stat().st_size
        poll = [("state.json", 0), ("stages/a/events.jsonl", size), ("stages/b/events.jsonl", size)]
        rows: dict[str, list[float]] = {}
        rows["agent ping (persistent channel)"] = await timed(args.n, transport.ping)
        rows["agent poll: 3 files from offsets"] = await timed(args.n, lambda: transport.read_many(poll))
        rows["exec per command on the live connection"] = await timed(args.n, lambda: conn.run("true"))

        argv = server.ssh_argv(kh)
        argv[argv.index("-p") + 1], argv[-1] = str(port), f"{server.user}@{host}"  # through the relay if any
        argv.append("true")

        async def fresh() -> None:
            p = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL)
            rc = await p.wait()
            assert rc == 0, rc

        rows["fresh `ssh host true` per command (baseline)"] = await timed(args.n, fresh)
        await transport.close()

        base = statistics.median(rows["fresh `ssh host true` per command (baseline)"])
        where = (
            "loopback"
            if link is None
            else f"veth into a network namespace ({(proxy.impairment if proxy else link.impairment) or 'no impairment'})"
        )
        print(
            f"OpenSSH sshd over {where}, user {server.user}; n={args.n}; connect {connect_ms:.0f} ms, "
            f"agent start {agent_start_ms:.0f} ms"
        )
        print(f"{'what':<48} {'median ms':>10} {'p90 ms':>8} {'p99 ms':>8} {'baseline/this':>14}")
        for name, xs in rows.items():
            m = statistics.median(xs)
            print(f"{name:<48} {m:>10.2f} {pct(xs, 0.9):>8.2f} {pct(xs, 0.99):>8.2f} {base / m:>13.0f}x")

        for label, backoff in (("default backoff 0.5 s..15 s", (0.5, 15.0)), ("backoff 0.1 s", (0.1, 0.5))):
            ts = [await reattach(server, target, layout, backoff, args.down) for _ in range(args.drops)]
            print(
                f"re-attach after a drop ({label}; sshd down {args.down:g} s): median {statistics.median(ts):.0f} ms, "
                f"max {max(ts):.0f} ms over {args.drops} drops (from sshd back up to a successful poll)"
            )
    finally:
        if proxy is not None:
            proxy.__exit__()
        server.drop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--drops", type=int, default=5)
    ap.add_argument("--down", type=float, default=2.0)
    ap.add_argument(
        "--link",
        choices=("loopback", "veth", "bad"),
        default="loopback",
        help="loopback (default), a veth into a network namespace, or that veth with netem impairment",
    )
    asyncio.run(main(ap.parse_args()))
