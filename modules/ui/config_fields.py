"""What the GUI needs to know about a config field, found from its dotted path in the pydantic schema: its kind
(which widget shows it), its choices, its description (the tooltip), and how a widget's text becomes a value.

Text becomes a value the way `--config-value dotted.key=value` does on the command line (`config_io.parse_override`:
JSON when it parses, else the text), so an invalid entry gets exactly the message the CLI gives for that field.
"""
from __future__ import annotations

import enum
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from modules.util.config.E2VConfig import E2VDatasetConfig
from modules.util.config.TrainConfig import TrainConfig

# `e2v.datasets` holds the user's dataset objects as written (dict[str, Any]); the GUI edits them in the nested
# form, whose schema is E2VDatasetConfig.
ANY_SCHEMAS: dict[str, type[BaseModel]] = {"e2v.datasets": E2VDatasetConfig}

KINDS = ("bool", "int", "float", "str", "choice", "list", "tuple", "dict", "section", "sections", "any")


@dataclass(frozen=True)
class FieldSpec:
    path: str
    kind: str                        # one of KINDS
    annotation: Any
    description: str = ""
    choices: tuple[str, ...] = ()    # choice: the allowed values; other kinds: suggestions (int | Literal[...])
    optional: bool = False           # None is allowed: an empty entry means None
    item: Any = None                 # list / sections: the item annotation
    model: type[BaseModel] | None = None  # section / sections: the schema

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def simple(self) -> bool:
        """Shown by the generic section renderer (one widget)."""
        return self.kind in ("bool", "int", "float", "str", "choice", "list", "tuple")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return annotation, False


def _literal_values(annotation: Any) -> tuple[str, ...]:
    if typing.get_origin(annotation) is Literal:
        return tuple(str(v) for v in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(str(m.value) for m in annotation)
    return ()


def _strip_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def spec_for_annotation(path: str, annotation: Any, description: str = "") -> FieldSpec:
    annotation, optional = _unwrap_optional(_strip_annotated(annotation))
    origin = typing.get_origin(annotation)
    choices = _literal_values(annotation)
    if choices:
        return FieldSpec(path, "choice", annotation, description, choices, optional)
    if origin in (typing.Union, types.UnionType):
        # e.g. `int | Literal["model", "source"]`: free text with the literal values as suggestions
        suggestions = tuple(v for a in typing.get_args(annotation) for v in _literal_values(a))
        return FieldSpec(path, "str", annotation, description, suggestions, optional)
    if origin is list:
        item = _strip_annotated(typing.get_args(annotation)[0]) if typing.get_args(annotation) else Any
        if isinstance(item, type) and issubclass(item, BaseModel):
            return FieldSpec(path, "sections", annotation, description, (), optional, item, item)
        if path in ANY_SCHEMAS:
            return FieldSpec(path, "sections", annotation, description, (), optional, item, ANY_SCHEMAS[path])
        return FieldSpec(path, "list", annotation, description, (), optional, item)
    if origin is tuple:
        return FieldSpec(path, "tuple", annotation, description, (), optional, typing.get_args(annotation))
    if origin is dict:
        return FieldSpec(path, "dict", annotation, description, (), optional)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return FieldSpec(path, "section", annotation, description, (), optional, model=annotation)
    kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(annotation, "any")
    return FieldSpec(path, kind, annotation, description, (), optional)


def field_spec(path: str, root: type[BaseModel] = TrainConfig) -> FieldSpec:
    """The spec of `path` ("optimizer.learning_rate", "data.concepts.0.path"); KeyError for an unknown path."""
    parts = path.split(".")
    spec = FieldSpec("", "section", root, model=root)
    walked: list[str] = []
    for part in parts:
        if spec.kind == "sections" and part.isdigit():
            walked.append(part)
            spec = FieldSpec(".".join(walked), "section", spec.model, spec.description, model=spec.model)
            continue
        if spec.kind != "section" or part not in spec.model.model_fields:
            raise KeyError(f"{path}: {part!r} is not a field of {'.'.join(walked) or 'the config'}")
        info = spec.model.model_fields[part]
        walked.append(part)
        spec = spec_for_annotation(".".join(walked), info.annotation, info.description or "")
    return spec


def section_fields(section_path: str, root: type[BaseModel] = TrainConfig) -> list[FieldSpec]:
    """The fields of a section in declaration order ("" is the top level)."""
    model = field_spec(section_path, root).model if section_path else root
    prefix = f"{section_path}." if section_path else ""
    return [field_spec(prefix + name, root) for name in model.model_fields]


# --- text <-> value ------------------------------------------------------------------------------------------

def parse_text(spec: FieldSpec, text: str) -> Any:
    """A widget's text -> the JSON value stored in the config dict. Never raises: what cannot be converted is
    passed on as text, and the schema reports it with the CLI's message."""
    text = text.strip() if spec.kind != "str" else text
    if spec.optional and text.strip() == "":
        return None
    if spec.kind == "str" and not spec.choices:
        return text
    if spec.kind in ("list", "tuple"):
        if text.startswith("["):
            return _json_or_text(text)
        items = [t.strip() for t in text.split(",") if t.strip()]
        item = spec.item if spec.kind == "list" else None
        return [t if item is str else _json_or_text(t) for t in items]
    if spec.kind == "bool" and isinstance(text, str):
        return {"true": True, "false": False, "1": True, "0": False}.get(text.lower(), text)
    return _json_or_text(text)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _short(value: Any) -> str:
    """16/9 shows as 1.77778, not 1.7777777777777777 (the stored value stays exact until the field is edited)."""
    if isinstance(value, float) and len(repr(value)) > 10:
        return f"{value:.6g}"
    return json.dumps(value)


def format_value(spec: FieldSpec, value: Any) -> str:
    """A stored JSON value -> the text a widget shows (the inverse of parse_text for valid values)."""
    if value is None:
        return ""
    if spec.kind in ("list", "tuple") and isinstance(value, (list, tuple)):
        return ", ".join(v if isinstance(v, str) else _short(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
