"""Run every off-the-shelf client against a private gateway and print the interop matrix.

    python interop/run.py [--only CLIENT] [--workdir DIR]

Exit status 1 when any supported cell fails, 2 when the gateway itself cannot start.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cross
import scenarios as sc
from driver import DriverError
from envs import Prepared, prepare
from gateway_proc import Gateway
from registry import CLIENTS, ENVS, Client
from report import Cell, write

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
Thunk = Callable[[], str]


def evaluate(client: str, scenario: str, fn: Thunk) -> Cell:
    """Run one cell; every outcome (including a crash or hang of a driver) becomes a cell."""
    try:
        return Cell(client, scenario, "pass", fn())
    except sc.Unsupported as exc:
        return Cell(client, scenario, "unsupported", str(exc))
    except (sc.Fail, DriverError, RuntimeError) as exc:
        return Cell(client, scenario, "fail", str(exc)[:1000])
    except Exception as exc:  # a scenario bug must still show up as a failing cell
        return Cell(client, scenario, "fail", f"{type(exc).__name__}: {exc}"[:1000])


def plan(ctx: sc.Ctx, clients: list[Client]) -> list[tuple[str, str, Thunk]]:
    """Every (client, scenario, thunk) of this run, unsupported ones included."""
    out: list[tuple[str, str, Thunk]] = []
    for c in clients:
        for name, scenario in sc.SCENARIOS.items():
            out.append((c.name, name, cell_thunk(ctx, c, name, scenario)))
        for other in clients:
            if other.protocol != c.protocol:
                out.append((c.name, f"to:{other.name}", cross_thunk(ctx, c, other)))
    return out


def cell_thunk(ctx: sc.Ctx, c: Client, name: str, scenario: sc.Scenario) -> Thunk:
    def run() -> str:
        if c.protocol not in scenario.protocols:
            raise sc.Unsupported(f"{'/'.join(scenario.protocols).upper()}-only scenario")
        if name in c.cannot:
            raise sc.Unsupported(c.cannot[name])
        return scenario.run(ctx, c)

    return run


def cross_thunk(ctx: sc.Ctx, pub: Client, sub: Client) -> Thunk:
    def run() -> str:
        if "cross_publish" in pub.cannot:
            raise sc.Unsupported(pub.cannot["cross_publish"])
        if pub.protocol == "mqtt":
            return cross.mqtt_to_amqp(ctx, pub, sub)
        return cross.amqp_to_mqtt(ctx, pub, sub)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only this client (repeatable)")
    parser.add_argument("--workdir", type=Path, default=HERE / ".work")
    parser.add_argument("--jobs", type=int, default=3, help="cells run in parallel")
    args = parser.parse_args()
    started = time.monotonic()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / ".gitignore").write_text("*\n")  # venvs and node_modules never get committed
    clients = [c for c in CLIENTS if not args.only or c.name in args.only]
    if not clients:
        parser.error(f"no client named {args.only}; known: {[c.name for c in CLIENTS]}")
    needed = {c.env for c in clients} | {sc.QUEUE_READER.env}
    with ThreadPoolExecutor(len(needed)) as pool:
        futures = {name: pool.submit(prepare, ENVS[name], REPO, workdir) for name in needed}
        prepared: dict[str, Prepared] = {name: f.result() for name, f in futures.items()}
    print(f"environments ready in {time.monotonic() - started:.0f} s", flush=True)
    for name, env in sorted(prepared.items()):
        if env.error:
            print(f"  {name}: NOT PREPARED: {env.error}", flush=True)
    gw = Gateway(REPO, workdir)
    try:
        gw.start()
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"gateway failed to start: {exc}", file=sys.stderr)
        gw.stop()
        return 2
    try:
        ctx = sc.Ctx(gw, prepared, f"{os.getpid()}")
        with ThreadPoolExecutor(args.jobs) as pool:
            cells = list(pool.map(lambda p: evaluate(*p), plan(ctx, clients)))
    finally:
        gw.stop()
    scenario_names = list(sc.SCENARIOS) + [f"to:{c.name}" for c in clients]
    md = write(cells, [c.name for c in clients], scenario_names, HERE / "results")
    print(md)
    print(f"run time {time.monotonic() - started:.0f} s", flush=True)
    return 1 if any(c.result == "fail" for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
