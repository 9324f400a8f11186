"""A strict reader of protobuf text format, the language of Triton's ``config.pbtxt``.

It reads the syntax only (fields, nested messages, lists, quoted strings, numbers, enum
names, ``#`` comments) into a tree of :class:`Message` and :class:`Value`, each with its
line; :func:`message_from_json` builds the same tree from protobuf's JSON form. What the
fields mean is :mod:`batching.triton_repository`'s job. Anything that is not text format
is a :class:`PbtxtError` naming the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\f\v]+|\#[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?[fF]?(?![\w.]))
  | (?P<ident>-?[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[:{}\[\]<>,;])
""", re.VERBOSE)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0"}
_CLOSE = {"{": "}", "<": ">"}
MAX_DEPTH = 32


class PbtxtError(ValueError):
    """Text that is not protobuf text format; the message names the line."""


@dataclass(frozen=True, slots=True)
class Value:
    """One field value: ``kind`` is "string", "number", "ident" (an enum name, true or
    false) or "message"."""

    kind: str
    text: str
    line: int
    message: Message | None = None

    def number(self) -> int | float:
        text = self.text.rstrip("fF")
        return int(text) if re.fullmatch(r"[-+]?\d+", text) else float(text)


@dataclass(slots=True)
class Message:
    line: int
    fields: dict[str, list[Value]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str
    text: str
    line: int


def parse_pbtxt(text: str) -> Message:
    """The top-level message of ``text``."""
    tokens = _tokens(text)
    reader = _Reader(tokens)
    message = reader.message(None, 0)
    return message


def _tokens(text: str) -> list[_Token]:
    tokens, line, at = [], 1, 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise PbtxtError(f"line {line}: unexpected character {text[at]!r}")
        kind = match.lastgroup or ""
        if kind == "newline":
            line += 1
        elif kind != "space":
            tokens.append(_Token(kind, match.group(), line))
        at = match.end()
    tokens.append(_Token("end", "", line))
    return tokens


class _Reader:
    def __init__(self, tokens: list[_Token]) -> None:
        self._tokens = tokens
        self._at = 0

    def _peek(self) -> _Token:
        return self._tokens[self._at]

    def _next(self) -> _Token:
        token = self._tokens[self._at]
        self._at += 1
        return token

    def message(self, close: str | None, depth: int) -> Message:
        if depth > MAX_DEPTH:
            raise PbtxtError(f"line {self._peek().line}: messages nest too deeply")
        message = Message(self._peek().line)
        while True:
            token = self._next()
            if token.kind == "end" and close is None:
                return message
            if token.kind == "punct" and token.text == close:
                return message
            if token.kind != "ident":
                expected = f"a field name or {close!r}" if close else "a field name"
                raise PbtxtError(f"line {token.line}: expected {expected}, got "
                                 f"{token.text or 'the end of the file'!r}")
            values = self._field(token, depth)
            message.fields.setdefault(token.text, []).extend(values)
            if self._peek().kind == "punct" and self._peek().text in ",;":
                self._next()

    def _field(self, name: _Token, depth: int) -> list[Value]:
        colon = self._peek().kind == "punct" and self._peek().text == ":"
        if colon:
            self._next()
        token = self._peek()
        if token.kind == "punct" and token.text == "[":
            self._next()
            return self._list(name, depth)
        if token.kind == "punct" and token.text in _CLOSE:
            return [self._nested(depth)]
        if not colon:
            raise PbtxtError(f"line {name.line}: expected ':' after {name.text!r}")
        return [self._scalar(name)]

    def _list(self, name: _Token, depth: int) -> list[Value]:
        values: list[Value] = []
        while True:
            token = self._peek()
            if token.kind == "punct" and token.text == "]":
                self._next()
                return values
            if values:
                if not (token.kind == "punct" and token.text == ","):
                    raise PbtxtError(f"line {token.line}: expected ',' or ']' in the list "
                                     f"{name.text!r}, got {token.text or 'the end'!r}")
                self._next()
                token = self._peek()
            if token.kind == "punct" and token.text in _CLOSE:
                values.append(self._nested(depth))
            else:
                values.append(self._scalar(name))

    def _nested(self, depth: int) -> Value:
        opener = self._next()
        message = self.message(_CLOSE[opener.text], depth + 1)
        return Value("message", "", opener.line, message)

    def _scalar(self, name: _Token) -> Value:
        token = self._next()
        if token.kind == "string":
            text = token.text[1:-1]
            while self._peek().kind == "string":  # adjacent strings concatenate
                text += self._next().text[1:-1]
            return Value("string", _unescape(text, token.line), token.line)
        if token.kind in ("number", "ident"):
            return Value(token.kind, token.text, token.line)
        raise PbtxtError(f"line {token.line}: expected a value for {name.text!r}, got "
                         f"{token.text or 'the end of the file'!r}")


def _unescape(text: str, line: int) -> str:
    out, at = [], 0
    while at < len(text):
        char = text[at]
        if char != "\\":
            out.append(char)
            at += 1
            continue
        escaped = text[at + 1:at + 2]
        if escaped not in _ESCAPES:
            raise PbtxtError(f"line {line}: unsupported escape '\\{escaped}' in a string")
        out.append(_ESCAPES[escaped])
        at += 2
    return "".join(out)


def message_from_json(document: dict[str, Any], maps: tuple[str, ...] = ()) -> Message:
    """The tree of a message written in protobuf's JSON form (lines are 0). ``maps`` names
    the map fields: a JSON object of key -> value there, in text format a list of
    ``{key, value}`` entries."""
    message = Message(0)
    for name, item in document.items():
        if name in maps and isinstance(item, dict):
            values = [_entry(str(key), value, maps) for key, value in item.items()]
        else:
            items = item if isinstance(item, list) else [item]
            values = [_value(element, maps) for element in items if element is not None]
        if values:
            message.fields[name] = values
    return message


def _entry(key: str, value: Any, maps: tuple[str, ...]) -> Value:
    entry = Message(0, {"key": [Value("string", key, 0)], "value": [_value(value, maps)]})
    return Value("message", "", 0, entry)


def _value(item: Any, maps: tuple[str, ...]) -> Value:
    if isinstance(item, dict):
        return Value("message", "", 0, message_from_json(item, maps))
    if isinstance(item, bool):
        return Value("ident", "true" if item else "false", 0)
    if isinstance(item, int | float):
        return Value("number", repr(item), 0)
    return Value("string", str(item), 0)
