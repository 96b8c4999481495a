"""The log lines of ``aerie serve``: no token or session key in them, and nothing a request carries obeyed by the
terminal.

A filter on every log handler (:class:`RedactingFilter`) replaces each token's text, every ``token=`` value and
every ``/ws/<session key>`` wherever it appears (tracebacks included, rendered without locals), then escapes
every control character (``\\x1b`` becomes the four characters ``\\x1b``, a newline ``\\n``, a bidi override
``\\u202e``): a request's path, its headers and its User-Agent are shown, never obeyed, so no client can colour
the terminal, clear it or forge a log line. A malformed request (anyone can send one) is one line saying why, not
a traceback. The access log (:func:`access_logger_class`) writes the path redacted and the User-Agent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

_TOKEN_QUERY = re.compile(r"(token=)[^&\s\"']*", re.IGNORECASE)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_SESSION_PATH = re.compile(r"(/ws/)[^?&\s\"'/]+")


def redact(text: str, tokens: Iterable[str]) -> str:
    """``text`` with every ``token=`` value, every ``/ws/<session key>`` and every known token's text replaced."""
    text = _SESSION_PATH.sub(r"\1[session]", _TOKEN_QUERY.sub(r"\1[redacted]", text))
    for token in tokens:
        if token:
            text = text.replace(token, "[redacted]")
    return text


def printable(text: str, keep_newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on (ESC, CR, LF, other controls, bidi marks, line
    separators) written as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``): shown, never obeyed."""
    out = []
    for ch in text:
        if ch.isprintable() or ch == " " or (keep_newlines and ch == "\n"):
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)


class RedactingFilter(logging.Filter):
    """On a handler: the record's message and traceback with every token replaced (never dropped) and every
    control character escaped; a traceback's lines each start with ``    | `` (none can pass for a log line)."""

    def __init__(self, tokens: Iterable[str]) -> None:
        super().__init__()
        self.tokens = [t for t in tokens if t]

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = printable(redact(record.getMessage(), self.tokens))
        record.args = ()
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and type(error).__module__ == "aiohttp.http_exceptions":
            # a malformed request (anyone can send one): one line saying why, not a traceback each time
            why = " ".join(str(error).split())
            record.msg += ": " + printable(redact(why, self.tokens))
            record.exc_info, record.exc_text = None, None
        if record.exc_info or record.exc_text:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)  # type: ignore[arg-type]
            lines = redact(text, self.tokens).splitlines()
            record.exc_text = "\n".join(f"    | {printable(line)}" for line in lines)
            record.exc_info = None
        if record.stack_info:
            record.stack_info = printable(redact(record.stack_info, self.tokens), keep_newlines=True)
        return True


def access_logger_class(tokens: Iterable[str]) -> Any:
    """aiohttp's access logger: the path with its ``token=`` values, session keys and any token text redacted
    (and, through the handler's filter, every control character escaped), and the client's User-Agent."""
    from aiohttp.abc import AbstractAccessLogger

    known = [t for t in tokens if t]

    class AccessLogger(AbstractAccessLogger):
        def log(self, request: Any, response: Any, time: float) -> None:
            self.logger.info(
                '%s "%s %s" %s %s %.3fs "%s"',
                request.remote,
                request.method,
                redact(request.path_qs, known),
                response.status,
                response.body_length,
                time,
                request.headers.get("User-Agent", "-"),
            )

    return AccessLogger


class EscapingStream:
    """A text stream (the server's stdout) whose writes are redacted and escaped as log lines are, newlines
    kept: textual-serve writes a console's stderr there raw when the console fails to start."""

    def __init__(self, stream: Any, tokens: Iterable[str]) -> None:
        self.stream = stream
        self.tokens = [t for t in tokens if t]

    def write(self, text: str) -> int:
        self.stream.write(printable(redact(text, self.tokens), keep_newlines=True))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
