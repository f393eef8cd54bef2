"""Every error a caller can be answered with, in one place: each layer raises these, api/app.py maps them to HTTP
(`HTTP` below), and a job's failure becomes a failed future whose category says whose fault it was
(`failure_category`, `error_payload`).

| error       | HTTP | raised where                                                                    |
|-------------|------|---------------------------------------------------------------------------------|
| UserError   | 400  | bad input, anywhere: the engine raises it before touching any state              |
| Cancelled   | -    | the sampler, when the client went away (a UserError: the request bills nothing)  |
| NotFound    | 404  | the service's lookups: unknown ids, and another tenant's (not revealed as such)  |
| Gone        | 410  | a finished or expired session, an interrupted request                            |
| OverBudget  | 402  | service/budgets.py, when a request's bound would pass a budget (no client retries a 402) |
| RateLimited | 429  | service/admission.py, over a per-tenant limit, with Retry-After                          |
| HomeInUse   | -    | start-up: another backend already serves this SQLite home                        |

Anything else a request raises is ours: a 500 (or a failed future of category "server") whose message names no
server path, with the traceback in the log.
"""

from __future__ import annotations

import json
import re


class UserError(ValueError):
    """Bad input from the caller. The message says what is wrong and how to fix it.

    The engine raises it before touching any state, so a session's weights and optimizer
    state are unchanged. The service reports it as a failed future with category "user".
    """


class Cancelled(UserError):
    """The client went away (a closed stream): the request failed, and bills nothing."""


class NotFound(LookupError):
    """An id the caller cannot see: unknown, or another tenant's."""


class Gone(Exception):
    """The thing existed but is over: a finished or expired session, an interrupted request (410)."""


class OverBudget(Exception):
    """The request would pass a budget (HTTP 402); the message names it, what was spent and how to raise it."""


class RateLimited(Exception):
    """Over a per-tenant limit (429); `retry_after` seconds is when to try again."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class HomeInUse(RuntimeError):
    """Another backend already serves this SQLite home; the message names it."""


# How the HTTP API answers each: its status, and the body's "category" (None: the body has none).
HTTP: dict[type[Exception], tuple[int, str | None]] = {
    UserError: (400, "user"),
    NotFound: (404, None),
    Gone: (410, None),
    OverBudget: (402, "budget"),
    RateLimited: (429, None),
}


# An absolute filesystem path of two segments or more: a '/' that starts a token (not a URL's '//', a
# ratio like 1/2 or a route like sessions/{id}/finish), and not one of this server's own routes
# (/v1/..., /oai/..., /api/...), which messages name to say where to send a request.
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.}])/(?!(?:v1|oai|api)/)(?:[^\s'\"/:,;(){}]+/)+[^\s'\"/:,;(){}]*")


def redact_paths(message: str) -> str:
    """A message fit to leave the server: absolute paths replaced, so no error reveals the server's folders."""
    return _ABSOLUTE_PATH.sub("<server path>", message)


def failure_category(error: Exception) -> str:
    """A failed job's category: the user's input, or the server's fault."""
    return "user" if isinstance(error, UserError) else "server"


def error_payload(message: str, category: str) -> bytes:
    """A failed future's answer; the message never carries a server path (the log has the full error)."""
    return json.dumps({"error": redact_paths(message), "category": category}).encode()
