"""CPU topology from sysfs: the CCXs (CPUs sharing one L3), their cores and NUMA nodes, and how
worker processes are laid over them.

On EPYC an L3 is shared by one CCX (8 cores on Zen 3/4/5, 8 or 16 on the dense "c" parts), so
a worker confined to one CCX keeps a kernel's working set in one L3.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CCX", "SYSFS", "WorkerSlot", "discover_ccxs", "parse_cpu_list", "plan_workers"]

SYSFS = Path("/sys/devices/system")


@dataclass(frozen=True, slots=True)
class CCX:
    """CPUs sharing one L3, restricted to those this process may use.

    `cpus`: every allowed logical CPU; `core_threads`: the allowed logical CPUs of each
    physical core, lowest first; `numa_node`: -1 where unknown; `l3_bytes`: None where unknown.
    """

    id: int
    cpus: tuple[int, ...]
    core_threads: tuple[tuple[int, ...], ...]
    numa_node: int
    l3_bytes: int | None

    @property
    def cores(self) -> tuple[int, ...]:
        """One logical CPU per physical core: where compute threads go by default."""
        return tuple(t[0] for t in self.core_threads)


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Where one worker process runs: pinned to `cpus`, with `threads` compute threads."""

    id: int
    cpus: tuple[int, ...]
    threads: int
    ccx: tuple[int, ...]  # ids of the CCXs it draws from (one, unless workers < CCXs)
    numa_node: int


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return cpus


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _size_bytes(text: str | None) -> int | None:
    if not text:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def _l3(cpu_dir: Path) -> tuple[frozenset[int], int | None] | None:
    for index in sorted(cpu_dir.glob("cache/index*")):
        if _read(index / "level") == "3":
            shared = _read(index / "shared_cpu_list")
            if shared:
                return frozenset(parse_cpu_list(shared)), _size_bytes(_read(index / "size"))
    return None


def _numa_nodes(sysfs: Path) -> dict[int, int]:
    node_of: dict[int, int] = {}
    for node_dir in sysfs.glob("node/node[0-9]*"):
        cpulist = _read(node_dir / "cpulist")
        if cpulist:
            for cpu in parse_cpu_list(cpulist):
                node_of[cpu] = int(node_dir.name[4:])
    return node_of


def discover_ccxs(sysfs: Path = SYSFS, allowed: set[int] | None = None) -> list[CCX]:
    """The CCXs among `allowed` CPUs (default: this process's affinity, i.e. its cpuset).

    Where sysfs has no L3 data (some VMs and containers), all allowed CPUs form one group.
    """
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    node_of = _numa_nodes(sysfs)
    groups: dict[frozenset[int], int | None] = {}
    l3_of: dict[int, frozenset[int]] = {}
    for cpu in sorted(allowed):
        found = _l3(sysfs / "cpu" / f"cpu{cpu}")
        key, size = found if found else (frozenset(allowed), None)
        groups.setdefault(key, size)
        l3_of[cpu] = key
    found_ccxs = []
    for key, size in groups.items():
        cpus = sorted(c for c in allowed if l3_of[c] == key)
        threads: dict[int, tuple[int, ...]] = {}
        for cpu in cpus:
            siblings = _read(sysfs / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list")
            mates = (
                sorted((set(parse_cpu_list(siblings)) & set(cpus)) | {cpu}) if siblings else [cpu]
            )
            threads[mates[0]] = tuple(mates)
        found_ccxs.append((cpus, sorted(threads.values()), node_of.get(cpus[0], -1), size))
    found_ccxs.sort(key=lambda c: c[0][0])
    return [
        CCX(i, tuple(cpus), tuple(core_threads), node, size)
        for i, (cpus, core_threads, node, size) in enumerate(found_ccxs)
    ]


def plan_workers(
    ccxs: list[CCX], workers: int | None = None, *, smt: bool = False
) -> list[WorkerSlot]:
    """Lay `workers` processes along CCX boundaries (None: one per CCX).

    Fewer workers than CCXs: neighbouring CCXs are merged, balanced by core count. More
    workers than CCXs: a CCX's cores are split between workers, never shared. A worker runs one
    compute thread per physical core; `smt=True` also pins it to the cores' SMT siblings and
    runs a thread on each.
    """
    total = sum(len(c.core_threads) for c in ccxs)
    n = len(ccxs) if workers is None else workers
    if not 1 <= n <= total:
        raise ValueError(f"workers: expected 1 to {total} (the allowed cores), got {n}")
    # each slot: (threads of its cores, ccx ids, numa node)
    slots: list[tuple[list[tuple[int, ...]], list[int], int]] = []
    if n <= len(ccxs):
        # contiguous runs of CCXs: open the next group where its share of the cores begins, or
        # when only as many CCXs are left as groups still to open
        start = 0
        for i, ccx in enumerate(ccxs):
            need = n - len(slots)
            if not slots or (need and (start * n // total >= len(slots) or len(ccxs) - i == need)):
                slots.append(([], [], ccx.numa_node))
            slots[-1][0].extend(ccx.core_threads)
            slots[-1][1].append(ccx.id)
            start += len(ccx.core_threads)
    else:
        # split CCXs: each gets workers in proportion to its cores (at least one), its cores
        # divided between them
        share = dict.fromkeys((c.id for c in ccxs), 1)
        for _ in range(n - len(ccxs)):
            best = max(ccxs, key=lambda c: (len(c.core_threads) / (share[c.id] + 1), -c.id))
            share[best.id] += 1
        for ccx in ccxs:
            k, cores = share[ccx.id], list(ccx.core_threads)
            for j in range(k):
                part = cores[j * len(cores) // k : (j + 1) * len(cores) // k]
                slots.append((part, [ccx.id], ccx.numa_node))
    out = []
    for i, (core_threads, ids, node) in enumerate(slots):
        cpus = [t for threads in core_threads for t in (threads if smt else threads[:1])]
        out.append(WorkerSlot(i, tuple(sorted(cpus)), len(cpus), tuple(ids), node))
    return out
