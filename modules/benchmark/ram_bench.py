"""`benchmark ram`: the host plan (modules/planner/host_plan.py) against the process's RSS, phase by phase, of a real
run on the CPU: the real loader, caching (text pass, VAE pass), training steps, a preview, a backup and the final
save, on a model folder built on the fly with random weights at the size asked. What is compared is anonymous
memory: the plan's parts mapped from their files (read in the file's own dtype: mapped_parts.py) are left out of
the prediction, as their pages are out of RssAnon.

RSS is sampled (psutil) every few milliseconds on a thread; each phase's measured value is its largest RSS above
the RSS before the load (the interpreter and its libraries, which the plan's per-phase growth leaves out). glibc's
malloc keeps freed chunks below its mmap threshold in its heap, where RSS does not fall, and raises that threshold
to the largest chunk freed: a run measured here sets MALLOC_MMAP_THRESHOLD_ (a fixed threshold of 64 KiB), so every
tensor's memory goes back to the system when it dies, as the plan counts it. `measure` must run in a process of its
own (the harness's subprocess) for the same reason: another test's memory would be in its RSS.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from unittest import mock

MIB = 1024 ** 2
MMAP_THRESHOLD = str(64 * 1024)
SIZES = {
    # a model of a few hundred MB: what the tests measure (seconds on a CPU)
    "small": dict(transformer=dict(num_attention_heads=8, attention_head_dim=128, ffn_dim=4096, num_layers=4),
                  text_encoder=dict(d_model=512, d_ff=4096, num_layers=4), dtype="BFLOAT_16"),
    # the released 1.3B transformer; UMT5-XXL's width with 8 of its 24 layers (the whole encoder, 10.6 GiB in
    # bfloat16, and the 1.3B beside it, do not fit beside other work on a 24 GiB machine); the real Wan 2.1 VAE
    "1.3B": dict(transformer="wan2.1-t2v-1.3b", text_encoder=dict(d_model=4096, d_ff=10240, num_layers=8, d_kv=64,
                                                                  num_heads=64), dtype="BFLOAT_16"),
}


def anonymous_bytes(pid: int | None = None) -> int:
    """The process's anonymous resident memory (RssAnon: what it allocated, not pages of files it maps)."""
    with open(f"/proc/{pid or os.getpid()}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssAnon in /proc/self/status (Linux only)")


class RssSampler:
    """The largest RSS (psutil) and anonymous RSS above the start per phase label; `label(name)` marks what runs
    now. Anonymous memory is what the plan counts: a part read from a safetensors file stays mapped from it while a
    tensor of it lives (pages the kernel can drop, counted in RSS once read)."""

    def __init__(self, interval_s: float = 0.002):
        import psutil
        self.process = psutil.Process()
        self.interval_s = interval_s
        self.current = "start"
        self.peaks: dict[str, int] = {}        # anonymous RSS above the start
        self.rss_peaks: dict[str, int] = {}    # RSS above the start
        self.start = anonymous_bytes()
        self.rss_start = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        anonymous, rss = anonymous_bytes() - self.start, self.process.memory_info().rss - self.rss_start
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), anonymous)
        self.rss_peaks[self.current] = max(self.rss_peaks.get(self.current, 0), rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def label(self, name: str):
        self._sample()
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self._sample()
            self.current = previous


def _labelled(sampler: RssSampler, owner, method: str, name, stack: contextlib.ExitStack) -> None:
    """Runs `owner.method` under label `name` (a callable: the label from the call's arguments)."""
    original = getattr(owner, method)

    def wrapped(*args, **kwargs):
        with sampler.label(name(*args, **kwargs) if callable(name) else name):
            return original(*args, **kwargs)
    stack.enter_context(mock.patch.object(owner, method, wrapped))


def _import_everything() -> None:
    """The modules a run imports on its way (the loader's, the sampler's, the savers'): imported before the start,
    so their code and objects are not in any phase's growth."""
    import diffusers.pipelines.wan  # noqa: F401
    import transformers.models.umt5.modeling_umt5  # noqa: F401
    import modules.modelLoader.WanModelLoader  # noqa: F401
    import modules.modelSampler.WanModelSampler  # noqa: F401
    import modules.modelSetup.WanLoRASetup  # noqa: F401
    import modules.trainer.TrainingHooks  # noqa: F401
    from diffusers import AutoencoderKLWan, WanTransformer3DModel  # noqa: F401
    from transformers import UMT5EncoderModel  # noqa: F401


def measure(config) -> tuple[dict[str, int], dict[str, int], object]:
    """Trains `config` (a CPU run) with memory sampled per host-plan phase: (phase -> anonymous bytes above the
    start, phase -> RSS bytes above the start, trainer)."""
    _import_everything()
    from modules.dataLoader.pipeline.EncodeText import EncodeText
    from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
    from modules.modelSampler.TrainingSampler import TrainingSampler
    from modules.trainer.GenericTrainer import GenericTrainer
    from modules.trainer.prepare import prepare_config

    def caching_phase(_self, _epoch, encoder, *args, **kwargs):
        return "caching: text encoding" if isinstance(encoder, EncodeText) else "caching: VAE / image encoding"
    with RssSampler() as sampler, contextlib.ExitStack() as stack:
        _labelled(sampler, GenericTrainer, "_load", "load", stack)
        _labelled(sampler, WanBaseDataLoader, "_cache_epoch", caching_phase, stack)
        _labelled(sampler, GenericTrainer, "_run_epochs", "training step", stack)
        _labelled(sampler, TrainingSampler, "sample_all", "preview", stack)
        _labelled(sampler, GenericTrainer, "backup", "backup", stack)
        _labelled(sampler, GenericTrainer, "save_result", "final save", stack)
        trainer = GenericTrainer(config, e2v_datasets=prepare_config(config))
        trainer.train()
    return sampler.peaks, sampler.rss_peaks, trainer


def build_model(folder: Path, size: str) -> Path:
    """A diffusers folder: the tiny wan2.1-t2v model's tokenizer, scheduler and VAE layout with the transformer and
    text encoder of `size` (SIZES) in random float32 weights (the 1.3B: the real Wan 2.1 VAE too). The run loads them
    in SIZES' dtype, as a released float32 folder is loaded in bfloat16: each tensor cast as read, held in host
    memory (a part read in its file's own dtype stays mapped from the file: resident only once read)."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from modules.benchmark.architectures import materialize
    from modules.util.empty_weights import empty_weights
    from modules.util.tiny_pipelines import make_tiny_model
    spec = SIZES[size]
    folder = make_tiny_model("wan2.1-t2v", folder)
    text_config = json.loads((folder / "text_encoder" / "config.json").read_text(encoding="utf-8"))
    wanted = {k: v for k, v in spec["text_encoder"].items() if v is not None}
    text_config.update(wanted)
    text_config.pop("architectures", None)
    if isinstance(spec["transformer"], str):
        from modules.modelLoader.wan.parts.wan_configs import released_configs
        released = released_configs()[spec["transformer"]]
        transformer_config = {k: v for k, v in released["transformer"].items() if not k.startswith("_")}
        vae_config = {k: v for k, v in released["vae"].items() if not k.startswith("_")}
    else:
        transformer_config = json.loads((folder / "transformer" / "config.json").read_text(encoding="utf-8"))
        transformer_config = {k: v for k, v in transformer_config.items() if not k.startswith("_")}
        transformer_config.update(spec["transformer"])
        vae_config = None
    transformer_config["text_dim"] = text_config["d_model"]
    with empty_weights():
        transformer = WanTransformer3DModel(**transformer_config)
        encoder = UMT5EncoderModel(UMT5Config(**{k: v for k, v in text_config.items() if not k.startswith("_")}))
        vae = AutoencoderKLWan(**vae_config) if vae_config else None
    for name, module in (("transformer", transformer), ("text_encoder", encoder), ("vae", vae)):
        if module is None:
            continue
        materialize(module, torch.float32, torch.device("cpu"))
        if name == "text_encoder":
            module.tie_weights()
        target = folder / name
        for old in target.glob("*.safetensors*"):
            old.unlink()
        module.save_pretrained(target, safe_serialization=True, max_shard_size="20GB")
        del module
    return folder


def train_config(model: Path, dataset: Path, work: Path, size: str, steps: int = 2):
    from modules.modelLoader.wan.parts.model_plan import detect_model_variant
    from modules.util.config.config_io import load_config
    dtype = SIZES[size]["dtype"]
    work.mkdir(parents=True, exist_ok=True)
    samples = work / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 9,
                                    "steps": 2, "seed": 1}]))
    config = load_config(overrides=[
        f"model.base_model_name={model}", "training_method=LORA", f"workspace_dir={work / 'run'}",
        f"cache_dir={work / 'cache'}", f"output.destination={work / 'out.safetensors'}", "device=cpu",
        f"model.transformer.weight_dtype={dtype}", f"model.text_encoder.weight_dtype={dtype}",
        f"train_dtype={dtype}", "gradient_checkpointing=false", "epochs=100", f"max_steps={steps}",
        "batch_size=1", f'data.concepts=[{{"path": "{dataset}"}}]', "data.frame_buckets=[9]",
        "data.resolution=32", "data.aspect_ratios=[1.0]", "data.dataloader_threads=0", "tensorboard=false",
        f"sampling.samples_file={samples}", "sampling.every_n_steps=1", f"backup.every_n_steps={steps}"])
    config.model_type = detect_model_variant(config.model).model_type
    return config


def compare(config, measured: dict[str, int], rss: dict[str, int]) -> list[dict]:
    """Per phase: the predicted anonymous growth (host plan with the step's device plan, CPU; the parts mapped from
    their files left out) against the measured anonymous memory, and for reference the plan with its mapped parts
    beside the RSS (which holds more mapped file pages: those of a file cast as read, while a tensor kept in the
    file's dtype holds its mapping)."""
    from modules.planner.host_plan import plan_host
    from modules.planner.memory_plan import predict
    plan = plan_host(config, predict(config), cuda=False)
    rows = []
    for phase in plan.phases:
        if phase in measured:
            rows.append({"phase": phase, "predicted": plan.anonymous_growth(phase), "measured": measured[phase],
                         "predicted_resident": plan.growth(phase), "rss": rss.get(phase, 0),
                         "mapped_parts": sorted(plan.mapped.get(phase, ()))})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| phase | predicted MiB (anonymous) | measured MiB (anonymous RSS) | error | predicted MiB with mapped "
             "parts | RSS MiB (with mapped files) |", "|---|---|---|---|---|---|"]
    for row in rows:
        error = (row["predicted"] - row["measured"]) / max(row["measured"], 1)
        lines.append(f"| {row['phase']} | {row['predicted'] / MIB:.0f} | {row['measured'] / MIB:.0f} | "
                     f"{error:+.1%} | {row['predicted_resident'] / MIB:.0f} | {row['rss'] / MIB:.0f} |")
    return "\n".join(lines)


def main(size: str, work: Path, json_path: str | None = None) -> list[dict]:
    """Builds the model (once per `work` folder), measures a run and prints the table. Call in a fresh process
    with MALLOC_MMAP_THRESHOLD_ set (run_measured does)."""
    from modules.util.demo_assets import make_t2v_dataset
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-{size}"
    if not (model / "model_index.json").is_file():
        print(f"building the {size} model with random weights in {model}", flush=True)
        build_model(model, size)
    dataset = work / "squares"
    if not dataset.is_dir():
        make_t2v_dataset(dataset)
    import shutil
    shutil.rmtree(work / "run-folder", ignore_errors=True)   # a fresh run: caching and the step from the start
    config = train_config(model, dataset, work / "run-folder", size)
    measured, rss, _trainer = measure(config)
    rows = compare(config, measured, rss)
    print(table(rows), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return rows


def run_measured(size: str, work: Path, json_path: Path) -> list[dict]:
    """main() in a subprocess of its own with the fixed mmap threshold: no other memory in its RSS."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); from pathlib import Path; "
            f"from modules.benchmark.ram_bench import main; main({size!r}, Path({str(work)!r}), {str(json_path)!r})")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=str(root))
    return json.loads(json_path.read_text(encoding="utf-8"))
