"""Speed and memory benchmarks (DESIGN.md section 8; what the numbers mean: docs/benchmarks.md).

  benchmark.py data [--clips 4 --width 832 --height 480 --frames 81 --source-fps 30 --threads 0] [--json PATH]
  benchmark.py train --variant wan2.1-1.3b --width 128 --height 128 --frames 9 --steps 3 --dtype bf16
                     [--gradient-checkpointing] [--lora-rank 32 | --full] [--device cpu|cuda] [--json PATH]

Exit codes: 0 measured, 2 bad arguments, 3 the run does not fit in the device's memory (refused before it
started, or out of CUDA memory during the steps).
"""
import argparse
import sys

import _bootstrap  # noqa: F401


def _parser() -> argparse.ArgumentParser:
    from modules.benchmark.architectures import VARIANT_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="decode / resample / resize throughput and a warm cached epoch")
    data.add_argument("--clips", type=int, default=4, help="synthetic source clips to write")
    data.add_argument("--width", type=int, default=832, help="bucket width (and source width by default)")
    data.add_argument("--height", type=int, default=480, help="bucket height (and source height by default)")
    data.add_argument("--frames", type=int, default=81, help="frames per training clip (4k+1)")
    data.add_argument("--source-fps", type=float, default=30.0)
    data.add_argument("--source-seconds", type=float, default=6.0)
    data.add_argument("--source-width", type=int, help="source clip width (default: --width)")
    data.add_argument("--source-height", type=int, help="source clip height (default: --height)")
    data.add_argument("--threads", type=int, default=0,
                      help="clips decoded concurrently in (a) and (b), and data.dataloader_threads in (c); "
                           "0: in the calling thread")
    data.add_argument("--repeats", type=int, default=2, help="passes of (a) and (b); the fastest is reported")
    data.add_argument("--warm-epochs", type=int, default=3, help="warm epochs timed in (c)")
    data.add_argument("--skip-loader", action="store_true", help="skip (c), the cached epoch")
    data.add_argument("--workdir", help="where to write clips and caches (default: a temporary folder, removed)")
    data.add_argument("--json", help="write the numbers to this JSON file")

    train = commands.add_parser("train", help="seconds per training step, peak memory, FLOP utilisation")
    train.add_argument("--variant", required=True, choices=VARIANT_NAMES)
    train.add_argument("--width", type=int, default=832)
    train.add_argument("--height", type=int, default=480)
    train.add_argument("--frames", type=int, default=81)
    train.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    train.add_argument("--batch-size", type=int, default=1)
    train.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="fp32, or bf16 autocast")
    train.add_argument("--weight-dtype", choices=["fp32", "bf16"], help="frozen base weights (default: --dtype)")
    train.add_argument("--gradient-checkpointing", action="store_true")
    method = train.add_mutually_exclusive_group()
    method.add_argument("--lora-rank", type=int, default=32)
    method.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    train.add_argument("--lora-targets", default="attn-mlp", choices=["attn-only", "attn-mlp", "blocks-full"])
    train.add_argument("--device", default="cuda" if _cuda() else "cpu")
    train.add_argument("--peak-tflops", type=float,
                       help="the device's peak for utilisation (default: H100/H200 bf16 989; CPU: a measured matmul)")
    train.add_argument("--no-memory-check", action="store_true", help="run even when the estimate does not fit")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--json", help="write the numbers to this JSON file")
    return parser


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _train(args) -> int:
    from modules.benchmark.common import write_json
    from modules.benchmark.train_bench import (InsufficientMemory, TrainBenchConfig, run_train_benchmark,
                                                    train_table)

    cfg = TrainBenchConfig(variant=args.variant, width=args.width, height=args.height, frames=args.frames,
                           steps=args.steps, dtype=args.dtype, weight_dtype=args.weight_dtype,
                           gradient_checkpointing=args.gradient_checkpointing,
                           lora_rank=None if args.full else args.lora_rank, lora_targets=args.lora_targets,
                           batch_size=args.batch_size, device=args.device, peak_tflops=args.peak_tflops,
                           memory_check=not args.no_memory_check, seed=args.seed)
    try:
        result = run_train_benchmark(cfg, log=lambda text: print(text, flush=True))
    except InsufficientMemory as error:
        print(f"benchmark train: {error}", file=sys.stderr)
        if args.json:
            write_json(args.json, {**error.estimate, "status": f"not run: {error}"})
        return 3
    print(train_table(result))
    if args.json:
        write_json(args.json, result)
    return 0 if result["status"] == "ok" else 3


def _data(args) -> int:
    from modules.benchmark.common import write_json
    from modules.benchmark.data_bench import DataBenchConfig, data_table, run_data_benchmark

    cfg = DataBenchConfig(clips=args.clips, width=args.width, height=args.height, frames=args.frames,
                          source_fps=args.source_fps, source_seconds=args.source_seconds,
                          source_width=args.source_width or args.width,
                          source_height=args.source_height or args.height, threads=args.threads,
                          repeats=args.repeats, warm_epochs=args.warm_epochs, loader=not args.skip_loader,
                          workdir=args.workdir)
    result = run_data_benchmark(cfg, log=lambda text: print(text, flush=True))
    print(data_table(result))
    if args.json:
        write_json(args.json, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _train(args) if args.command == "train" else _data(args)
    except ValueError as error:
        print(f"benchmark {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
