"""compose.yaml and the Dockerfile agree with the CLI, the settings and each other."""

from __future__ import annotations

import json
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.cli import build_parser
from gateway.config import load_settings

ROOT = Path(__file__).resolve().parent.parent
PORTS = {1883, 5672, 8080}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def instruction(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def serve_overrides(args: Any) -> dict[str, Any]:
    """The overrides `gateway serve` passes to load_settings (see gateway/cli.py serve())."""
    return {
        "host": args.host,
        "mqtt_port": args.mqtt_port,
        "amqp_port": args.amqp_port,
        "admin_port": args.admin_port,
        "data_dir": args.data_dir,
        "redis_url": args.redis_url,
        "appendfsync": args.appendfsync,
        "log_level": args.log_level,
    }


def published(service: dict[str, Any]) -> list[tuple[int, int]]:
    """(host port, container port) for each entry of a service's `ports` (short syntax)."""
    pairs = []
    for entry in service.get("ports", []):
        assert isinstance(entry, str), f"use quoted 'HOST:CONTAINER' strings, not {entry!r}"
        parts = entry.split("/")[0].split(":")
        assert len(parts) in (2, 3), entry  # [ip:]host:container
        pairs.append((int(parts[-2]), int(parts[-1])))
    return pairs


def test_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"redis", "gateway"}


def redis_command(redis: dict[str, Any]) -> list[str]:
    """The redis-server command line the service ends in, after its AOF check: the script
    must parse, and run redis-check-aof --fix on the manifest before the server starts."""
    command = redis["command"]
    assert command[:2] == ["sh", "-c"], command
    script = command[2]
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0, script
    check = "redis-check-aof --fix /data/appendonlydir/appendonly.aof.manifest"
    head, _, server = script.partition("exec docker-entrypoint.sh ")
    assert check in head and "echo y |" in head, script  # it asks before cutting
    return shlex.split(server)


def test_redis_service_is_durable(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command = redis_command(redis)
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] in ("everysec", "always")
    assert "--port" not in command  # the gateway's URL assumes the default 6379

    mounts = {str(v).rsplit(":", 1)[-1]: str(v).rsplit(":", 1)[0] for v in redis["volumes"]}
    assert "/data" in mounts
    # a named volume, declared at top level, so the AOF outlives the container
    assert mounts["/data"] in compose.get("volumes", {})
    image = redis["image"]
    assert image.startswith("redis:")
    major = int(image.split(":")[1].split(".")[0])
    assert major >= 7  # the engine needs Redis functions (7.0+)


def test_redis_healthcheck_gates_the_gateway(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert "ping" in redis["healthcheck"]["test"]
    depends = compose["services"]["gateway"]["depends_on"]
    assert depends["redis"]["condition"] == "service_healthy"


def test_gateway_command_parses_and_matches_ports(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    command = [str(c) for c in gateway["command"]]
    assert command[0] == "gateway"
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve"

    url = urlsplit(args.redis_url)
    assert url.scheme == "redis"
    assert url.hostname == "redis" and url.hostname in compose["services"]
    assert (url.port or 6379) == 6379

    # inside the container the listeners must not be loopback-only
    assert args.host == "0.0.0.0"

    flags = {args.mqtt_port, args.amqp_port, args.admin_port}
    assert flags == PORTS
    pairs = published(gateway)
    assert len(pairs) == len(PORTS)
    assert {container for _, container in pairs} == PORTS
    assert all(host == container for host, container in pairs)

    # and the settings the node would run with are valid and the same
    settings = load_settings(serve_overrides(args), env={})
    assert (settings.mqtt_port, settings.amqp_port, settings.admin_port) == (1883, 5672, 8080)
    assert settings.redis_url == args.redis_url


def test_gateway_is_built_from_this_directory(compose: dict[str, Any]) -> None:
    build = compose["services"]["gateway"]["build"]
    context = build if isinstance(build, str) else build.get("context", ".")
    assert (ROOT / context / "Dockerfile").resolve() == (ROOT / "Dockerfile").resolve()


def test_dockerfile_exposes_the_gateway_ports() -> None:
    exposed = {int(p.split("/")[0]) for args in instruction("EXPOSE") for p in args.split()}
    assert exposed == PORTS


def test_dockerfile_cmd_parses_and_defaults_to_the_exposed_ports() -> None:
    (cmd,) = instruction("CMD")
    argv = json.loads(cmd)  # exec form, so signals reach the gateway
    assert isinstance(argv, list) and argv[0] == "gateway"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve"
    assert args.host == "0.0.0.0"
    settings = load_settings(serve_overrides(args), env={})
    assert {settings.mqtt_port, settings.amqp_port, settings.admin_port} == PORTS


def test_dockerfile_base_image_matches_requires_python() -> None:
    (base, *_) = instruction("FROM")
    version = base.split(":")[1].split("-")[0]
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"
    assert tuple(int(x) for x in version.split(".")[:2]) >= (3, 11)


def test_gateway_command_is_the_installed_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gateway"] == "gateway.cli:main"


def test_dockerfile_copy_sources_exist() -> None:
    copies = instruction("COPY")
    assert copies
    for args in copies:
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile COPYs {source}, which is missing"
