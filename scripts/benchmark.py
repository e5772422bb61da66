"""Speed and memory benchmarks (DESIGN.md section 8; what the numbers mean: docs/benchmarks.md).

  benchmark.py data [--clips 4 --width 832 --height 480 --frames 81 --source-fps 30 --threads 0] [--json PATH]
  benchmark.py train --variant wan2.1-1.3b --width 128 --height 128 --frames 9 --steps 3 --dtype bf16
                     [--weight-dtype fp32|bf16|fp8] [--gradient-checkpointing [--checkpoint-every K]]
                     [--block-swap N] [--activation-offload] [--compile] [--attention auto|flash|cudnn|efficient|math]
                     [--no-recompute-norms] [--chunk-tokens 4096]
                     [--memory-cap-gib G] [--baseline] [--lora-rank 32 | --full] [--device cpu|cuda] [--json PATH]
  benchmark.py presets [--steps 3] [--preset NAME] [--dry-run] [--json PATH] [--plan [--write]]
  benchmark.py load --workdir DIR [--release wan2.1-t2v-1.3b]
                    [--layout diffusers|original_bf16|fp8_scaled|original_bf16_as_fp8|original_fp16_as_bf16 ...]
                    [--keep-files] [--json PATH]
  benchmark.py plan [--config-path C.json] [--preset-path P] [--config-value k=v ...] [--vram-gib G] [--gpus N]
                    [--plan-json PATH] [--peak-detail] [--exact]
  benchmark.py proof [--workdir DIR] [--quick]
  benchmark.py load-encoders --workdir DIR [--text-layers 24] [--layout umt5_wan_pth|...] [--keep-files] [--json PATH]
  benchmark.py preview --variant wan2.1-1.3b --width 832 --height 480 --frames 81 [--steps 30 --guidance 5]
                       [--accelerator-steps 4 --rank 64] [--dtype bf16] [--device cpu|cuda] [--json PATH]
  benchmark.py ram [--model 1.3B|small] [--workdir DIR] [--json PATH]

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

    load = commands.add_parser("load", help="peak RSS while loading a real-size transformer from each file layout")
    load.add_argument("--workdir", required=True, help="where the (zero-filled, real-size) files are written")
    load.add_argument("--release", default="wan2.1-t2v-1.3b", help="a resources/wan_configs name")
    load.add_argument("--layout", action="append",
                      choices=["diffusers", "original_bf16", "fp8_scaled", "original_bf16_as_fp8",
                               "original_fp16_as_bf16"],
                      help="repeatable; default: all")
    load.add_argument("--keep-files", action="store_true", help="keep the written files (default: deleted)")
    load.add_argument("--json", default=None)

    encoders = commands.add_parser("load-encoders", help="peak RSS while loading the real-size UMT5-XXL and CLIP "
                                                         "ViT-H/14 from each file layout")
    encoders.add_argument("--workdir", required=True, help="where the (zero-filled, real-size) files are written")
    encoders.add_argument("--text-layers", type=int, default=None,
                          help="UMT5 blocks to write (default: the released 24, an 11 GiB file)")
    encoders.add_argument("--layout", action="append", help="repeatable; default: all "
                          "(umt5_wan_pth, umt5_comfyui_bf16, umt5_comfyui_fp8_scaled, umt5_comfyui_fp8_scaled_kept, "
                          "clip_wan_pth, clip_comfyui_fp16)")
    encoders.add_argument("--keep-files", action="store_true", help="keep the written files (default: deleted)")
    encoders.add_argument("--json", default=None)

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
    train.add_argument("--weight-dtype", choices=["fp32", "bf16", "fp8"],
                       help="frozen base weights (default: --dtype); fp8: float8 storage, bf16 compute")
    train.add_argument("--gradient-checkpointing", action="store_true")
    train.add_argument("--checkpoint-every", type=int, default=1, help="with checkpointing: every k-th block")
    train.add_argument("--block-swap", type=int, default=0, metavar="N",
                       help="keep N blocks' frozen weights in pinned CPU memory, copied in as they run")
    train.add_argument("--activation-offload", action="store_true",
                       help="keep checkpointed blocks' inputs in pinned CPU memory (with --gradient-checkpointing)")
    train.add_argument("--compile", action="store_true", help="torch.compile each transformer block (regional)")
    train.add_argument("--attention", default="auto", choices=["auto", "flash", "cudnn", "efficient", "math"])
    train.add_argument("--no-recompute-norms", action="store_true",
                       help="keep the norms' float32 copies (performance.recompute_norms off): to time its cost")
    train.add_argument("--chunk-tokens", type=int, default=4096, metavar="N",
                       help="performance.chunk_tokens (0: the feed-forward and norms on all tokens at once): to time "
                            "its cost")
    train.add_argument("--memory-cap-gib", type=float, metavar="G",
                       help="cap the process's CUDA memory (torch.cuda.set_per_process_memory_fraction)")
    train.add_argument("--baseline", action="store_true",
                       help="also time the plain diffusers + peft step at the same shape, side by side")
    train.add_argument("--optimizer", default="ADAMW", help="OptimizerConfig.optimizer (default ADAMW)")
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

    plan = commands.add_parser("plan", help="predicted peak device memory of a config's training step (fake "
                                            "tensors at real size; no weights, no GPU), and with --vram-gib the "
                                            "fastest memory switches that fit")
    plan.add_argument("--config-path", help="a training config JSON")
    plan.add_argument("--preset-path", help="a preset: a file, or the name of a shipped one")
    plan.add_argument("--config-value", action="append", default=[], metavar="DOTTED.KEY=VALUE")
    from modules.planner.plan_command import add_plan_arguments
    add_plan_arguments(plan)
    plan.add_argument("--peak-detail", action="store_true",
                      help="also list the largest storages alive at the peak: the op that made each and the module "
                           "it was made in (the next memory wall)")
    plan.add_argument("--exact", action="store_true",
                      help="trace the whole transformer for every plan (slow) instead of composing it from a few "
                           "blocks (the same numbers; docs/benchmarks.md)")
    plan.add_argument("--presets", action="store_true", help="plan every shipped preset: docs/benchmarks.md's table")

    ram = commands.add_parser("ram", help="the host RAM plan against a real CPU run's memory per phase (load, "
                                          "caching, steps, preview, backup, save) on a model built with random "
                                          "weights (modules/benchmark/ram_bench.py)")
    ram.add_argument("--model", default="1.3B", choices=["1.3B", "small"])
    ram.add_argument("--workdir", default="workspace/ram-bench", help="the model, data and run (the model is kept "
                                                                      "for the next call)")
    ram.add_argument("--json", help="write the rows to this JSON file")
    proof = commands.add_parser("proof", help="on one GPU: everything docs/benchmarks.md needs (measured peaks "
                                              "next to the planner's predictions); writes a table and a JSON file")
    proof.add_argument("--workdir", default="workspace/benchmark-proof")
    proof.add_argument("--quick", action="store_true", help="one step per run (a dry run of the command)")

    preview = commands.add_parser("preview", help="seconds per preview with and without an accelerator, and the "
                                                  "ratio, in one run (docs/distilled.md)")
    preview.add_argument("--variant", default="wan2.1-1.3b", choices=VARIANT_NAMES)
    preview.add_argument("--width", type=int, default=832)
    preview.add_argument("--height", type=int, default=480)
    preview.add_argument("--frames", type=int, default=81)
    preview.add_argument("--steps", type=int, default=30, help="the full-step preview's steps")
    preview.add_argument("--guidance", type=float, default=5.0, help="the full-step preview's guidance (above 1: "
                         "two passes per step)")
    preview.add_argument("--shift", type=float, default=5.0, help="the full-step scheduler's flow shift")
    preview.add_argument("--accelerator-steps", type=int, default=4)
    preview.add_argument("--rank", type=int, default=64, help="the random accelerator's rank")
    preview.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    preview.add_argument("--device", default="cuda" if _cuda() else "cpu")
    preview.add_argument("--repeats", type=int, default=2, help="timed previews each way, after one warm-up")
    preview.add_argument("--json", help="write the numbers to this JSON file")

    presets = commands.add_parser("presets", help="each preset for a few steps at its shape under its memory cap")
    presets.add_argument("--steps", type=int, default=3)
    presets.add_argument("--preset", help="only the presets whose name contains this (with --plan --write: re-plans those, keeps the others' stored numbers)")
    presets.add_argument("--device", default="cuda" if _cuda() else "cpu")
    presets.add_argument("--dry-run", action="store_true", help="print each preset's command, run nothing")
    presets.add_argument("--workdir", default="workspace/benchmark-presets", help="where the per-run JSON goes")
    presets.add_argument("--json", help="write the rows to this JSON file")
    presets.add_argument("--plan", action="store_true",
                         help="plan each preset (fake tensors, no GPU) instead of running it: the predicted peak at "
                              "real size and the memory-regression guard's numbers")
    presets.add_argument("--write", action="store_true",
                         help="with --plan: write docs/memory_presets.json and docs/benchmarks.md's preset table "
                              "(commit them with the change that moves them)")
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
                           checkpoint_every=args.checkpoint_every, block_swap=args.block_swap,
                           activation_offload=args.activation_offload, compile=args.compile, attention=args.attention,
                           recompute_norms=not args.no_recompute_norms, chunk_tokens=args.chunk_tokens,
                           memory_cap_gib=args.memory_cap_gib, baseline=args.baseline, optimizer=args.optimizer,
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


def _preview(args) -> int:
    from modules.benchmark.common import write_json
    from modules.benchmark.preview_bench import PreviewBenchConfig, preview_table, run_preview_benchmark
    for option in ("width", "height", "frames", "steps", "accelerator_steps", "rank", "repeats"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be at least 1")
    cfg = PreviewBenchConfig(variant=args.variant, width=args.width, height=args.height, frames=args.frames,
                             steps=args.steps, guidance=args.guidance, shift=args.shift,
                             accelerator_steps=args.accelerator_steps, rank=args.rank, dtype=args.dtype,
                             device=args.device, repeats=args.repeats)
    result = run_preview_benchmark(cfg, log=lambda text: print(text, flush=True))
    print(preview_table(result))
    if args.json:
        write_json(args.json, result)
    return 0


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


def _presets(args) -> int:
    from pathlib import Path

    from modules.benchmark.common import format_table, write_json
    from modules.benchmark.preset_bench import preset_runs, run_presets

    if args.plan:
        return _plan_presets(args)
    if args.write:
        print("benchmark presets: --write needs --plan", file=sys.stderr)
        return 2
    runs = preset_runs(args.steps, args.preset)
    if args.dry_run:
        for run in runs:
            print(f"{run.preset}: {run.command() if run.arguments else 'not run: ' + run.reason}")
        return 0
    rows = run_presets(runs, Path(args.workdir), args.device, log=lambda text: print(text, flush=True))
    print(format_table(["preset", "cap GiB", "status", "s / step", "peak GiB"],
                       [[r["preset"], r.get("cap_gib"), r["status"], r.get("seconds_per_step"),
                         (r.get("memory") or {}).get("peak_allocated_gib")] for r in rows]))
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not run") for r in rows) else 3


def _plan_presets(args) -> int:
    from modules.benchmark.common import write_json
    from modules.planner.preset_guard import write
    from modules.planner.preset_table import markdown, preset_rows
    log = lambda text: print(text, flush=True)  # noqa: E731
    if args.write:
        data = write(log=log, only=args.preset)
        print(markdown(data["full"]))
        return 0
    rows = preset_rows(log=log)
    print(markdown(rows))
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


def _plan(args) -> int:
    from modules.planner.plan_command import plan_and_print
    if args.presets:
        from modules.benchmark.common import write_json
        from modules.planner.preset_table import markdown, preset_rows
        rows = preset_rows(log=lambda text: print(text, flush=True))
        print(markdown(rows))
        if args.plan_json:
            write_json(args.plan_json, {"rows": rows})
        return 0
    from modules.util.config.config_io import ConfigError, load_config
    from modules.util.presets import resolve_preset
    try:
        preset = resolve_preset(args.preset_path) if args.preset_path else None
        config = load_config(args.config_path, preset, args.config_value)
    except ConfigError as error:
        print(f"benchmark plan: {error}", file=sys.stderr)
        return 2
    return plan_and_print(config, args.vram_gib, args.plan_json, caching=not args.skip_caching, gpus=args.gpus,
                          peak_detail=args.peak_detail, ram_gib=args.ram_gib, exact=args.exact, bars=True)


def _proof(args) -> int:
    from pathlib import Path

    from modules.planner.proof import run_proof
    return run_proof(Path(args.workdir), quick=args.quick, log=lambda text: print(text, flush=True))


def _load(args) -> int:
    from pathlib import Path

    from modules.benchmark.common import format_table, write_json
    from modules.benchmark.load_bench import LAYOUTS, run_load_benchmark

    rows = run_load_benchmark(Path(args.workdir), args.release, args.layout or LAYOUTS, args.keep_files,
                              log=lambda text: print(text, flush=True))
    print(format_table(["layout", "file GiB", "weights GiB", "RSS before GiB", "peak RSS GiB", "growth GiB",
                        "growth / file", "peak / file", "seconds"],
                       [[r["layout"], r["file_gib"], r["weights_gib"], r["baseline_rss_gib"], r["peak_rss_gib"],
                         r["load_growth_gib"], r["growth_over_file"], r["peak_over_file"], r["seconds"]]
                        for r in rows]))
    if args.json:
        write_json(args.json, {"release": args.release, "rows": rows})
    return 0


def _load_encoders(args) -> int:
    from pathlib import Path

    from modules.benchmark.common import format_table, write_json
    from modules.benchmark.encoder_load_bench import LAYOUTS, run_encoder_load_benchmark

    unknown = sorted(set(args.layout or ()) - set(LAYOUTS))
    if unknown:
        raise ValueError(f"--layout {unknown}: not one of {', '.join(LAYOUTS)}")
    rows = run_encoder_load_benchmark(Path(args.workdir), args.layout or LAYOUTS, args.text_layers, args.keep_files,
                                      log=lambda text: print(text, flush=True))
    print(format_table(["layout", "file GiB", "weights GiB", "growth GiB", "growth / file", "growth / weights",
                        "seconds"],
                       [[r["layout"], r["file_gib"], r["weights_gib"], r["load_growth_gib"], r["growth_over_file"],
                         r["growth_over_weights"], r["seconds"]] for r in rows]))
    if args.json:
        write_json(args.json, {"text_layers": args.text_layers, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "presets":
            return _presets(args)
        if args.command == "load":
            return _load(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "proof":
            return _proof(args)
        if args.command == "load-encoders":
            return _load_encoders(args)
        if args.command == "preview":
            return _preview(args)
        if args.command == "ram":
            from pathlib import Path
            from modules.benchmark.ram_bench import run_measured
            work = Path(args.workdir).resolve()
            run_measured(args.model, work, Path(args.json).resolve() if args.json else work / "ram.json")
            return 0
        return _train(args) if args.command == "train" else _data(args)
    except ValueError as error:
        print(f"benchmark {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
