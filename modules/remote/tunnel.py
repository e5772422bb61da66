"""A local port that reaches a port on the remote's loopback through the SSH connection (paramiko's direct-tcpip
channels, what `ssh -L` does): TensorBoard there, seen here at http://localhost:PORT. Nothing is opened on the
remote's network side."""
from __future__ import annotations

import select
import socket
import threading


class PortForward:
    def __init__(self, connection, remote_port: int, local_port: int = 0):
        self.transport = connection.client.get_transport()
        self.remote_port = remote_port
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", local_port))
        self.server.listen(8)
        self.local_port = self.server.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="port-forward").start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, peer = self.server.accept()
            except OSError:   # closed
                return
            try:
                channel = self.transport.open_channel("direct-tcpip", ("127.0.0.1", self.remote_port), peer)
            except Exception:  # noqa: BLE001  the remote refused this one connection (nothing listens yet)
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, channel), daemon=True).start()

    @staticmethod
    def _pump(client: socket.socket, channel) -> None:
        try:
            while True:
                ready, _, _ = select.select([client, channel], [], [], 1.0)
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        break
                    channel.sendall(data)
                if channel in ready:
                    data = channel.recv(65536)
                    if not data:
                        break
                    client.sendall(data)
        except OSError:
            pass
        finally:
            channel.close()
            client.close()

    def close(self) -> None:
        self.closed.set()
        self.server.close()


def start_remote_tensorboard(connection, python: str, logdir: str, run_dir: str) -> int:
    """Starts TensorBoard on the remote's loopback (detached, as the run is) and returns its port."""
    import posixpath
    import shlex
    _, out, _ = connection.run([python, "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                                              "print(s.getsockname()[1])"])
    port = int(out.strip())
    log = posixpath.join(run_dir, "tensorboard.log")
    connection.run(f"setsid nohup {shlex.quote(python)} -m tensorboard.main --logdir {shlex.quote(logdir)} "
                   f"--host 127.0.0.1 --port {port} > {shlex.quote(log)} 2>&1 < /dev/null &")
    return port
