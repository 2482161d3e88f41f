"""The clients under test: one entry per client (driver + environment + what it cannot do).

To add a client, write a driver under clients/ that speaks the JSON actions of its protocol
(see README.md) and add a `Client` here; `cannot` names the scenarios its API cannot
express, with the reason, so they show as "unsupported" instead of passing silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envs import Spec

ENVS = {
    "project": Spec("project", "project"),
    "paho2": Spec("paho2", "venv", ("paho-mqtt>=2.1,<3", "aiomqtt>=2.5,<3")),
    "paho16": Spec("paho16", "venv", ("paho-mqtt==1.6.1", "asyncio-mqtt==0.16.2")),
    "amqtt": Spec("amqtt", "venv", ("amqtt==0.12.1",)),
    "node": Spec("node", "npm", ("mqtt@5.16.0", "rhea@3.0.5")),
    "mosquitto": Spec("mosquitto", "apt", ("mosquitto-clients",)),
    "qpid-c": Spec("qpid-c", "qpid-c"),
}

V3_CANNOT = {
    "partitioned": "MQTT 3.x has no user properties, so no JMSXGroupId partition key",
    "request_reply": "MQTT 3.x has no response topic / correlation data",
}


@dataclass(frozen=True)
class Client:
    """A client library or tool, the driver that runs it, and its protocol level."""

    name: str
    protocol: str  # "mqtt" | "amqp"
    env: str
    driver: str  # file under interop/clients/
    version: int = 5  # MQTT protocol level (3 = 3.1, 4 = 3.1.1, 5 = 5.0); unused for AMQP
    cannot: dict[str, str] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)  # passed to the driver


CLIENTS = [
    Client("paho2-v5", "mqtt", "paho2", "paho_driver.py", 5),
    Client("paho2-v311", "mqtt", "paho2", "paho_driver.py", 4, V3_CANNOT),
    Client("paho2-v31", "mqtt", "paho2", "paho_driver.py", 3, V3_CANNOT),
    Client("aiomqtt-v5", "mqtt", "paho2", "aio_driver.py", 5, options={"lib": "aiomqtt"}),
    Client(
        "asyncio-mqtt-v5", "mqtt", "paho16", "aio_driver.py", 5, options={"lib": "asyncio_mqtt"}
    ),
    Client(
        "asyncio-mqtt-v311",
        "mqtt",
        "paho16",
        "aio_driver.py",
        4,
        V3_CANNOT,
        {"lib": "asyncio_mqtt"},
    ),
    Client("amqtt-v311", "mqtt", "amqtt", "amqtt_driver.py", 4, V3_CANNOT),
    Client("mqttjs-v5", "mqtt", "node", "mqttjs.js", 5),
    Client("mqttjs-v311", "mqtt", "node", "mqttjs.js", 4, V3_CANNOT),
    Client("mosquitto-v5", "mqtt", "mosquitto", "mosquitto_driver.py", 5),
    Client("mosquitto-v311", "mqtt", "mosquitto", "mosquitto_driver.py", 4, V3_CANNOT),
    Client("proton-python", "amqp", "project", "proton_driver.py"),
    Client("rhea", "amqp", "node", "rhea.js"),
    Client(
        "qpid-proton-c",
        "amqp",
        "qpid-c",
        "qpid_c_driver.py",
        cannot={
            "auth_good": "send.c / receive.c connect without credentials (no SASL PLAIN option)",
            "auth_bad": "send.c / receive.c connect without credentials (no SASL PLAIN option)",
            "pubsub_presettled": "send.c always sends unsettled",
            "partitioned": "send.c sets no group-id",
            "request_reply": "receive.c has no dynamic receiver; send.c no reply-to",
            "tls": "send.c / receive.c take HOST PORT ADDRESS COUNT only: no TLS option",
            "cross_publish": "send.c's body is a fixed AMQP map {sequence: n}, no payload or"
            " properties to compare",
        },
    ),
]
