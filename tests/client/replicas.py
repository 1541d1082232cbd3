"""Replicas behind one name, for the client's tests and bench/balance.py: three `zen-mla serve`
(one worker each) on 127.0.0.1, 127.0.0.2 and 127.0.0.3, one port (`Replicas`), and one name
for all three in an /etc/hosts of the client's own: the client runs in a process in a private
mount namespace (`unshare -m`, root only) whose /etc/hosts is a file of the caller's
(`Driver`), rewritten in place to add or drop an address, as a Kubernetes headless Service
stands for its ready pods. That process (`python -m tests.client.replicas URL ...`, `drive`)
makes calls as told over its stdin and answers on its stdout. No pytest here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

from bench._server import ROOT, free_port, launch, wait_started

NAME = "replicas.zen-mla.test"
ADDRESSES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}  # processes that time things wait passively


def hosts_text(addresses: tuple[str, ...] | list[str]) -> str:
    """An /etc/hosts naming each of `addresses` `NAME`."""
    return "127.0.0.1 localhost\n" + "".join(f"{a} {NAME}\n" for a in addresses)


def _in_namespace(hosts: Path, argv: list[str]) -> list[str]:
    """`argv` run with `hosts` bind-mounted over /etc/hosts, in a mount namespace of its own."""
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(hosts), *argv]


def namespace_problem(tmp: Path) -> str | None:
    """Why a client here cannot be given an /etc/hosts of its own naming three addresses, or
    None where it can."""
    hosts = tmp / "hosts-probe"
    hosts.write_text(hosts_text(ADDRESSES))
    look = f"import socket; print(len({{a[4][0] for a in socket.getaddrinfo({NAME!r}, 1)}}))"
    try:
        done = subprocess.run(
            _in_namespace(hosts, [sys.executable, "-c", look]),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare -m` cannot run here: {exc}"
    if done.returncode != 0:
        return f"`unshare -m` + `mount --bind` over /etc/hosts not permitted: {done.stderr.strip()}"
    if done.stdout.strip() != "3":
        return f"the resolver gave {done.stdout.strip()} addresses for 3 lines (host.conf multi?)"
    return None


class Replicas:
    """`zen-mla serve` at each of `ADDRESSES`, one port for all; `counts(i)` reads replica i's
    answers by status from its /metrics."""

    def __init__(self, tmp: Path, port: int | None = None) -> None:
        self.tmp, self.port = tmp, port or free_port()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(ADDRESSES)
        self._logs: list[IO[bytes]] = []

    def url(self, i: int) -> str:
        return f"http://{ADDRESSES[i]}:{self.port}"

    def launch(self, i: int) -> None:
        """Replica i started, not waited on (`wait`)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")} | PASSIVE
        env |= {
            "ZEN_MLA_HOST": ADDRESSES[i],
            "ZEN_MLA_WORKERS": "1",
            "ZEN_MLA_LOG_LEVEL": "warning",
            "ZEN_MLA_SHM_SOCKET": str(self.tmp / f"regions-{i}.sock"),
        }
        log = (self.tmp / f"replica-{i}.log").open("ab")
        self._logs.append(log)
        self.procs[i] = launch(["--port", str(self.port)], env, log)

    def wait(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        log = self.tmp / f"replica-{i}.log"
        wait_started(proc, self.url(i), logs=lambda: log.read_text(errors="replace")[-4000:])

    def start(self) -> Replicas:
        for i in range(len(ADDRESSES)):
            self.launch(i)
        for i in range(len(ADDRESSES)):
            self.wait(i)
        return self

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()  # its workers follow it (PR_SET_PDEATHSIG)
            proc.wait()

    def counts(self, i: int) -> dict[int, int]:
        """Replica i's prefill answers so far, by status (every route); {} where it is down."""
        try:
            text = httpx.get(self.url(i) + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        out: dict[int, int] = {}
        for line in text.splitlines():
            if line.startswith("zen_mla_requests_total{"):
                status = int(line.split('status="')[1].split('"')[0])
                out[status] = out.get(status, 0) + int(float(line.rsplit(" ", 1)[1]))
        return out

    def answered(self) -> list[int]:
        """The 200s each replica sent so far."""
        return [self.counts(i).get(200, 0) for i in range(len(ADDRESSES))]

    def close(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for i, proc in enumerate(self.procs):
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.kill(i)
        for log in self._logs:
            log.close()


class Driver:
    """A client process inside a namespace whose /etc/hosts is `hosts` (`drive`): `ask` sends
    it one command and returns its answer."""

    def __init__(self, hosts: Path, url: str, *options: str, log: Path | None = None) -> None:
        argv = [sys.executable, "-m", "tests.client.replicas", url, *options]
        self._err = (log or hosts.with_suffix(".log")).open("ab")
        self.proc = subprocess.Popen(
            _in_namespace(hosts, argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=os.environ | PASSIVE,
            cwd=ROOT,
            text=True,
        )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process ended: {self.proc.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op} | args) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask("quit")
            self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self._err.close()


# -- the client's process ------------------------------------------------------------------------


class _Calls:
    """Calls made by `threads` callers until `stop` (or `n` in all), each timed and its answer
    compared with in-process `ragged_attention`."""

    def __init__(self, call: Callable[[], Any], want: Any, deadline: float) -> None:
        self.call, self.want, self.deadline = call, want, deadline
        self.records: list[tuple[float, float, str]] = []  # start, seconds, "ok" or an error
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._left = 0
        self.t0 = time.monotonic()

    def one(self) -> None:
        import torch

        start = time.monotonic()
        try:
            got = self.call()
            outcome = "ok" if torch.equal(got, self.want) else "wrong"
        except Exception as exc:
            outcome = type(exc).__name__
        with self._lock:
            self.records.append((start - self.t0, time.monotonic() - start, outcome))

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._left == 0:
                    return
                self._left -= 1
            self.one()

    def start(self, threads: int, n: int = -1) -> None:
        self._left = n
        self._threads = [threading.Thread(target=self._loop) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def stop(self, wait: bool = False) -> dict[str, Any]:
        """The summary, once the calls stopped (`wait`: once the `n` calls were made)."""
        if not wait:
            self._stop.set()
        for t in self._threads:
            t.join()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        times = sorted(d for _, d, _ in self.records)
        errors: dict[str, int] = {}
        for *_, outcome in self.records:
            if outcome != "ok":
                errors[outcome] = errors.get(outcome, 0) + 1
        late = sum(d > self.deadline or o == "DeadlineExceededError" for _, d, o in self.records)
        return {
            "calls": len(times),
            "ok": len(times) - sum(errors.values()),
            "errors": errors,
            "past_deadline": late,
            "p50": statistics.median(times) if times else None,
            "p99": times[min(len(times) - 1, int(len(times) * 0.99))] if times else None,
            "max": times[-1] if times else None,
            "records": self.records,
        }


def drive(args: argparse.Namespace) -> None:
    """The client's process: JSON commands on stdin (`run` n calls, `start`/`stop` calls until
    told, `endpoints`, `healthy`, `quit`), one JSON answer a line on stdout, each with the
    process's CPU seconds so far (`cpu`); the first line (`hello`) has the first call's record
    (`first`: start, seconds, outcome)."""
    import asyncio

    import torch

    import zen_mla
    from tests.batches import BATCH_SPECS, make_batch
    from zen_mla.client import AsyncPrefillClient, PrefillClient

    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    want = zen_mla.ragged_attention(q, k, v, q_cu)
    options: dict[str, Any] = {
        "timeout": args.timeout,
        "resolve_every": args.resolve_every,
        "shared_memory": None if args.shared_memory else False,
    }
    stats: Callable[[], dict[str, int]] = dict
    if args.client == "link":  # the vLLM link, ZEN_MLA_URL naming the replicas
        from zen_mla.vllm.link import ServiceLink
        from zen_mla.vllm.settings import RemoteSettings
        from zen_mla.vllm.stats import stats as link_stats

        link = ServiceLink.of(RemoteSettings.from_env({"ZEN_MLA_URL": args.url}))

        def call() -> Any:
            return link.prefill(q, k, v, q_cu, causal=True)

        def stats() -> dict[str, int]:
            s = link_stats.snapshot()
            return {"remote": s.remote, "local": s.local, "outages": s.outages}

        balancer = lambda: link.client._balancer  # noqa: E731
    elif args.client == "async":
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        aclient = AsyncPrefillClient(args.url, **options)

        def call() -> Any:
            coro = aclient.prefill(q, k, v, q_cu)
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        balancer = lambda: aclient._balancer  # noqa: E731
    else:
        client = PrefillClient(args.url, **options)

        def call() -> Any:
            return client.prefill(q, k, v, q_cu)

        balancer = lambda: client._balancer  # noqa: E731

    def endpoints() -> list[dict[str, Any]]:
        return [
            {"address": e.address, "down": e.down, "http": str(e.http.base_url)}
            for e in balancer().endpoints
        ]

    first = _Calls(call, want, args.timeout)
    first.one()  # the first call: the name looked up
    hello = {"endpoints": endpoints(), "first": first.records[0], "cpu": time.process_time()}
    print(json.dumps(hello), flush=True)
    running: _Calls | None = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        answer: dict[str, Any]
        if op == "run":
            calls = _Calls(call, want, args.timeout)
            calls.start(command.get("threads", 1), command["calls"])
            answer = calls.stop(wait=True)
        elif op == "start":
            running = _Calls(call, want, args.timeout)
            running.start(command.get("threads", 1))
            answer = {"t0": running.t0}
        elif op == "stop":
            assert running is not None
            answer = running.stop() | {"t0": running.t0}
        elif op == "endpoints":
            answer = {"endpoints": endpoints()}
        elif op == "healthy":  # the vLLM link's probe: any of the name's addresses ok
            from zen_mla.vllm.settings import RemoteSettings, healthy

            answer = {"healthy": healthy(RemoteSettings.from_env({"ZEN_MLA_URL": args.url}))}
        else:
            print(json.dumps({}), flush=True)
            break
        answer["stats"] = stats()
        answer["now"] = time.monotonic()
        answer["cpu"] = time.process_time()  # the client process's, all its threads
        print(json.dumps(answer), flush=True)
    os._exit(0)  # the client's threads and loop are the process's: nothing to wait for


def main() -> None:
    parser = argparse.ArgumentParser(description=drive.__doc__)
    parser.add_argument("url")
    parser.add_argument("--client", choices=("sync", "async", "link"), default="sync")
    parser.add_argument("--timeout", type=float, default=10.0, help="the client's, seconds")
    parser.add_argument("--resolve-every", type=float, default=5.0)
    parser.add_argument("--shared-memory", action="store_true", help="same-host regions too")
    drive(parser.parse_args())


if __name__ == "__main__":
    main()
