from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import PathText


class RemoteConfig(BaseConfig):
    """Training on another machine over SSH (`run-cmd.sh remote train`, docs/remote.md). No password or key is ever
    held here: a key is named by its file (or comes from the SSH agent)."""

    host: str = Field("", max_length=255, description="the remote machine's name or address; --host user@host:port "
                                                      "overrides it")
    user: str = Field("", max_length=255, description="the SSH user; empty: this machine's user name")
    port: int = Field(22, ge=1, le=65535)
    key_file: PathText = Field("", description="a private key file (OpenSSH or PEM); empty: the SSH agent and the "
                                               "default keys in ~/.ssh")
    known_hosts: PathText = Field("workspace/remote/known_hosts",
                                  description="the host keys accepted once with --accept-host-key (never the system's "
                                              "~/.ssh/known_hosts, which this project does not write)")
    work_dir: str = Field("wan-trainer-remote", min_length=1, max_length=4096,
                          description="the remote folder for the project copy, uploaded files and runs; relative: "
                                      "under the remote user's home")
    model_paths: dict[str, str] = Field({}, description="local path -> remote path of model files the remote already "
                                                         "has (a pod's model volume): these are not sent")
    python: str = Field("", max_length=4096,
                        description="a pre-provisioned remote Python with the project's requirements (a path on the "
                                    "remote); empty: the project copy installs its own .venv with install.sh")
