"""Debian's Qpid Proton C examples (send.c / receive.c, compiled unchanged) as a client.

Their command line is `HOST PORT ADDRESS COUNT`; send.c sends COUNT unsettled messages with
the fixed body {"sequence": n}, receive.c prints each body with pn_inspect and accepts it.
"""

from __future__ import annotations

import ast
import os
import subprocess

from common import args, b64, emit, ready


def binary(name: str) -> str:
    return os.path.join(os.environ["QPID_C_BIN"], name)


def body_bytes(line: str) -> bytes:
    """pn_inspect prints a binary as b"..." with C-style escapes and a string as "..."."""
    text = line.strip()
    if text.startswith('b"'):
        return ast.literal_eval(text)
    return ast.literal_eval(text).encode() if text.startswith('"') else text.encode()


def main() -> None:
    a = args()
    if a["action"] == "send":
        argv = [binary("send"), a["host"], str(a["port"]), a["address"], str(len(a["messages"]))]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=a["timeout"])
        ok = done.returncode == 0 and "acknowledged" in done.stdout
        error = (done.stderr or done.stdout).strip()[-400:]
        if "delivery state 37" in error:
            error = (
                "gateway answered rejected (37 = PN_REJECTED) to send.c's amqp-value map body"
                f" {{sequence: n}}: {error}"
            )
        emit({"ok": ok, "error": error})
    elif a["action"] == "receive":
        argv = [binary("receive"), a["host"], str(a["port"]), a["address"], str(a["count"])]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready()  # receive.c prints nothing on attach; it only reads queues, which lose nothing
        try:
            out, err = proc.communicate(timeout=a["timeout"])
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        bodies = [x for x in out.splitlines() if x and not x.endswith("messages received")]
        messages = [
            {"body": b64(body_bytes(x)), "properties": {}, "application_properties": {}}
            for x in bodies
        ]
        emit({"ok": True, "messages": messages, "error": err.strip()[-400:]})
    else:
        emit({"ok": False, "error": f"{a['action']} is not something send.c / receive.c do"})


if __name__ == "__main__":
    main()
