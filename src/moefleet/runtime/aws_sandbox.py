"""Emulated Lambda execution environments for the ``aws`` backend's in-process invoker
(the child side; :mod:`moefleet.runtime.aws_inprocess` is the parent side).

This file is run as a script, ``python -I aws_sandbox.py CONTROL_FD PRELOAD_JSON``, and uses
the standard library only: it must not import moefleet itself, because an environment
imports moefleet from the function's unpacked code, as Lambda does.

- The *zygote* (the script's process) imports the preload modules (torch, transformers,
  boto3: what a Lambda layer or container image provides), then serves fork requests on
  its control socket (``SOCK_SEQPACKET``: one JSON message plus one passed socket per
  request) and answers each with the new environment's pid. Environments fork from it
  (never from the caller, whose threads make ``fork`` unsafe), so a cold start pays the
  import of the function's code, not of torch.
- An *environment* (a forked child) chdirs into the code directory, puts it first on
  ``sys.path``, replaces ``os.environ`` with the function's Lambda variables, imports the
  entry module (the INIT phase, timed) and then serves one event at a time on its socket,
  like Lambda's Python runtime: the handler's result is returned as JSON; an exception
  becomes Lambda's error object with ``FunctionError: "Unhandled"``.

Wire format on an environment socket: frames of an 8-byte big-endian length and bytes.
Env → parent first: ``{"init_ms", "init_error"}``. Then per event, parent → env: a JSON
header ``{"request_id", "timeout_s"}`` and the event bytes; env → parent: a JSON header
``{"function_error", "duration_ms", "max_memory_mb"}`` and the response bytes. While an
event runs, the handler may send ``{"op": "nested", ...}`` + payload pairs (a call of
another function, :mod:`moefleet.runtime.nested`) through ``context.moefleet_channel``;
the parent answers each with a ``{"op": "nested_reply", ...}`` pair, which a reader thread
hands to ``channel.on_reply``. A process death mid-event is seen by the parent as
end-of-stream (Lambda's ``Runtime.ExitError``). Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import resource
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

_LEN = struct.Struct(">Q")


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame, or None at end-of-stream (the peer closed or died)."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LEN.unpack(head)[0])
    if body is None:
        return None
    return body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class _Context:
    """The subset of Lambda's context object handlers commonly use."""

    def __init__(self, env: dict[str, str], request_id: str, timeout_s: float) -> None:
        self.function_name = env.get("AWS_LAMBDA_FUNCTION_NAME", "")
        self.function_version = env.get("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST")
        self.memory_limit_in_mb = env.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "")
        self.aws_request_id = request_id
        self._deadline = time.monotonic() + timeout_s

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


class _Channel:
    """The environment's socket, shared by the runtime loop and the handler's nested
    calls: ``send`` writes one (header, body) pair atomically; ``on_reply`` (set by the
    entry point) receives every ``nested_reply`` pair."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.on_reply: Callable[[dict[str, Any], bytes], None] | None = None

    def send(self, header: dict[str, Any], body: bytes = b"") -> None:
        with self._lock:
            send_frame(self._sock, json.dumps(header).encode())
            send_frame(self._sock, body)

    def read(self, inbox: queue.SimpleQueue[tuple[bytes, bytes] | None]) -> None:
        """Reader thread: replies to nested calls go to ``on_reply``, events to ``inbox``."""
        while True:
            header = recv_frame(self._sock)
            body = recv_frame(self._sock) if header is not None else None
            if header is None or body is None:
                inbox.put(None)
                return
            parsed = json.loads(header)
            if parsed.get("op") == "nested_reply":
                if self.on_reply is not None:
                    self.on_reply(parsed, body)
            else:
                inbox.put((header, body))


def _serve(sock: socket.socket, request: dict[str, Any]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores it; handlers may not
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; it kills by pid
    code_dir = request["code_dir"]
    os.chdir(code_dir)
    sys.path.insert(0, code_dir)
    os.environ.clear()
    os.environ.update(request["env"])
    module_name, _, attr = request["handler"].rpartition(".")
    t0 = time.perf_counter()
    init_error = None
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # Lambda reports this at the first invocation
        init_error = {"errorType": "Runtime.ImportModuleError",
                      "errorMessage": f"Unable to import module '{module_name}': {err}"}
    send_frame(sock, json.dumps({"init_ms": (time.perf_counter() - t0) * 1000,
                                 "init_error": init_error}).encode())
    if init_error is not None:
        return
    channel = _Channel(sock)
    inbox: queue.SimpleQueue[tuple[bytes, bytes] | None] = queue.SimpleQueue()
    threading.Thread(target=channel.read, args=(inbox,), daemon=True).start()
    while True:
        item = inbox.get()
        if item is None:
            return  # the parent closed this environment
        header_bytes, event = item
        header = json.loads(header_bytes)
        context = _Context(request["env"], header["request_id"], float(header["timeout_s"]))
        context.moefleet_channel = channel  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        function_error = None
        try:
            body = json.dumps(handler(json.loads(event), context)).encode()
        except Exception as err:
            function_error = "Unhandled"
            body = json.dumps({"errorMessage": str(err), "errorType": type(err).__name__,
                               "stackTrace": traceback.format_tb(err.__traceback__)}).encode()
        reply = {"function_error": function_error,
                 "duration_ms": (time.perf_counter() - t0) * 1000,
                 "max_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
        channel.send(reply, body)


def main(control_fd: int, preload: list[str]) -> None:
    for module in preload:
        # Only a speed-up: an environment that needs a missing module imports it itself.
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    control = socket.socket(fileno=control_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # environments are reaped automatically
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
        except OSError:
            return
        if not message or not fds:
            return  # the parent closed the control socket (or died): stop serving
        pid = os.fork()
        if pid == 0:
            control.close()
            env_sock = socket.socket(fileno=fds[0])
            try:
                _serve(env_sock, json.loads(message))
            finally:
                os._exit(0)
        os.close(fds[0])
        control.send(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
