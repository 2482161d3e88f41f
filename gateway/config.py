"""Settings and provisioned objects: flags override GATEWAY_* environment variables, which
override an optional TOML file, which overrides the defaults below.
"""

from __future__ import annotations

import dataclasses
import hmac
import math
import os
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.engine.queues import (
    DEAD_MESSAGE_QUEUE,
    QueueConfig,
    QueueError,
    subscription_entry,
)
from gateway.engine.spool_usage import vpn_name_error

APPENDFSYNC = ("everysec", "always")


ANONYMOUS = "anonymous"  # the user of clients that did not authenticate: never the operator


MIN_HEARTBEAT_S = 0.05  # below it, a node would call Redis without pause
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")  # as logging reads them


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which setting and why."""


@dataclass(slots=True)
class User:
    name: str
    password: str
    admin: bool = False  # the admin API's operator; other users act as themselves there


@dataclass(slots=True)
class AclRule:
    """Topic ACL entry (MQTT-syntax patterns), binding the user's clients of every protocol;
    user "*" applies to everyone, "anonymous" to clients that did not authenticate."""

    user: str = "*"
    deny_subscribe: list[str] = field(default_factory=list)
    deny_publish: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Settings:
    host: str = "127.0.0.1"
    mqtt_port: int = 1883
    amqp_port: int = 5672
    admin_port: int = 8080
    mqtt_tls_port: int = 8883  # TLS listeners start only with tls_cert and tls_key
    amqp_tls_port: int = 5671
    mqtt_ws_port: int = -1  # MQTT over WebSocket (path /mqtt, subprotocol mqtt); -1: off
    mqtt_wss_port: int = -1  # the same over TLS (needs tls_cert and tls_key); -1: off
    tls_cert: str | None = None  # PEM certificate chain
    tls_key: str | None = None  # PEM private key
    data_dir: str = ".gateway-data"
    redis_url: str | None = None  # None: run an embedded redis-server under data_dir
    appendfsync: str = "everysec"
    pin_cpus: bool = True  # embedded Redis: it and the node on separate halves of the CPUs
    # embedded Redis: its maxmemory, as a share of the machine's memory (0: no limit). When
    # full it refuses new messages (publishers are NACKed) while consumers drain it.
    redis_max_memory_percent: int = 40
    allow_anonymous: bool = True
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0
    log_level: str = "INFO"
    spool_quota_bytes: int = 0  # the broker-wide message spool quota; 0: unlimited
    spool_threshold_set_percent: int = 80  # spool usage events: raised at this share of a quota
    spool_threshold_clear_percent: int = 60  # ... and cleared below this share
    # per Message VPN spool quotas (bytes; 0 or absent: unlimited). TOML: an inline table in
    # [server]; environment: GATEWAY_VPN_SPOOL_QUOTAS="default=1000000,other=0"
    vpn_spool_quotas: dict[str, int] = field(default_factory=dict)
    users: list[User] = field(default_factory=list)
    acl: list[AclRule] = field(default_factory=list)
    queues: list[dict[str, Any]] = field(default_factory=list)
    # the settings the file, the environment or a flag gave: one given as its default (a
    # spool quota of 0, to lift one stored) is not one left out (see SpoolLimits)
    given: frozenset[str] = frozenset()

    def validate(self) -> None:
        for name in ("mqtt_port", "amqp_port", "admin_port", "mqtt_tls_port", "amqp_tls_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be a port number (0-65535), not {port}")
        for name in ("mqtt_ws_port", "mqtt_wss_port"):
            if not -1 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be a port number, or -1 for none")
        if self.mqtt_wss_port != -1 and self.tls_cert is None:
            raise ConfigError("mqtt_wss_port needs tls_cert and tls_key")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name}: {path} is not a file")
        if self.tls_cert is not None and self.tls_key is not None:
            tls_server_context(self.tls_cert, self.tls_key)
        if any(user.name in ("", ANONYMOUS) for user in self.users):
            raise ConfigError(
                f"users: {ANONYMOUS!r} is who clients that do not authenticate are (a user "
                "without a name too); such a user would share their sessions and queues"
            )
        if self.appendfsync not in APPENDFSYNC:
            raise ConfigError(f"appendfsync must be one of {', '.join(APPENDFSYNC)}")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError("redis_url must be a redis://, rediss:// or unix:// URL")
        if not 0 <= self.redis_max_memory_percent <= 90:
            raise ConfigError("redis_max_memory_percent must be 0 (no limit) to 90")
        for name in ("heartbeat_s", "node_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= MIN_HEARTBEAT_S):
                raise ConfigError(f"{name} must be a number of seconds, {MIN_HEARTBEAT_S} or more")
        if self.node_ttl_s <= self.heartbeat_s:
            raise ConfigError("node_ttl_s must be longer than heartbeat_s")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        self._validate_spool()

    def _validate_spool(self) -> None:
        if self.spool_quota_bytes < 0:
            raise ConfigError("spool_quota_bytes must be 0 (unlimited) or more")
        for vpn, quota in self.vpn_spool_quotas.items():
            problem = vpn_name_error(vpn)
            if problem:
                raise ConfigError(f"vpn_spool_quotas: {problem}")
            if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
                raise ConfigError(f"vpn_spool_quotas: the quota of {vpn!r} must be 0 or more")
        clear, set_ = self.spool_threshold_clear_percent, self.spool_threshold_set_percent
        if not 0 <= clear < set_ <= 100:
            raise ConfigError(
                "spool thresholds need 0 <= spool_threshold_clear_percent < "
                "spool_threshold_set_percent <= 100"
            )

    def password_ok(self, user: str, password: str) -> bool:
        return any(
            u.name == user and hmac.compare_digest(u.password.encode(), password.encode())
            for u in self.users
        )

    def login(self, user: str, password: str) -> tuple[bool, str | None]:
        """Whether a client that sent a user name and password may connect, and as whom: a
        configured user with its password, as that user. With no users configured, any
        client while anonymous ones are allowed (as Mosquitto with allow_anonymous and no
        password file), as anonymous (None): a name nothing checked grants nothing."""
        if self.users:
            return (True, user) if self.password_ok(user, password) else (False, None)
        return self.allow_anonymous, None


_MAPPINGS = ("vpn_spool_quotas",)  # name -> bytes tables
_SCALARS = {
    f.name: f.type
    for f in dataclasses.fields(Settings)
    if f.name not in ("users", "acl", "queues", "given", *_MAPPINGS)
}


def _quota_table(name: str, value: Any) -> dict[str, int]:
    """A name -> bytes table from TOML (a table) or the environment ("a=1,b=2")."""
    if isinstance(value, str):
        pairs = [p.partition("=") for p in value.split(",") if p.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ConfigError(f"{name}: {value!r} is not a list of name=bytes")
        value = {k.strip(): v.strip() for k, _, v in pairs}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a table of name = bytes")
    table: dict[str, int] = {}
    for key, quota in value.items():
        if isinstance(quota, bool) or not isinstance(quota, int | str):
            raise ConfigError(f"{name}: the quota of {key!r} must be an integer")
        try:
            table[str(key)] = int(quota)
        except ValueError:
            raise ConfigError(f"{name}: the quota of {key!r} must be an integer") from None
    return table


def _coerce(name: str, value: Any) -> Any:
    if name in _MAPPINGS:
        return _quota_table(name, value)
    kind = _SCALARS[name]
    if value is None:
        return None
    try:
        if "int" in kind and "|" not in kind:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if "float" in kind:
            return float(value)
        if "bool" in kind:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not a valid {kind}") from None
    return str(value)


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> Settings:
    """Merge file, environment (GATEWAY_<NAME>) and flag overrides into validated Settings."""
    env = os.environ if env is None else env
    config_path = config_path or env.get("GATEWAY_CONFIG")
    values: dict[str, Any] = {}
    provisioned: dict[str, Any] = {}
    if config_path:
        path = Path(config_path)
        try:
            doc = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {config_path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_path}: {exc}") from None
        unknown_top = sorted(set(doc) - {"server", "users", "acl", "queues"})
        if unknown_top:
            raise ConfigError(f"config file {config_path}: unknown sections {unknown_top}")
        server = doc.get("server", {})
        unknown = sorted(set(server) - set(_SCALARS) - set(_MAPPINGS))
        if unknown:
            raise ConfigError(f"config file {config_path}: unknown [server] keys {unknown}")
        values.update(server)
        provisioned = {k: doc.get(k, []) for k in ("users", "acl", "queues")}
    for name in (*_SCALARS, *_MAPPINGS):
        key = f"GATEWAY_{name.upper()}"
        if key in env:
            values[name] = env[key]
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
    settings = Settings(**{k: _coerce(k, v) for k, v in values.items()}, given=frozenset(values))
    try:
        settings.users = [User(**u) for u in provisioned.get("users", [])]
        settings.acl = [AclRule(**a) for a in provisioned.get("acl", [])]
    except TypeError as exc:
        raise ConfigError(f"config file {config_path}: {exc}") from None
    settings.queues = list(provisioned.get("queues", []))
    try:
        _check_provisioned(settings)
    except ConfigError as exc:
        raise ConfigError(f"config file {config_path}: {exc}") from None
    settings.validate()
    return settings


def _check_provisioned(settings: Settings) -> None:
    """The file's users, ACL rules and queues, checked before a node uses any: a string
    where a list belongs was read character by character (`subscriptions = "a/>"`
    subscribed the queue to `>`, every topic; a deny list as a string denied nothing)."""
    names = set()
    for user in settings.users:
        if not (isinstance(user.name, str) and isinstance(user.password, str)):
            raise ConfigError("user names and passwords are strings")
        if not isinstance(user.admin, bool):
            raise ConfigError(f"admin of user {user.name!r} must be true or false")
        if user.name in names:  # which password counts would differ by protocol
            raise ConfigError(f"user {user.name!r} is configured twice")
        names.add(user.name)
    for rule in settings.acl:
        if not isinstance(rule.user, str):
            raise ConfigError("an acl rule's user is a user name, '*' or 'anonymous'")
        for name in ("deny_publish", "deny_subscribe"):
            patterns = getattr(rule, name)
            if not (isinstance(patterns, list) and all(isinstance(p, str) and p for p in patterns)):
                raise ConfigError(
                    f"acl: {name} of user {rule.user!r} must be a list of topic patterns"
                )
    for spec in settings.queues:
        if not isinstance(spec, dict):
            raise ConfigError("each [[queues]] entry is a table of queue properties")
        try:
            config = QueueConfig.from_json(spec)
            config.validate(reserved_ok=config.name == DEAD_MESSAGE_QUEUE)
            queue_subscriptions(spec)
        except QueueError as exc:
            raise ConfigError(f"queue {spec.get('name')!r}: {exc}") from None


def queue_subscriptions(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A [[queues]] entry's subscriptions: a list of patterns (Solace syntax) or of
    {pattern, syntax} tables; QueueError 'invalid' for anything else."""
    items = spec.get("subscriptions", [])
    if not isinstance(items, list):
        raise QueueError("invalid", "subscriptions must be a list of patterns")
    subs = []
    for item in items:
        if isinstance(item, str):
            pattern, syntax = item, "smf"
        elif isinstance(item, dict) and set(item) <= {"pattern", "syntax"}:
            pattern, syntax = item.get("pattern"), item.get("syntax", "smf")
        else:
            raise QueueError(
                "invalid", f"a subscription is a pattern or {{pattern, syntax}}: {item!r}"
            )
        if not (isinstance(pattern, str) and isinstance(syntax, str)):
            raise QueueError(
                "invalid", f"a subscription's pattern and syntax are strings: {item!r}"
            )
        subscription_entry(pattern, syntax)  # QueueError 'invalid' for a bad one
        subs.append((pattern, syntax))
    return subs


def tls_server_context(cert: str, key: str) -> ssl.SSLContext:
    """The TLS server context of a certificate chain and its key, or a ConfigError saying
    why not in one line (OpenSSL's own words alone name no setting, and an encrypted key
    would prompt for a passphrase on the terminal: the gateway takes none)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except (ssl.SSLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        raise ConfigError(
            f"tls_cert / tls_key: {cert} and {key} are not a PEM certificate chain and its "
            f"unencrypted private key ({reason})"
        ) from None
    return context


def _no_passphrase() -> bytes:
    raise ValueError("the key is encrypted")
