import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from modules.util.atomic import atomic_write_text


@dataclass
class RunRecord:
    """What the local side keeps of a remote run, to follow it again after a restart (`remote attach`, the GUI's
    reattach): where it runs and where its files go. Never a password or a key, only the key file's path."""

    launch_id: str          # this start of the run: names its folder there (runs/<id>) and here
    run_name: str
    host: str               # user@host:port
    key_file: str
    known_hosts: str
    work_dir: str           # absolute, on the remote
    run_dir: str            # on the remote
    python: str             # on the remote
    remote_workspace: str
    local_workspace: str
    outputs: dict[str, str] = field(default_factory=dict)   # remote path -> local path
    resume_command: str = ""

    @staticmethod
    def folder(local_workspace: str | Path, launch_id: str) -> Path:
        return Path(local_workspace) / "remote" / launch_id

    @property
    def local_folder(self) -> Path:
        return self.folder(self.local_workspace, self.launch_id)

    def save(self) -> Path:
        path = self.local_folder / "run.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RunRecord":
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))

    @property
    def ended(self) -> bool:
        """The run ended and its files came home (RemoteFollower wrote the mark)."""
        return (self.local_folder / "ended").is_file()

    @classmethod
    def newest(cls, local_workspace: str | Path) -> "RunRecord | None":
        records = sorted((Path(local_workspace) / "remote").glob("*/run.json"), key=lambda p: p.stat().st_mtime)
        return cls.load(records[-1]) if records else None
