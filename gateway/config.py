"""Settings and provisioned objects: flags override GATEWAY_* environment variables, which
override an optional TOML file, which overrides the defaults below.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

APPENDFSYNC = ("everysec", "always")


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which setting and why."""


@dataclass(slots=True)
class User:
    name: str
    password: str


@dataclass(slots=True)
class AclRule:
    """MQTT topic ACL entry; user "*" applies to everyone."""

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
    tls_cert: str | None = None  # PEM certificate chain
    tls_key: str | None = None  # PEM private key
    data_dir: str = ".gateway-data"
    redis_url: str | None = None  # None: run an embedded redis-server under data_dir
    appendfsync: str = "everysec"
    allow_anonymous: bool = True
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0
    log_level: str = "INFO"
    users: list[User] = field(default_factory=list)
    acl: list[AclRule] = field(default_factory=list)
    queues: list[dict[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        for name in ("mqtt_port", "amqp_port", "admin_port", "mqtt_tls_port", "amqp_tls_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be a port number (0-65535), not {port}")
        if not -1 <= self.mqtt_ws_port <= 65535:
            raise ConfigError("mqtt_ws_port must be a port number, or -1 for none")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name}: {path} is not a file")
        if self.appendfsync not in APPENDFSYNC:
            raise ConfigError(f"appendfsync must be one of {', '.join(APPENDFSYNC)}")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError("redis_url must be a redis://, rediss:// or unix:// URL")
        if self.node_ttl_s <= self.heartbeat_s:
            raise ConfigError("node_ttl_s must be longer than heartbeat_s")

    def password_ok(self, user: str, password: str) -> bool:
        return any(u.name == user and u.password == password for u in self.users)


_SCALARS = {
    f.name: f.type for f in dataclasses.fields(Settings) if f.name not in ("users", "acl", "queues")
}


def _coerce(name: str, value: Any) -> Any:
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
        unknown = sorted(set(server) - set(_SCALARS))
        if unknown:
            raise ConfigError(f"config file {config_path}: unknown [server] keys {unknown}")
        values.update(server)
        provisioned = {k: doc.get(k, []) for k in ("users", "acl", "queues")}
    for name in _SCALARS:
        key = f"GATEWAY_{name.upper()}"
        if key in env:
            values[name] = env[key]
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
    settings = Settings(**{k: _coerce(k, v) for k, v in values.items()})
    try:
        settings.users = [User(**u) for u in provisioned.get("users", [])]
        settings.acl = [AclRule(**a) for a in provisioned.get("acl", [])]
    except TypeError as exc:
        raise ConfigError(f"config file {config_path}: {exc}") from None
    settings.queues = list(provisioned.get("queues", []))
    settings.validate()
    return settings
