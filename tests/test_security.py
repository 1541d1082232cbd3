"""What the request path must never do, and the defaults that keep it safe."""

from __future__ import annotations

import re
from pathlib import Path

from service.cli import build_parser
from service.settings import Settings
from zen_mla import wire

ROOT = Path(__file__).resolve().parents[1]
# every module a request's bytes pass through on their way to a kernel
REQUEST_PATH = [
    *sorted((ROOT / "service").glob("*.py")),
    ROOT / "zen_mla" / "wire.py",
    ROOT / "zen_mla" / "_ragged.py",
    ROOT / "zen_mla" / "_attention.py",
    ROOT / "zen_mla" / "pool" / "_shm.py",
]
UNSAFE = re.compile(r"\b(pickle|torch\.load|eval\(|exec\(|marshal|shelve|yaml\.load\()")


def test_nothing_in_the_request_path_can_unpickle():
    for path in REQUEST_PATH:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not UNSAFE.search(line), f"{path.name}:{n}: {line.strip()}"


def test_binds_to_loopback_unless_told():
    assert Settings().host == "127.0.0.1"
    args = build_parser().parse_args(["serve"])
    assert args.host is None  # no flag: the setting's default stands


def test_caps():
    assert wire.MAX_HEADER_BYTES == 64 << 10
    assert {"q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens"} == wire.REQUEST_TENSORS
    s = Settings()
    assert s.max_body_bytes == 1 << 30 and s.max_queue >= 1 and s.deadline_s == 60
    assert s.api_token is None
