"""Which scanned files are held out for the validation loss: every file of a concept marked `validation`, and
`data.validation_split` of each other concept's files. The choice depends only on each file's path inside its
concept (a hash), never on the seed, the order of the scan or the number of processes, so every run and every rank
holds out the same files; a file's every item (windows, frame counts) goes with it."""
import hashlib
import logging
from pathlib import Path

from modules.util.config.DataConfig import DataConfig

log = logging.getLogger(__name__)


def _file_key(path: str, concept_path: str) -> str:
    """The file's path inside its concept's folder (a manifest's folder), so moving the dataset keeps the split."""
    root = Path(concept_path)
    root = root.parent if root.suffix == ".jsonl" else root
    try:
        name = Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        name = Path(path).name
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def held_out_count(files: int, fraction: float) -> int:
    """round(files x fraction), at least 1 when the fraction is set and at most files - 1 (a concept keeps one file
    to train on)."""
    if fraction <= 0 or files < 2:
        return 0
    return min(files - 1, max(1, round(files * fraction)))


def split_validation(records: list[dict], data: DataConfig) -> tuple[list[dict], list[dict]]:
    """(training records, validation records). Validation records carry a copy of their concept without caption
    dropout: the validation loss always sees the caption."""
    by_concept: dict[int, list[dict]] = {}
    for record in records:
        by_concept.setdefault(id(record["concept"]), []).append(record)
    held_out_paths: set[str] = set()
    for members in by_concept.values():
        concept = members[0]["concept"]
        paths = list(dict.fromkeys(r["path"] for r in members))
        if concept.validation:
            held_out_paths.update(paths)
            continue
        count = held_out_count(len(paths), data.validation_split)
        if data.validation_split > 0 and count == 0:
            log.warning("data.validation_split: concept %s has %d file(s); none is held out (one must stay for "
                        "training)", concept.name or concept.path, len(paths))
        held_out_paths.update(sorted(paths, key=lambda p: _file_key(p, concept.path))[:count])
    training = [r for r in records if r["path"] not in held_out_paths]
    copies: dict[int, object] = {}
    validation = []
    for record in records:
        if record["path"] in held_out_paths:
            concept = record["concept"]
            copy = copies.setdefault(id(concept), concept.model_copy(update={"caption_dropout": 0.0}))
            validation.append({**record, "concept": copy})
    return training, validation
