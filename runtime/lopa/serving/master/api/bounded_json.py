"""JSON request bodies parsed at a bounded cost (pure: no I/O).

What parsing costs is set by how many values a body holds more than by its bytes: 3 MB of `[]`
takes half a second in the standard library's C parser, which holds the GIL all along, so every
other request waits as long. `loads` bounds the values a body may hold (`max_values`, from the
server's limits), and so its parsing time, before building any of them:

- A body with at most `max_values` commas, colons and opening brackets cannot hold more values
  than that, whatever its strings say: the C parser reads it.
- Any other body (many values, or many commas inside its strings) is read by the standard library's
  pure-Python parser, which counts the values as it builds them and stops at the bound. Python code
  lets other threads in every few milliseconds: parsed off the event loop, it never stalls it.
"""

from __future__ import annotations

import json
from json.decoder import JSONArray, JSONObject
from json.scanner import py_make_scanner
from typing import Any

STRUCTURE = (",", ":", "[", "{")  # a value inside an array or an object follows one of these


class TooManyValues(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} JSON values")
        self.limit = limit


class NotJson(ValueError):
    """The text is not JSON (the reason says why, without the text)."""


def loads(text: str, max_values: int) -> Any:
    """The JSON value of `text`; TooManyValues past `max_values` values (before building the rest),
    NotJson when it does not parse, RecursionError when nested too deeply."""
    try:
        if sum(text.count(mark) for mark in STRUCTURE) <= max_values:
            return json.loads(text)
        return _CountingDecoder(max_values).decode(text)
    except json.JSONDecodeError as error:
        raise NotJson(f"not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})") from None
    except TooManyValues:
        raise
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise NotJson("a number has too many digits") from None


class _CountingDecoder(json.JSONDecoder):
    """The pure-Python decoder, counting every value inside an array or an object."""

    def __init__(self, max_values: int) -> None:
        super().__init__()
        self.max_values, self.values = max_values, 0

        def counted(scan_once: Any) -> Any:
            def scan(string: str, index: int) -> Any:
                self.values += 1
                if self.values > self.max_values:
                    raise TooManyValues(self.max_values)
                return scan_once(string, index)

            return scan

        def parse_array(s_and_end: Any, scan_once: Any) -> Any:
            return JSONArray(s_and_end, counted(scan_once))

        def parse_object(s_and_end: Any, strict: bool, scan_once: Any, *rest: Any) -> Any:
            return JSONObject(s_and_end, strict, counted(scan_once), *rest)

        self.parse_array, self.parse_object = parse_array, parse_object
        self.scan_once = py_make_scanner(self)


def unreadable(error: Exception) -> str:
    """Why a request body could not be read as JSON (for its 400), from what decoding it raised."""
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text: byte 0x{error.object[error.start]:02x} at offset {error.start}"
    if isinstance(error, LookupError):
        return "unknown charset in the Content-Type header"
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, NotJson):
        return str(error)
    return "not valid JSON"
