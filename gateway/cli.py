"""The `gateway` command: `serve` runs a node; `queue ...` talks to a node's admin API."""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import logging
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gateway import cpus
from gateway.config import APPENDFSYNC, ConfigError, load_settings
from gateway.engine.library import RedisUnsuitable
from gateway.logs import setup_logging
from gateway.redis_server import EmbeddedRedis, RedisStartError, memory_limit
from gateway.spark.cli import add_pipeline_parser

DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a gateway node")
    serve.add_argument("--config", help="TOML file with [server], [[users]], [[queues]] ...")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--mqtt-port", type=int, help="MQTT listener port (default 1883)")
    serve.add_argument("--amqp-port", type=int, help="AMQP 1.0 listener port (default 5672)")
    serve.add_argument("--admin-port", type=int, help="admin HTTP port (default 8080)")
    serve.add_argument("--mqtt-tls-port", type=int, help="MQTT over TLS port (default 8883)")
    serve.add_argument("--amqp-tls-port", type=int, help="AMQP over TLS port (default 5671)")
    serve.add_argument(
        "--mqtt-ws-port",
        type=int,
        help="MQTT over WebSocket port, path /mqtt (default -1: off; 8000 is usual)",
    )
    serve.add_argument(
        "--mqtt-wss-port",
        type=int,
        help="MQTT over secure WebSocket port, path /mqtt, with --tls-cert (default -1: off)",
    )
    serve.add_argument(
        "--spool-quota-bytes", type=int, help="broker-wide message spool quota (0: none)"
    )
    serve.add_argument("--tls-cert", help="PEM certificate chain: enables the TLS listeners")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument("--data-dir", help="embedded Redis data directory (.gateway-data)")
    serve.add_argument("--redis-url", help="use this Redis (7.0+) instead of an embedded one")
    serve.add_argument("--appendfsync", choices=APPENDFSYNC, help="embedded Redis AOF fsync")
    serve.add_argument(
        "--no-pin-cpus",
        dest="pin_cpus",
        action="store_const",
        const=False,
        help="let the node and the embedded Redis run on any CPU (default: separate halves)",
    )
    serve.add_argument("--log-level", help="DEBUG, INFO, WARNING ...")

    add_pipeline_parser(sub)

    queue = sub.add_parser("queue", help="manage queues through the admin API")
    queue.add_argument("--admin-url", default=DEFAULT_ADMIN_URL, help="admin API base URL")
    queue.add_argument(
        "--user",
        default=os.environ.get("GATEWAY_ADMIN_USER"),
        help="admin API user (env GATEWAY_ADMIN_USER; password from GATEWAY_ADMIN_PASSWORD)",
    )
    qsub = queue.add_subparsers(dest="queue_command", required=True)
    qsub.add_parser("list", help="list queues")
    show = qsub.add_parser("show", help="show one queue")
    show.add_argument("name")
    delete = qsub.add_parser("delete", help="delete a queue and its messages")
    delete.add_argument("name")
    create = qsub.add_parser("create", help="create a queue")
    create.add_argument("name")
    create.add_argument("--access-type", choices=("exclusive", "non-exclusive"))
    create.add_argument(
        "--subscription",
        action="append",
        default=[],
        metavar="PATTERN",
        help="topic subscription (Solace syntax); repeatable",
    )
    create.add_argument("--max-message-size", type=int)
    create.add_argument("--max-spool-bytes", type=int)
    create.add_argument("--max-messages", type=int)
    create.add_argument("--non-durable", action="store_true", help="a non-durable queue")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "pipeline":
        return pipeline(args)
    return queue_command(args)


def serve(args: argparse.Namespace) -> int:
    overrides = {
        "host": args.host,
        "mqtt_port": args.mqtt_port,
        "amqp_port": args.amqp_port,
        "admin_port": args.admin_port,
        "mqtt_tls_port": args.mqtt_tls_port,
        "amqp_tls_port": args.amqp_tls_port,
        "mqtt_ws_port": args.mqtt_ws_port,
        "mqtt_wss_port": args.mqtt_wss_port,
        "spool_quota_bytes": args.spool_quota_bytes,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "data_dir": args.data_dir,
        "redis_url": args.redis_url,
        "appendfsync": args.appendfsync,
        "pin_cpus": args.pin_cpus,
        "log_level": args.log_level,
    }
    try:
        settings = load_settings(overrides, config_path=args.config)
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    from gateway.server import run  # after logging, so import-time logs are formatted

    embedded = None
    try:
        if settings.redis_url is None:
            halves = cpus.split(cpus.usable()) if settings.pin_cpus else None
            embedded = EmbeddedRedis(
                settings.data_dir,
                settings.appendfsync,
                halves[1] if halves else None,
                memory_limit(settings.redis_max_memory_percent),
            )
            embedded.start()
            logging.getLogger("gateway").info(
                "embedded redis-server on %s (appendfsync %s, maxmemory %s)",
                embedded.socket,
                settings.appendfsync,
                f"{embedded.maxmemory >> 20} MiB" if embedded.maxmemory else "none",
            )
            if halves is not None and cpus.pin(halves[0]):
                logging.getLogger("gateway").info(
                    "node on CPUs %s, embedded redis-server on CPUs %s",
                    ",".join(map(str, sorted(halves[0]))),
                    ",".join(map(str, sorted(os.sched_getaffinity(embedded.pid)))),
                )
        if embedded is None:
            run(settings, settings.redis_url)  # type: ignore[arg-type]
        else:
            run(settings, embedded.url, embedded.supervise)
    except (RedisStartError, RedisUnsuitable, ConfigError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def pipeline(args: argparse.Namespace) -> int:
    """Spark jobs: imported only here, as they need the optional [spark] extra."""
    try:
        from gateway.spark.jobs import run_pipeline
    except ImportError as exc:
        print(
            f"gateway: the pipeline needs the [spark] extra ({exc.name} is missing): "
            "pip install 'protocol-gateway[spark]'",
            file=sys.stderr,
        )
        return 2
    return run_pipeline(args)


def queue_command(args: argparse.Namespace) -> int:
    base = args.admin_url.rstrip("/") + "/api/v1/queues"
    cmd = args.queue_command
    auth = _basic_auth(args.user)
    if cmd == "list":
        status, body = _call("GET", base, auth=auth)
    elif cmd == "show":
        status, body = _call("GET", f"{base}/{_q(args.name)}", auth=auth)
    elif cmd == "delete":
        status, body = _call("DELETE", f"{base}/{_q(args.name)}", auth=auth)
    else:
        spec: dict[str, Any] = {"name": args.name, "subscriptions": args.subscription}
        for field in ("access_type", "max_message_size", "max_spool_bytes", "max_messages"):
            if getattr(args, field) is not None:
                spec[field] = getattr(args, field)
        if args.non_durable:
            spec["durable"] = False
        status, body = _call("POST", base, spec, auth=auth)
    if status >= 400:
        message = body.get("error", body) if isinstance(body, dict) else body
        if status == 401:
            message = f"{message}: pass --user NAME and set GATEWAY_ADMIN_PASSWORD"
        print(f"gateway: {message}", file=sys.stderr)
        return 1
    if cmd == "list" and isinstance(body, list):
        print(f"{'NAME':40} {'ACCESS':14} {'MESSAGES':>9} {'BYTES':>12} {'FLOWS':>5}")
        for q in body:
            print(
                f"{q['name']:40} {q['access_type']:14} {q['messages']:>9} "
                f"{q['spooled_bytes']:>12} {q['flows']:>5}"
            )
    elif body is not None:
        print(json.dumps(body, indent=2))
    return 0


def _basic_auth(user: str | None) -> str | None:
    """The Authorization header for `user` (password from GATEWAY_ADMIN_PASSWORD), if any."""
    if not user:
        return None
    password = os.environ.get("GATEWAY_ADMIN_PASSWORD", "")
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _call(method: str, url: str, body: Any = None, auth: str | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    try:
        req = urllib.request.Request(url, data=data, method=method)
    except ValueError as exc:  # no scheme, a broken IPv6 host...
        print(f"gateway: --admin-url is not an http(s) URL: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if auth is not None:
        req.add_header("Authorization", auth)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except urllib.error.URLError as exc:
        print(f"gateway: cannot reach the admin API at {url}: {exc.reason}", file=sys.stderr)
        raise SystemExit(1) from None
    except (http.client.HTTPException, ConnectionError) as exc:  # e.g. the AMQP port
        print(f"gateway: no admin API answers at {url}: {exc!r}", file=sys.stderr)
        raise SystemExit(1) from None
    except TimeoutError:  # connected, then no answer
        print(f"gateway: the admin API at {url} did not answer within 30 s", file=sys.stderr)
        raise SystemExit(1) from None
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


if __name__ == "__main__":
    sys.exit(main())
