"""Shared test setup: offline Hugging Face libraries, the repository on sys.path, tiny Wan models per session."""
import os
import sys
from collections.abc import Callable
from pathlib import Path

# Every test runs offline (DESIGN.md section 3); huggingface_hub reads these when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

# Busy-waiting worker threads make every test many times slower when the 2 cores are shared; one thread per
# process is as fast when they are not.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _sigint_handler_kept(request):
    """Every test starts with the SIGINT handler and signal mask the worker started with: a test that leaves
    another handler behind, or SIGINT blocked, is named in a warning and the state is put back (the Ctrl-C drills
    depend on it). A worker started by a background job of a non-interactive shell starts with SIGINT ignored; the
    drills set what they need themselves."""
    import signal
    import warnings
    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        warnings.warn(f"{request.node.nodeid} left SIGINT blocked in the main thread; it is unblocked")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        warnings.warn(f"{request.node.nodeid} left SIGINT handled by {after!r}; the handler before it is put back")
        signal.signal(signal.SIGINT, before)


def pytest_collection_modifyitems(config, items):
    """The longest files first (tests/slow_files.txt), each file's tests in their own order: run-tests.sh hands
    whole files to the workers in this order (--dist loadfile --no-loadscope-reorder), so the long ones do not
    start last and leave one worker running alone at the end."""
    listed = [line.strip() for line in (ROOT / "tests" / "slow_files.txt").read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("#")]
    rank = {path: index for index, path in enumerate(listed)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(listed)))   # stable: order kept within


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[[str], Path]:
    """`get(variant) -> Path`: a tiny random diffusers folder for the variant (seed 0), built once per session.

    Variants: modules.util.tiny_models.VARIANTS. Treat the folder as read-only; copy it to change it.
    """
    from modules.util.tiny_pipelines import make_tiny_model

    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = make_tiny_model(variant, tmp_path_factory.mktemp(f"tiny-{variant}") / "model")
        return built[variant]

    return get


@pytest.fixture(scope="session")
def squares_dataset(tmp_path_factory):
    """The demo's synthetic squares (3 colours x 2 directions x 4 clips, 9 frames of 32x32), built once."""
    from modules.util.demo_assets import make_t2v_dataset
    return make_t2v_dataset(tmp_path_factory.mktemp("squares"))


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The demo's tiny model (modules/util/demo_model.py: the VAE set to the squares, the shipped base), built once
    per session: it is what the demo's first Start builds, and the tests that run the demo copy it into their
    workspace.
    Treat the folder as read-only."""
    from modules.util.demo_model import make_demo_model
    return make_demo_model(tmp_path_factory.mktemp("demo-model") / "tiny-wan2.1-t2v")


@pytest.fixture(scope="session")
def lora_runs(tiny_model, squares_dataset, tmp_path_factory) -> dict:
    """The tiny LoRA trained in 1 process x batch 2 and on 2 ranks x batch 1 (tests/multi_gpu_runs.py), shared by
    the multi-process test files."""
    from multi_gpu_runs import make_lora_runs
    return make_lora_runs(tiny_model, squares_dataset, tmp_path_factory)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: for refusals that must come before one."""
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader

    def refuse(self, config):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(WanBaseModelLoader, "load", refuse)
