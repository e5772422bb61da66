"""Where a run's files live on the remote, and the config the remote runs: every path field of the judged config
(found by its type, PathText / WritePath in modules/util/config/bounds.py, never by its name) is moved under the
remote's work folder. Inputs that exist here are mirrored under `<work_dir>/files/<absolute local path>` and sent;
inputs under a `remote.model_paths` entry become that remote path and are not sent; what the run writes (workspace,
cache, output) goes under `<work_dir>/out/<absolute local path>`. A path that exists nowhere here (a hub id) is
passed on as written."""
from __future__ import annotations

import posixpath
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from modules.util.config.bounds import check_usable_path

_SKIPPED_SECTIONS = {"remote"}   # the connection's own settings stay here


@dataclass
class RemoteLayout:
    work_dir: str   # absolute, on the remote

    @property
    def files(self) -> str:
        return posixpath.join(self.work_dir, "files")

    @property
    def manifest(self) -> str:
        return posixpath.join(self.files, ".manifest.json")

    def input_path(self, local: Path) -> str:
        return posixpath.join(self.files, *local.parts[1:])

    def output_path(self, local: Path) -> str:
        return posixpath.join(self.work_dir, "out", *local.parts[1:])

    def run_dir(self, run_name: str) -> str:
        return posixpath.join(self.work_dir, "runs", run_name)


@dataclass
class Relocation:
    inputs: dict[Path, str] = field(default_factory=dict)     # local file or folder -> remote path (to send)
    outputs: dict[str, tuple[Path, str]] = field(default_factory=dict)  # field -> (local path, remote path)
    on_remote: dict[str, str] = field(default_factory=dict)   # field -> remote model path (not sent)


def _is_path(metadata) -> tuple[bool, bool]:
    """(a path, a written path) from a field's validators."""
    functions = [getattr(item, "func", None) for item in metadata]
    if any(getattr(f, "__name__", "") == "_one_folder_name" for f in functions):
        return False, False   # run_name: a folder name, not a path
    return check_usable_path in functions, any(getattr(f, "__name__", "") == "_not_blank" for f in functions)


def _path_kind(annotation, metadata) -> str:
    """'path', 'write', 'list', 'dict' or '' for a field."""
    is_path, written = _is_path(metadata)
    if is_path:
        return "write" if written else "path"
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, dict) and arguments:
        inner = arguments[-1]
        if typing.get_origin(inner) is typing.Annotated and _is_path(typing.get_args(inner)[1:])[0]:
            return "list" if origin is list else "dict"
    return ""


def path_fields(model: BaseModel, prefix: str = ""):
    """(dotted name, owner model, attribute, kind) of every path field in the config."""
    for name, info in type(model).model_fields.items():
        if not prefix and name in _SKIPPED_SECTIONS:
            continue
        value = getattr(model, name)
        dotted = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            yield from path_fields(value, dotted + ".")
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            for index, item in enumerate(value):
                yield from path_fields(item, f"{dotted}.{index}.")
        else:
            kind = _path_kind(info.annotation, info.metadata)
            if kind:
                yield dotted, model, name, kind


def _model_path(local: Path, model_paths: dict[str, str]) -> str | None:
    for here, there in model_paths.items():
        root = Path(here).expanduser().resolve()
        if local == root or root in local.parents:
            return posixpath.join(there, *local.relative_to(root).parts)
    return None


def relocate(config, layout: RemoteLayout) -> Relocation:
    """Rewrites the config's paths in place for the remote; returns what to send and what comes home."""
    relocation = Relocation()

    def move(dotted: str, value: str, written: bool) -> str:
        if not value:
            return value
        local = Path(value).expanduser().resolve()
        if written:
            remote = layout.output_path(local)
            relocation.outputs[dotted] = (local, remote)
            return remote
        remote = _model_path(local, config.remote.model_paths)
        if remote is not None:
            relocation.on_remote[dotted] = remote
            return remote
        if not local.exists():
            return value   # a hub id, or a path the config check has judged already
        remote = layout.input_path(local)
        relocation.inputs[local] = remote
        return remote

    for dotted, owner, name, kind in list(path_fields(config)):
        value = getattr(owner, name)
        if kind in ("path", "write"):
            setattr(owner, name, move(dotted, value, kind == "write"))
        elif kind == "list":
            setattr(owner, name, [move(f"{dotted}.{i}", v, False) for i, v in enumerate(value)])
        elif kind == "dict":
            setattr(owner, name, {k: move(f"{dotted}.{k}", v, False) for k, v in value.items()})
    # the dataset TOML's datasets are concepts of the judged config already; the remote reads them from there
    config.data.dataset_config = ""
    config.demo_assets = False   # made here by the config check, and sent
    return relocation


def files_to_send(relocation: Relocation, hashes) -> list:
    """Every file under the inputs, with its remote path and hash."""
    from modules.remote.transfer import FileToSend
    result, seen = [], set()
    for local, remote in sorted(relocation.inputs.items()):
        pairs = [(local, remote)] if local.is_file() else [
            (path, posixpath.join(remote, *path.relative_to(local).parts))
            for path in sorted(local.rglob("*")) if path.is_file()]
        for path, there in pairs:
            if there in seen:
                continue
            seen.add(there)
            digest, size = hashes.sha256(path)
            result.append(FileToSend(path, there, size, digest))
    return result
