"""HTTP/1.1 over a raw socket, for what a client library hides: a refused request followed by
another on the same kept-alive connection (a library would reconnect and mask a desync)."""

from __future__ import annotations

import re
import socket
import threading

_STATUS = re.compile(rb"HTTP/1.1 (\d+)")


def send_then_read(url: str, head: bytes, body_bytes: int, after: bytes, *,
                   timeout: float = 10.0) -> tuple[list[int], bool, str]:
    """Send ``head % body_bytes``, that many body bytes and then ``after`` (from another thread,
    as an uploading client does) and read until two responses arrived. Returns the statuses
    answered, whether the server closed the connection, and the first response's head."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)

    def send():
        try:
            s.sendall(head % body_bytes)
            s.sendall(b"x" * body_bytes)
            s.sendall(after)
        except OSError:
            pass  # the server closed the connection on a large unread body
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    buf, closed = b"", False
    try:
        while len(_STATUS.findall(buf)) < 2:
            data = s.recv(1 << 16)
            if not data:
                closed = True
                break
            buf += data
    except ConnectionResetError:
        closed = True
    except socket.timeout:
        pass  # neither answered nor closed: the desync callers look for
    finally:
        sender.join(timeout)
        s.close()
    first_head = buf.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    return [int(x) for x in _STATUS.findall(buf)], closed, first_head
