"""E2V datasets: for sample `001`, the clip `001.<video or image>`, the caption `001.txt`, and per element the first
existing file among `001<suffix>` for its suffixes. A sample missing a required element is skipped and counted; a
missing optional element leaves its slot empty. An image named like another sample's element (`001_face.png` beside
`001.mp4`) whose suffix no element declares is an element image the config does not use: it is no sample, and one
notice lists such suffixes."""
import logging
from collections import Counter
from pathlib import Path

from modules.dataLoader.concept_scan import ScanResult, read_text_file
from modules.util.config.DataConfig import ConceptConfig
from modules.util.config.E2VConfig import E2VDatasetConfig, strip_llm_caption_prefix
from modules.util.video_io import IMAGE_EXTENSIONS, MEDIA_EXTENSIONS

log = logging.getLogger(__name__)


def scan_e2v_dataset(dataset: E2VDatasetConfig, concept: ConceptConfig, result: ScanResult) -> None:
    root = Path(dataset.data_root)
    elements = dataset.elements_in_position_order()
    suffixes = [suffix for element in elements for suffix in element.suffixes]
    candidates = [p for p in sorted(root.iterdir()) if p.is_file() and p.suffix.lower() in MEDIA_EXTENSIONS
                  and not any(p.name.endswith(suffix) for suffix in suffixes)]   # declared element images
    stems = {p.stem for p in candidates}
    undeclared: Counter = Counter()
    for media in candidates:
        stem = media.stem
        owner = next((stem[:i] for i in range(len(stem)) if stem[i] == "_" and stem[:i] in stems), None)
        if owner is not None and media.suffix.lower() in IMAGE_EXTENSIONS:
            undeclared[media.name[len(owner):]] += 1
            continue
        found = []
        for element in elements:
            path = next((root / f"{stem}{suffix}" for suffix in element.suffixes
                         if (root / f"{stem}{suffix}").is_file()), None)
            found.append(str(path) if path else None)
        missing = [e.name for e, path in zip(elements, found) if e.required and path is None]
        if missing:
            result.skip(media, f"required element(s) {', '.join(missing)} missing (looked for "
                               f"{', '.join(stem + s for e in elements if e.name in missing for s in e.suffixes)})")
            continue
        if not any(found):
            result.skip(media, "no element file at all")
            continue
        caption_path = media.with_suffix(".txt")
        if not caption_path.is_file() and concept.caption_required:
            result.skip(media, f"no caption ({caption_path.name} is missing)")
            continue
        caption = read_text_file(caption_path).strip() if caption_path.is_file() else ""
        if dataset.remove_common_llm_caption_prefixes:
            caption = strip_llm_caption_prefix(caption)
        result.records.append({"path": str(media), "concept": concept, "caption": caption,
                               "elements": tuple(found),
                               "e2v_present": "".join("1" if p else "0" for p in found)})
    if undeclared:
        log.warning("E2V dataset %s: %d image(s) are named like element images but no element declares their "
                    "suffix, so they are not used: %s", root, sum(undeclared.values()),
                    ", ".join(f"{suffix} ({count})" for suffix, count in sorted(undeclared.items())))


def elements_as_vace_references(dataset, records: list[dict]) -> None:
    """`e2v.as_vace_references`: each E2V record (of `dataset`, not yet converted) becomes a VACE record whose
    reference images are its present elements in slot (`vae.position`) order; no control video, no mask."""
    order = sorted(range(len(dataset.elements)), key=lambda i: dataset.elements[i].vae.position)
    for record in records:
        if "elements" not in record:
            continue
        elements = record.pop("elements")
        record.pop("e2v_present", None)
        references = tuple(elements[i] for i in order if elements[i])
        record.update(control=None, mask=None, references=references, reference_count=len(references))
