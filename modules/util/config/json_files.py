"""Reading JSON files and text with one clear ConfigError per way they can be unreadable. Its own module below every
config class, so that a section reading a nested file (an E2V config) and config_io use it without importing each
other."""
import json
import os
from pathlib import Path
from typing import Any

from modules.util.config.ConfigError import MAX_CONFIG_BYTES, ConfigError
from modules.util.text_encoding import decode_with_bom

# with MAX_CONFIG_BYTES, keeps a wrong file (a video, a dump) from costing memory or a traceback
MAX_JSON_DEPTH = 64


def _json_depth_problem(value: Any) -> str | None:
    stack = [(value, 1)]
    while stack:  # iterative: a deep document must not exhaust the recursion limit here either
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nested deeper than {MAX_JSON_DEPTH} levels"
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return None


def parse_json_text(text: str, source: str, not_json_as_text: bool = False) -> Any:
    """JSON text -> value, or ConfigError naming `source`: syntax errors with line and column (or, with
    `not_json_as_text`, the text itself as a string), nesting deeper than MAX_JSON_DEPTH, integers longer than
    Python converts (4300 digits)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if not_json_as_text:
            return text
        raise ConfigError([f"line {e.lineno} column {e.colno}: {e.msg}"], source) from None
    except RecursionError:
        raise ConfigError([f"nested deeper than {MAX_JSON_DEPTH} levels"], source) from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise ConfigError([f"a number is too long: {str(e).split(';')[0]}"], source) from None
    problem = _json_depth_problem(value)
    if problem:
        raise ConfigError([problem], source)
    return value


def read_json_file(path: str | os.PathLike, what: str = "config") -> Any:
    """A UTF-8 JSON file of at most MAX_CONFIG_BYTES -> value; every way it can be unreadable is a ConfigError."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError([f"{what} file {str(path)!r} is a folder; name the JSON file in it"], str(path))
    if not path.is_file():
        raise ConfigError([f"{what} file {str(path)!r} does not exist"], str(path))
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError([f"{what} file is {size} bytes; a config is at most {MAX_CONFIG_BYTES}"], str(path))
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError([f"{what} file cannot be read: {e.strerror or e}"], str(path)) from None
    try:
        # a byte-order mark names the encoding (Notepad's "Unicode" is UTF-16); without one, UTF-8
        text = decode_with_bom(raw, path)
        text = raw.decode("utf-8") if text is None else text
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text: byte {raw[e.start]:#04x} at offset {e.start} (save the file as "
                           f"UTF-8)"], str(path)) from None
    return parse_json_text(text, str(path))


def read_json_object(path: str | os.PathLike, what: str = "config") -> dict:
    data = read_json_file(path, what)
    if not isinstance(data, dict):
        raise ConfigError([f"the file must hold a JSON object, not {type(data).__name__}"], str(path))
    return data
