"""`kubectl` for the commands NOTES.txt prints, answered by the chart-run harness.

chart-run puts a `kubectl` script first on PATH when it runs NOTES.txt's commands;
the script calls this module, which sends its argv to the harness over a Unix
socket ($CHARTRUN_API) and relays the answer. Only the verbs NOTES.txt uses are
known (get svc/secret, port-forward, exec, logs); anything else fails loudly, so a
new command in NOTES.txt fails chart-run until the harness learns it.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys


def main(argv: list[str]) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["CHARTRUN_API"])
    sock.sendall(json.dumps({"argv": argv}).encode() + b"\n")
    f = sock.makefile("rb")
    # The answer: JSON lines {"out": base64} with output, then {"exit": N}. A
    # port-forward answers its first line, then holds the connection until killed.
    for line in f:
        msg = json.loads(line)
        if "exit" in msg:
            return int(msg["exit"])
        sys.stdout.buffer.write(base64.b64decode(msg["out"]))
        sys.stdout.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
