"""A real `tpurl serve` process per checkpoint (module scope), talked to with the real `openai`
client; the processes stop with SIGTERM at the end, and must exit cleanly."""

import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from checkpoints import random_checkpoint, scripted_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Server:
    """A `tpurl serve` subprocess: its URL once it listens, its output, and its stop."""

    def __init__(self, model_dir: str, *extra: str):
        self.model_dir = model_dir
        self.proc = subprocess.Popen([sys.executable, "-m", "tpurl", "serve", "--model", model_dir, "--port", "0",
                                      "--served-model-name", "m", "--max-slots", "8", "--max-model-len", "128",
                                      "--page-size", "8", *extra],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url = self._wait_for("listening on ", timeout=120).split("listening on ")[1].split()[0]

    def _wait_for(self, text: str, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if sel.select(timeout=1):
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.lines.append(line)
                if text in line:
                    return line
        self.proc.kill()
        raise AssertionError(f"tpurl serve did not say {text!r}:\n{''.join(self.lines)}")

    def stop(self) -> tuple[int, str]:
        """SIGTERM; the exit status and the rest of the output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return self.proc.returncode, "".join(self.lines) + out


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    return random_checkpoint(str(tmp_path_factory.mktemp("random")))


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory):
    return scripted_checkpoint(str(tmp_path_factory.mktemp("scripted")))


def _served(model_dir, *extra):
    server = Server(model_dir, *extra)
    yield server
    status, out = server.stop()
    assert status == 0, out
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def random_server(random_dir):
    yield from _served(random_dir)


@pytest.fixture(scope="module")
def scripted_server(scripted_dir):
    yield from _served(scripted_dir, "--max-model-len", "512")  # the tools' JSON in the system prompt
