"""Writes a caption file per clip and image of a folder with a vision-language model (Qwen2.5-VL class).

  run-cmd.sh caption --input DIR
  run-cmd.sh caption --input DIR --model /models/Qwen2.5-VL-7B-Instruct --frames 8 --prefix "sks dog, "
  run-cmd.sh caption --input DIR --overwrite --prompt "Describe this {kind} in one sentence."

The caption of `clip.mp4` is `clip.txt` (the trainer's sidecar). Existing captions are kept (--skip-existing, the
default) unless --overwrite is given, and each caption is written as soon as it is made: a stopped run continues where
it stopped when started again. Video frames are sampled evenly (--frames). The prompt template may use {kind}
(image / video), {name} (the file's name without extension) and {frames}. Unreadable files are skipped with one
warning each. Exit status: 0 done, 1 files skipped, 2 bad arguments or the model is not available.
"""
import argparse
import logging
import sys

import _bootstrap  # noqa: F401

from modules.captioning.QwenVLCaptioner import DEFAULT_MODEL, DEFAULT_PROMPT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run-cmd.sh caption", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="the folder of clips and images")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a hub id or a local model folder "
                                                                f"(default {DEFAULT_MODEL})")
    parser.add_argument("--allow-download", action="store_true", help="download the model when it is not cached")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the request, a template with {kind} {name} {frames}")
    parser.add_argument("--frames", type=int, default=8, help="frames shown per video, evenly spaced (default 8)")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument("--overwrite", action="store_true", help="replace existing captions")
    existing.add_argument("--skip-existing", action="store_true", help="keep existing captions (the default)")
    parser.add_argument("--prefix", default="", help='written before every caption, e.g. "sks dog, "')
    parser.add_argument("--extension", default=".txt", help="the caption files' extension (default .txt)")
    parser.add_argument("--recursive", action="store_true", help="also caption the sub-folders' files")
    parser.add_argument("--batch-size", type=int, default=1, help="items per generate call (default 1)")
    parser.add_argument("--max-pixels", type=int, default=448 * 448,
                        help="pixels per picture the model sees; larger frames are scaled down (default 200704)")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="the longest caption in tokens")
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when there is one)")
    return parser


def check(args) -> list[str]:
    problems = []
    for name, low in (("frames", 1), ("batch_size", 1), ("max_pixels", 28 * 28), ("max_new_tokens", 1)):
        if getattr(args, name) < low:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {low}")
    if not args.extension.startswith(".") or len(args.extension) < 2:
        problems.append(f"--extension {args.extension!r}: must start with a dot, e.g. .txt")
    return problems


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from modules.captioning.caption_targets import find_targets, format_prompt, still_to_caption
    from modules.captioning.QwenVLCaptioner import ModelNotAvailableError, QwenVLCaptioner, caption_folder

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    problems = check(args)
    try:
        targets = find_targets(args.input, args.extension, args.recursive)
    except FileNotFoundError as error:
        problems.append(f"--input {error}")
        targets = []
    if targets:
        try:
            format_prompt(args.prompt, targets[0], args.frames)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        print("\n".join(f"caption: {p}" for p in problems), file=sys.stderr)
        return 2
    todo = still_to_caption(targets, args.overwrite)
    print(f"caption: {len(targets)} files in {args.input}, {len(targets) - len(todo)} already captioned"
          f"{' (overwritten)' if args.overwrite else ''}, {len(todo)} to caption", flush=True)
    if not todo:
        return 0
    try:
        captioner = QwenVLCaptioner(args.model, allow_download=args.allow_download, device=args.device,
                                    max_new_tokens=args.max_new_tokens)
    except ModelNotAvailableError as error:
        print(f"caption: {error}", file=sys.stderr)
        return 2
    with tqdm(total=len(todo), unit="file", desc="captioning") as bar:
        written, skipped = caption_folder(captioner, todo, args.prompt, args.frames, args.max_pixels,
                                          args.batch_size, args.prefix,
                                          progress=lambda done, total: bar.update(done - bar.n))
    print(f"caption: wrote {written} captions; {len(skipped)} files skipped (unreadable)")
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
