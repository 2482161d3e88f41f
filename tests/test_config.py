"""Settings: defaults < TOML file < GATEWAY_* environment < flag overrides, and errors."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from gateway.broker import Broker
from gateway.config import AclRule, ConfigError, Settings, User, load_settings
from gateway.engine.queues import QueueConfig
from gateway.model import Delivery, Message, Outcome
from gateway.server import provision
from tests.test_engine import wait_for
from tests.test_tls import make_cert

# The example from ARCHITECTURE.md, section "Configuration and operation", verbatim.
ARCHITECTURE_EXAMPLE = """\
[server]
mqtt_port = 1883
amqp_port = 5672
admin_port = 8080
data_dir = ".gateway-data"
# redis_url = "redis://127.0.0.1:6379/0"   # absent: embedded redis-server
allow_anonymous = true

[[users]]
name = "alice"
password = "s3cret"

[[acl]]                               # MQTT topic ACL; "*" = every user
user = "*"
deny_subscribe = ["test/nosubscribe"]
deny_publish = []

[[queues]]
name = "orders"
access_type = "non-exclusive"        # or "exclusive"
partition_count = 4                  # 0: not partitioned
subscriptions = ["orders/>", "shop/*/created"]
max_redelivery = 3                   # 0: unlimited
dead_message_queue = "orders.dmq"
max_ttl_ms = 60000
respect_ttl = true
max_spool_bytes = 100000000          # 0: last value queue
max_message_size = 1048576
"""


def write(tmp_path: Path, text: str, name: str = "gateway.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_without_file_env_or_flags() -> None:
    s = load_settings(env={})
    assert s == Settings()
    assert (s.host, s.mqtt_port, s.amqp_port, s.admin_port) == ("127.0.0.1", 1883, 5672, 8080)
    assert s.redis_url is None
    assert s.appendfsync == "everysec"
    assert s.allow_anonymous is True
    assert s.users == [] and s.acl == [] and s.queues == []


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nmqtt_port = 1\namqp_port = 11\nadmin_port = 21\n")
    env = {"GATEWAY_MQTT_PORT": "2", "GATEWAY_AMQP_PORT": "12"}

    only_file = load_settings(env={}, config_path=path)
    assert (only_file.mqtt_port, only_file.amqp_port, only_file.admin_port) == (1, 11, 21)

    with_env = load_settings(env=env, config_path=path)
    assert (with_env.mqtt_port, with_env.amqp_port, with_env.admin_port) == (2, 12, 21)

    with_flag = load_settings({"mqtt_port": 3}, env=env, config_path=path)
    assert (with_flag.mqtt_port, with_flag.amqp_port, with_flag.admin_port) == (3, 12, 21)
    assert isinstance(with_flag.amqp_port, int)


def test_none_override_means_flag_not_given(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nmqtt_port = 1\n")
    s = load_settings(
        {"mqtt_port": None, "log_level": None}, env={"GATEWAY_LOG_LEVEL": "DEBUG"}, config_path=path
    )
    assert s.mqtt_port == 1
    assert s.log_level == "DEBUG"


def test_config_path_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nredis_url = "redis://127.0.0.1:7000/2"\n')
    s = load_settings(env={"GATEWAY_CONFIG": path})
    assert s.redis_url == "redis://127.0.0.1:7000/2"
    # an explicit path wins over GATEWAY_CONFIG
    other = write(tmp_path, "[server]\nadmin_port = 9\n", "other.toml")
    s = load_settings(env={"GATEWAY_CONFIG": path}, config_path=other)
    assert s.admin_port == 9 and s.redis_url is None


def test_env_values_are_coerced() -> None:
    s = load_settings(
        env={
            "GATEWAY_ADMIN_PORT": "0",
            "GATEWAY_HEARTBEAT_S": "0.5",
            "GATEWAY_NODE_TTL_S": "2",
            "GATEWAY_ALLOW_ANONYMOUS": "off",
            "GATEWAY_APPENDFSYNC": "always",
            "GATEWAY_PIN_CPUS": "false",
            "GATEWAY_REDIS_MAX_MEMORY_PERCENT": "25",
            "GATEWAY_REDIS_URL": "unix:///tmp/redis.sock",
            "GATEWAY_HOST": "::1",
            "UNRELATED": "x",
        }
    )
    assert s.admin_port == 0
    assert s.heartbeat_s == 0.5 and s.node_ttl_s == 2.0
    assert s.allow_anonymous is False
    assert s.appendfsync == "always" and s.pin_cpus is False
    assert s.redis_max_memory_percent == 25
    assert s.redis_url == "unix:///tmp/redis.sock"
    assert s.host == "::1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False), ("no", False)],
)
def test_bool_from_env(text: str, expected: bool) -> None:
    assert load_settings(env={"GATEWAY_ALLOW_ANONYMOUS": text}).allow_anonymous is expected


def test_users_acl_and_queues_are_parsed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
allow_anonymous = false

[[users]]
name = "alice"
password = "s3cret"

[[users]]
name = "bob"
password = "hunter2"

[[acl]]
deny_publish = ["secret/>"]

[[acl]]
user = "bob"
deny_subscribe = ["a/b", "c/#"]

[[queues]]
name = "q1"
subscriptions = ["a/>"]

[[queues]]
name = "q2"
access_type = "exclusive"
max_messages = 10
""",
    )
    s = load_settings(env={}, config_path=path)
    assert s.allow_anonymous is False
    assert s.users == [User("alice", "s3cret"), User("bob", "hunter2")]
    assert s.password_ok("alice", "s3cret")
    assert not s.password_ok("alice", "hunter2")
    assert not s.password_ok("carol", "s3cret")
    assert s.login("alice", "s3cret") == (True, "alice")
    assert s.login("alice", "hunter2") == (False, None)
    # no users to check a name against: anyone while anonymous clients are allowed, as one
    assert Settings(allow_anonymous=True).login("alice", "x") == (True, None)
    assert Settings(allow_anonymous=False).login("alice", "x") == (False, None)
    assert s.acl == [
        AclRule(user="*", deny_subscribe=[], deny_publish=["secret/>"]),
        AclRule(user="bob", deny_subscribe=["a/b", "c/#"], deny_publish=[]),
    ]
    assert s.queues == [
        {"name": "q1", "subscriptions": ["a/>"]},
        {"name": "q2", "access_type": "exclusive", "max_messages": 10},
    ]
    for spec in s.queues:
        QueueConfig.from_json(spec).validate()


def test_architecture_example_loads(tmp_path: Path) -> None:
    s = load_settings(env={}, config_path=write(tmp_path, ARCHITECTURE_EXAMPLE))
    assert (s.mqtt_port, s.amqp_port, s.admin_port) == (1883, 5672, 8080)
    assert s.data_dir == ".gateway-data"
    assert s.redis_url is None
    assert s.allow_anonymous is True
    assert s.users == [User("alice", "s3cret")]
    assert s.acl == [AclRule("*", ["test/nosubscribe"], [])]
    assert len(s.queues) == 1
    spec = s.queues[0]
    assert spec["name"] == "orders"
    assert spec["subscriptions"] == ["orders/>", "shop/*/created"]
    assert spec["partition_count"] == 4 and spec["respect_ttl"] is True

    # The whole example queue is one this version provisions.
    config = QueueConfig.from_json(spec)
    config.validate()
    assert config.partition_count == 4 and config.max_redelivery == 3
    assert config.dead_message_queue == "orders.dmq"
    assert config.max_spool_bytes == 100_000_000
    assert config.max_message_size == 1_048_576


# -- errors ---------------------------------------------------------------------------------


def test_unknown_server_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nmqtt_port = 1883\nmqtt_prot = 1884\n")
    with pytest.raises(ConfigError, match=r"unknown \[server\] keys \['mqtt_prot'\]"):
        load_settings(env={}, config_path=path)


def test_unknown_section(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\n\n[[vpns]]\nname = "default"\n')
    with pytest.raises(ConfigError, match=r"unknown sections \['vpns'\]"):
        load_settings(env={}, config_path=path)


def test_bad_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\nmqtt_port = \n")
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config_path=path)
    assert path in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_settings(env={}, config_path=path)
    assert path in str(info.value)


def test_missing_file_named_by_env(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(env={"GATEWAY_CONFIG": str(tmp_path / "gone.toml")})


@pytest.mark.parametrize(
    ("source", "name", "value"),
    [
        ("file", "mqtt_port", "70000"),
        ("env", "amqp_port", "-1"),
        ("flag", "admin_port", 65536),
        ("env", "mqtt_port", "abc"),
        ("file", "admin_port", '"eighty"'),
        ("env", "admin_port", "80.5"),
    ],
)
def test_bad_port(tmp_path: Path, source: str, name: str, value: object) -> None:
    overrides, env, path = {}, {}, None
    if source == "file":
        path = write(tmp_path, f"[server]\n{name} = {value}\n")
    elif source == "env":
        env = {f"GATEWAY_{name.upper()}": value}
    else:
        overrides = {name: value}
    with pytest.raises(ConfigError, match=name):
        load_settings(overrides, env=env, config_path=path)


@pytest.mark.parametrize("name", ["mqtt_ws_port", "mqtt_wss_port"])
def test_bad_websocket_port(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_settings({name: 70000}, env={})


def test_secure_websocket_port_needs_a_certificate() -> None:
    """A wss listener asked for without a certificate is refused at start, not left out."""
    with pytest.raises(ConfigError, match="mqtt_wss_port needs tls_cert and tls_key"):
        load_settings(env={"GATEWAY_MQTT_WSS_PORT": "8884"})


def test_port_range_limits_are_accepted() -> None:
    s = load_settings({"mqtt_port": 0, "amqp_port": 65535}, env={})
    assert (s.mqtt_port, s.amqp_port) == (0, 65535)


@pytest.mark.parametrize("source", ["file", "env", "flag"])
def test_bad_appendfsync(tmp_path: Path, source: str) -> None:
    overrides, env, path = {}, {}, None
    if source == "file":
        path = write(tmp_path, '[server]\nappendfsync = "no"\n')
    elif source == "env":
        env = {"GATEWAY_APPENDFSYNC": "sometimes"}
    else:
        overrides = {"appendfsync": "never"}
    with pytest.raises(ConfigError, match="appendfsync"):
        load_settings(overrides, env=env, config_path=path)


@pytest.mark.parametrize("value", ["maybe", "", "2", "truee"])
def test_bad_bool_in_env(value: str) -> None:
    with pytest.raises(ConfigError, match="allow_anonymous"):
        load_settings(env={"GATEWAY_ALLOW_ANONYMOUS": value})


def test_bad_float_in_env() -> None:
    with pytest.raises(ConfigError, match="heartbeat_s"):
        load_settings(env={"GATEWAY_HEARTBEAT_S": "fast"})


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "127.0.0.1:6379", ""])
def test_bad_redis_url(url: str) -> None:
    with pytest.raises(ConfigError, match="redis_url"):
        load_settings(env={"GATEWAY_REDIS_URL": url})


@pytest.mark.parametrize("percent", ["-1", "91", "half"])
def test_bad_redis_max_memory_percent(percent: str) -> None:
    with pytest.raises(ConfigError, match="redis_max_memory_percent"):
        load_settings(env={"GATEWAY_REDIS_MAX_MEMORY_PERCENT": percent})


@pytest.mark.parametrize(
    "env, name",
    [
        ({"GATEWAY_NODE_TTL_S": "nan"}, "node_ttl_s"),
        ({"GATEWAY_NODE_TTL_S": "inf"}, "node_ttl_s"),
        ({"GATEWAY_HEARTBEAT_S": "0"}, "heartbeat_s"),  # Redis called without pause
        ({"GATEWAY_HEARTBEAT_S": "-1"}, "heartbeat_s"),
        ({"GATEWAY_LOG_LEVEL": "verbose"}, "log_level"),
    ],
)
def test_settings_a_node_cannot_run_with_are_refused(env: dict[str, str], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_settings(env=env)


@pytest.mark.parametrize("level", ["warn", "WARNING", "debug", "Error"])
def test_log_levels_as_logging_reads_them_are_taken(level: str) -> None:
    assert load_settings(env={"GATEWAY_LOG_LEVEL": level}).log_level == level


def test_node_ttl_must_exceed_heartbeat() -> None:
    with pytest.raises(ConfigError, match="node_ttl_s"):
        load_settings(env={"GATEWAY_HEARTBEAT_S": "5", "GATEWAY_NODE_TTL_S": "5"})


@pytest.mark.parametrize(
    "table",
    [
        '[[users]]\nname = "alice"\n',  # no password
        '[[users]]\nname = "alice"\npassword = "x"\nrole = "admin"\n',
        '[[acl]]\nuser = "*"\ndeny_everything = ["a"]\n',
    ],
    ids=["user-missing-password", "user-unknown-key", "acl-unknown-key"],
)
def test_bad_provisioned_tables(tmp_path: Path, table: str) -> None:
    path = write(tmp_path, table)
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config_path=path)
    assert path in str(info.value)


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ('[[acl]]\nuser = "*"\ndeny_publish = "secret/x"\n', "deny_publish"),
        ('[[acl]]\nuser = "*"\ndeny_subscribe = [42]\n', "deny_subscribe"),
        ('[[users]]\nname = "alice"\npassword = "a"\n\n' * 2, "alice"),
        ('[[queues]]\nname = "orders"\nsubscriptions = "orders/>"\n', "subscriptions"),
        ('[[queues]]\nname = "orders"\nmax_spool_byte = 1000\n', "max_spool_byte"),
        ('[[queues]]\nname = "bad name"\n', "bad name"),
    ],
    ids=[
        "deny-list-as-a-string",
        "deny-pattern-not-a-string",
        "user-twice",
        "subscriptions-as-a-string",
        "queue-unknown-field",
        "queue-bad-name",
    ],
)
def test_provisioned_entries_a_node_would_misread_are_refused(
    tmp_path: Path, table: str, named: str
) -> None:
    """Each was taken before: a string where a list belongs read character by character
    (`subscriptions = "orders/>"` subscribed the queue to `>`, every topic; a deny list as a
    string denied nothing), a user given twice had either password by protocol."""
    path = write(tmp_path, table)
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config_path=path)
    assert path in str(info.value) and named in str(info.value), info.value


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("value", ["true", "1883.5"], ids=["bool", "float"])
def test_non_integer_toml_port_is_refused(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, f"[server]\nmqtt_port = {value}\n")
    with pytest.raises(ConfigError, match="mqtt_port"):
        load_settings(env={}, config_path=path)


@pytest.mark.parametrize("name", ["anonymous", ""])
def test_a_user_named_anonymous_is_refused(tmp_path: Path, name: str) -> None:
    """Clients that do not authenticate are the user `anonymous` (README), as are clients
    with an empty user name: a configured user of either name would share their sessions
    and queues."""
    path = tmp_path / "g.toml"
    path.write_text(f'[[users]]\nname = "{name}"\npassword = "pw"\n')
    with pytest.raises(ConfigError, match="anonymous"):
        load_settings(env={}, config_path=str(path))


@pytest.mark.parametrize("case", ["not-pem", "mismatched-key", "encrypted-key"])
def test_a_bad_certificate_or_key_is_one_clear_error(tmp_path: Path, case: str) -> None:
    """A bad tls_cert / tls_key is refused at start as other bad settings are, naming them:
    not after Redis, the admin API and the plain listeners started, in OpenSSL's words (an
    encrypted key prompted for a passphrase on the terminal)."""
    cert, key = make_cert(tmp_path)
    if case == "not-pem":
        cert = tmp_path / "garbage.pem"
        cert.write_text("not a certificate\n")
    elif case == "mismatched-key":
        (tmp_path / "other").mkdir()
        _, key = make_cert(tmp_path / "other")
    else:
        key = tmp_path / "enc.key"
        subprocess.run(
            ["openssl", "genrsa", "-aes256", "-passout", "pass:pw", "-out", str(key), "2048"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        cert = tmp_path / "enc.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-key", str(key), "-passin", "pass:pw", "-days", "2",
             "-out", str(cert), "-subj", "/CN=localhost"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    env = {"GATEWAY_TLS_CERT": str(cert), "GATEWAY_TLS_KEY": str(key)}
    with pytest.raises(ConfigError, match="tls_cert / tls_key") as err:
        load_settings(env=env)
    assert "\n" not in str(err.value)


def readme_config_example(tmp_path: Path) -> Path:
    """The README's config file example, as a file."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "gateway.toml"
    path.write_text(example)
    return path


async def test_the_readmes_config_example_dead_letters_a_rejected_order(
    tmp_path: Path, broker: Broker
) -> None:
    """Its orders queue named orders.dmq, which it did not declare, and its messages were
    not eligible (dmq_eligible_default false): a rejected order was discarded; its selector
    compared a number no MQTT property is (found by a review)."""
    settings = load_settings(env={}, config_path=str(readme_config_example(tmp_path)))
    await provision(broker, settings)
    order = Message("orders/42", b"o", user_properties=[("region", "eu")])
    assert await broker.publish(order) is Outcome.OK  # an MQTT 5 publisher's string property
    got: list[Delivery] = []
    flow = await broker.bind("orders", got.append)
    await wait_for(lambda: got)
    flow.reject(got[0].entry_id)
    deadline = asyncio.get_running_loop().time() + 5
    while (await broker.queues.info("orders.dmq")).messages != 1:
        assert asyncio.get_running_loop().time() < deadline, "not dead-lettered"
        await asyncio.sleep(0.05)
    await flow.close()
