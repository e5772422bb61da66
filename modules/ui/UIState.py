"""The config being edited, and the bindings between it and the widgets. Imports no toolkit.

The config is held as the JSON dict that `scripts/train.py --config-path` reads (every field, defaults included).
A widget binds to one field by its dotted path (`optimizer.learning_rate`, `lora.rank`, `data.concepts.0.path`) with
two callbacks: `show(text)` puts the field's value into the widget, `show_error(message | None)` marks it. A widget
that the user edits calls `set_text(path, text)`; the text is converted by the field's pydantic type exactly as the
CLI's `--config-value` converts it, and the whole config is validated again by the CLI's schema check, so a field is
marked with the message the CLI would print for it.

Problems whose field has no widget (a cross-field check) are kept in `unplaced_problems`.
"""
from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modules.ui.config_fields import FieldSpec, field_spec, format_value, parse_text
from modules.util.atomic import atomic_write_text
from modules.util.config.config_io import (CONFIG_VERSION, VERSION_KEY, ConfigError, config_from_dict, config_to_dict,
                                           deep_merge, migrate)
from modules.util.config.TrainConfig import TrainConfig

Show = Callable[[str], None]
ShowError = Callable[[str | None], None]


def problem_field(problem: str) -> str:
    """'optimizer.learning_rate: -1 is not allowed: ...' -> 'optimizer.learning_rate'."""
    return problem.split(":", 1)[0].strip() if ":" in problem else ""


class UIState:
    def __init__(self, data: dict | None = None):
        self.data: dict = {}
        self._bindings: dict[str, list[tuple[Show, ShowError | None]]] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.errors: dict[str, str] = {}          # bound path -> message
        self.problems: list[str] = []             # every problem of the last validation, as the CLI words it
        self.unplaced_problems: list[str] = []
        # problems found by checks beyond the schema, by source: "start" (prepare_config), "e2v" (the inline
        # E2V datasets, which the schema holds as plain objects)
        self.external: dict[str, list[str]] = {}
        self.load(data or {})

    # ---- the config ------------------------------------------------------------------------------------------

    def load(self, data: dict, source: str = "") -> None:
        """Replaces the config by `data` (sparse or full, any known version) over the defaults; every bound
        widget shows its new value. Raises ConfigError only for an unknown version: invalid values are loaded and
        marked, so they can be fixed here."""
        defaults = config_to_dict(TrainConfig())
        defaults.pop(VERSION_KEY)
        self.data = deep_merge(defaults, migrate(data, source))
        self.external = {}
        if not self.validate():
            # valid: hold the CLI's full form (list items, e.g. sparse concepts, get every field)
            self.data = config_to_dict(self.config())
            self.data.pop(VERSION_KEY)
        for path in list(self._bindings):
            self._show(path)
        for listener in list(self._listeners):
            listener("")  # "": everything changed

    def spec(self, path: str) -> FieldSpec:
        return field_spec(path)

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return default
        return node

    def text(self, path: str) -> str:
        return format_value(self.spec(path), self.get(path))

    def set(self, path: str, value: Any, origin: Show | None = None) -> None:
        """Stores a JSON value at `path` (creating missing sections), validates, and updates the widgets bound to
        it except `origin` (the one being typed into keeps its text and cursor)."""
        *parents, last = path.split(".")
        node: Any = self.data
        for part in parents:
            if isinstance(node, list):
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        if "start" in self.external:
            self.external["start"] = [p for p in self.external["start"] if not _covers(path, problem_field(p))]
        self.validate()
        self._show(path, origin)
        for listener in list(self._listeners):
            listener(path)

    def set_text(self, path: str, text: str, origin: Show | None = None) -> str | None:
        """A widget's text -> the field; returns the field's message when the value is not allowed."""
        self.set(path, parse_text(self.spec(path), text), origin)
        return self.errors.get(path)

    def list_append(self, path: str, item: Any) -> int:
        items = list(self.get(path) or [])
        items.append(item)
        self.set(path, items)
        return len(items) - 1

    def list_remove(self, path: str, index: int) -> None:
        items = list(self.get(path) or [])
        del items[index]
        self.unbind_prefix(f"{path}.")
        self.set(path, items)

    def config(self) -> TrainConfig:
        """The validated config; ConfigError with every problem otherwise."""
        return config_from_dict(self.json_dict(), "the GUI")

    def json_dict(self) -> dict:
        return {VERSION_KEY: CONFIG_VERSION, **copy.deepcopy(self.data)}

    def save(self, path: str | os.PathLike) -> None:
        """Writes what `train.py --config-path` reads: the validated config in the CLI's own form when it is valid,
        else the fields as they stand (so a half-edited config is not lost)."""
        try:
            data = config_to_dict(self.config())
        except ConfigError:
            data = self.json_dict()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=4) + "\n")

    # ---- validation ------------------------------------------------------------------------------------------

    def validate(self) -> list[str]:
        try:
            self.config()
            problems = []
        except ConfigError as error:
            problems = list(error.problems)
        extra = [p for found in self.external.values() for p in found]
        self.problems = problems + [p for p in extra if p not in problems]
        self._place(self.problems)
        return self.problems

    def add_problems(self, problems: list[str], source: str = "start") -> None:
        """Problems found beyond the schema (the file-system and model checks run at Start, the E2V dataset
        checks), marked likewise; they replace the earlier ones of the same source."""
        self.external[source] = list(problems)
        self.validate()

    def _place(self, problems: list[str]) -> None:
        old = self.errors
        self.errors, self.unplaced_problems = {}, []
        for problem in problems:
            target = self._bound_field_for(problem_field(problem))
            if target is None:
                self.unplaced_problems.append(problem)
            else:
                self.errors[target] = (self.errors[target] + "\n" if target in self.errors else "") + problem
        for path in set(old) | set(self.errors):
            if old.get(path) != self.errors.get(path):
                for _, show_error in self._bindings.get(path, []):
                    if show_error is not None:
                        show_error(self.errors.get(path))

    def _bound_field_for(self, field: str) -> str | None:
        """The bound path a problem belongs to: the field itself, else its nearest bound parent (a problem in an
        element of a list field is shown at the list)."""
        parts = field.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in self._bindings:
                return candidate
        return None

    # ---- bindings --------------------------------------------------------------------------------------------

    def bind(self, path: str, show: Show, show_error: ShowError | None = None) -> None:
        self.spec(path)  # an unknown path is a programming error: fail at once
        self._bindings.setdefault(path, []).append((show, show_error))
        show(self.text(path))
        self._place(self.problems)
        if show_error is not None:
            show_error(self.errors.get(path))

    def unbind_prefix(self, prefix: str) -> None:
        for path in [p for p in self._bindings if p.startswith(prefix)]:
            del self._bindings[path]

    def bound_paths(self) -> list[str]:
        return list(self._bindings)

    def on_change(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def _show(self, path: str, origin: Show | None = None) -> None:
        text = self.text(path)
        for show, _ in self._bindings.get(path, []):
            if show != origin:  # bound methods: equal, never identical
                show(text)


def _covers(edited: str, field: str) -> bool:
    return bool(field) and (field == edited or field.startswith(edited + ".") or edited.startswith(field + "."))
