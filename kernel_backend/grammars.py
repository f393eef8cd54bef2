"""What a decoding constraint is: a grammar, in llguidance's Lark dialect, that a sample's generated text must
match (a JSON schema is written into one as `%json {...}`). This module writes the grammars the endpoints need
(response_format's JSON, a tool call's arguments, the tinker wire's `constraint`: a schema, a regex or a grammar)
and bounds and checks a grammar before any work starts: a
grammar too large, or one that does not compile (a schema feature llguidance does not implement, a bad $ref),
is a UserError naming what is wrong. It is plain text here; the engine compiles it for its tokenizer and
applies it while decoding (kernel_backend/engine/constraints.py).
"""

from __future__ import annotations

import json
import re

import llguidance

from kernel_backend.errors import UserError

# A grammar's most bytes. A JSON schema of a few hundred properties fits; compile time grows with the grammar,
# so this bounds the work a request can ask of the compiler before it starts.
MAX_GRAMMAR_BYTES = 64 * 1024
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema, what: str) -> str:
    """A Lark rule body for one JSON value that validates against `schema` (`what` names it in errors)."""
    if not isinstance(schema, dict):
        raise UserError(f"{what} must be a JSON schema object, got {type(schema).__name__}")
    # JSON as json.dumps writes it (", " and ": ", no other whitespace): a model may not pad a reply with
    # whitespace until max_tokens, the known failure of flexible-whitespace JSON grammars.
    try:
        return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
    except RecursionError:
        raise UserError(f"{what} is nested too deeply to enforce; flatten it (use $defs and $ref)") from None


def json_grammar(schema, what: str) -> str:
    """The grammar of one JSON value matching `schema`, checked."""
    return check(f"start: value\nvalue: {json_rule(schema, what)}\n", what)


def constraint(obj, what: str = "constraint") -> str:
    """The grammar of asample's `constraint` (ours, beyond Tinker: docs/tinker-surface.md): exactly one of
    {"json_schema": {...}} (one JSON value valid against it), {"regex": "..."} (the whole output matches it; \\d
    and \\w are ASCII, as in JSON schema) or {"lark": "..."} (llguidance's Lark, `start` the whole output),
    checked."""
    kinds = ("json_schema", "regex", "lark")
    if not isinstance(obj, dict) or len(obj) != 1 or next(iter(obj)) not in kinds:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise UserError(f'{what} must be one of {{"json_schema": {{...}}}}, {{"regex": "..."}} or {{"lark": "..."}}; '
                        f"got {got}")
    (kind, value), = obj.items()
    if kind == "json_schema":
        return json_grammar(value, f"{what}.json_schema")
    if not isinstance(value, str):
        raise UserError(f"{what}.{kind} must be a string, got {type(value).__name__}")
    if kind == "regex":
        return check(f"start: /{llguidance.regex_to_lark(value, 'dw')}/\n", f"{what}.regex")
    return check(value, f"{what}.lark")


def literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def check(grammar: str, what: str = "the grammar") -> str:
    """`grammar` if it is within bounds and compiles; else a UserError that says why (llguidance's message names
    the schema feature it does not implement or the part it cannot read)."""
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise UserError(f"{what} is {size} bytes as a grammar, more than the {MAX_GRAMMAR_BYTES} this server "
                        "compiles; send a smaller schema")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        # llguidance says what is wrong after where in our grammar text, and ends with a listing of that text: the
        # sender wrote neither.
        lines = []
        for line in error.strip().splitlines():
            if re.match(r"\s*\d+ \|", line):
                break
            lines.append(line.strip())
        reason = re.sub(r"^at \d+\(\d+\): ", "", " ".join(filter(None, lines)))[:500]
        raise UserError(f"{what} cannot be enforced: {reason}")
    return grammar
