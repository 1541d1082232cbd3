"""The service process's allocator (`service/memory.py`) on a real `zen-mla serve`: started
again in place with transparent huge pages under glibc's mappings of large blocks, unless the
operator set that tunable already."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench._server import free_port, wait_started
from service.memory import exec_with_huge_pages

from .servers import check_slow, serve

pytestmark = pytest.mark.slow


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


def _thp() -> str:
    """The system's transparent huge pages mode: always, madvise, never ("" where unknown)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.partition("[")[2].partition("]")[0]


needs_thp = pytest.mark.skipif(
    not (_glibc() and _thp() in ("always", "madvise")),
    reason="needs glibc and transparent huge pages (not 'never')",
)
needs_madvise = pytest.mark.skipif(
    not (_glibc() and _thp() == "madvise"),
    reason="needs glibc and transparent huge pages only where asked for ('madvise')",
)


def _huge_kib(pid: int) -> int:
    """KiB of the process's anonymous memory in transparent huge pages."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages in smaps_rollup")


@needs_thp
def test_the_service_starts_again_in_place_with_huge_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")  # the operator's, kept
    with serve(tmp_path) as server:
        assert server.health()["status"] == "ok"  # the pid started is the one serving
        assert _huge_kib(server.process.pid) > 0  # its large blocks (torch's, at import) in them


@needs_madvise
def test_the_operators_choice_of_the_tunable_stands(tmp_path, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    with serve(tmp_path) as server:
        assert server.health()["status"] == "ok"
        assert _huge_kib(server.process.pid) == 0  # nothing asked huge pages for


@needs_thp
def test_the_console_script_starts_again_in_place(tmp_path):
    """`zen-mla serve` as installed (an entry-point script, not `python -c`)."""
    check_slow()
    script = Path(sys.executable).parent / "zen-mla"
    if not script.exists():
        pytest.skip("the zen-mla entry point is not installed beside this interpreter")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEN_MLA_", "GLIBC_"))}
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [str(script), "serve", "--port", str(port), "--grpc-port", "0", "--workers", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_started(process, f"http://127.0.0.1:{port}")
        assert _huge_kib(process.pid) > 0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        log.close()


def test_nothing_is_done_where_the_tunable_is_set(monkeypatch):
    """In this process: a call that would start it again returns (it must, or pytest is gone)."""
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    exec_with_huge_pages()
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
