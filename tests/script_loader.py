"""scripts/<name>.py as a module, for in-process calls that spare an interpreter start (and let a test spy on what
the script loads)."""
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    sys.path.insert(0, str(SCRIPTS))
    try:
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(SCRIPTS))
    return script
