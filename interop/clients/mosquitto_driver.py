"""Mosquitto command-line clients (mosquitto_pub / mosquitto_sub) driven unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from typing import Any

from common import args, b64, emit, ready, unb64


def base(a: dict[str, Any], client_id: str | None = None) -> list[str]:
    argv = [
        "-h",
        a["host"],
        "-p",
        str(a["port"]),
        "-V",
        VERSIONS[a["version"]],
        "-i",
        client_id or a["client_id"],
    ]
    if a.get("username"):
        argv += ["-u", a["username"], "-P", a["password"]]
    if a.get("ca"):
        argv += ["--cafile", a["ca"]]
    return argv


def publish_argv(a: dict[str, Any], m: dict[str, Any], payload_file: str) -> list[str]:
    argv = ["mosquitto_pub", *base(a), "-t", m["topic"], "-q", str(m["qos"]), "-f", payload_file]
    if m.get("retain"):
        argv.append("-r")
    p = m.get("props", {})
    for k, v in p.get("user_properties", []):
        argv += ["-D", "publish", "user-property", k, v]
    if "correlation_data" in p:
        argv += ["-D", "publish", "correlation-data", unb64(p["correlation_data"]).decode()]
    if "response_topic" in p:
        argv += ["-D", "publish", "response-topic", p["response_topic"]]
    if "content_type" in p:
        argv += ["-D", "publish", "content-type", p["content_type"]]
    return argv


VERSIONS = {5: "mqttv5", 4: "mqttv311", 3: "mqttv31"}
FORMAT = "MSG\\t%t\\t%q\\t%r\\t%x\\t%C\\t%D\\t%R\\t%P"  # %x: payload as hex


def parse(line: str) -> dict[str, Any]:
    """One `mosquitto_sub -F FORMAT` line in the runner's shape. %P prints user properties
    as space-separated key:value pairs (the interop values contain neither)."""
    _, topic, qos, retain, payload, ctype, corr, rtopic, users = line.rstrip("\n").split("\t")
    props: dict[str, Any] = {}
    if users:
        props["user_properties"] = [pair.split(":", 1) for pair in users.split(" ")]
    if corr:
        props["correlation_data"] = b64(corr.encode())
    if rtopic:
        props["response_topic"] = rtopic
    if ctype:
        props["content_type"] = ctype
    return {
        "topic": topic,
        "payload": b64(bytes.fromhex(payload)),
        "qos": int(qos),
        "retain": retain == "1",
        "props": props,
    }


def subscribe(a: dict[str, Any]) -> None:
    """mosquitto_sub -d: its debug lines say when SUBACK arrived (then the runner is told);
    stdbuf makes it line-buffered on the pipe, or those lines would come only at exit."""
    argv = [
        "stdbuf",
        "-oL",
        "mosquitto_sub",
        *base(a),
        "-d",
        "-F",
        FORMAT,
        "-W",
        str(int(a["timeout"])),
    ]
    if not a.get("clean", True):
        argv += ["-c", "-x", "300"] if a["version"] == 5 else ["-c"]
    topics = a["topics"] or [["$interop/none", 1]]  # mosquitto_sub needs a -t to resume
    for topic, qos in topics:
        argv += ["-t", topic, "-q", str(qos)]
    argv += ["-E"] if a["count"] == 0 else ["-C", str(a["count"])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    messages = []
    for line in proc.stdout:
        if "received SUBACK" in line:
            ready()
        elif line.startswith("MSG\t"):
            messages.append(parse(line))
    proc.wait()
    if proc.returncode not in (0, 27):  # 27: -W timeout expired
        emit({"ok": False, "rc": proc.returncode, "error": proc.stderr.read().strip()})
        return
    emit({"ok": True, "messages": messages})


def main() -> None:
    a = args()
    if a["action"] == "connect":
        done = subprocess.run(
            ["mosquitto_pub", *base(a), "-t", "interop/connect", "-n"],
            capture_output=True,
            text=True,
            timeout=a["timeout"],
        )
        emit({"ok": done.returncode == 0, "rc": done.returncode, "error": done.stderr.strip()})
    elif a["action"] == "publish":
        for m in a["messages"]:
            with tempfile.NamedTemporaryFile() as f:
                f.write(unb64(m["payload"]))
                f.flush()
                done = subprocess.run(
                    publish_argv(a, m, f.name), capture_output=True, text=True, timeout=a["timeout"]
                )
            if done.returncode != 0:
                emit({"ok": False, "rc": done.returncode, "error": done.stderr.strip()})
                return
        emit({"ok": True})
    elif a["action"] == "subscribe":
        subscribe(a)
    elif a["action"] == "will":
        w = a["will"]
        argv = [
            "mosquitto_sub",
            *base(a),
            "-t",
            "interop/will-holder",
            "--will-topic",
            w["topic"],
            "--will-payload",
            unb64(w["payload"]).decode(),
            "--will-qos",
            str(w["qos"]),
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["sleep", "0.5"])
        os.kill(proc.pid, signal.SIGKILL)  # no DISCONNECT: the will must fire
        proc.wait()
        emit({"ok": True})


if __name__ == "__main__":
    main()
