"""Fake /sys/devices/system trees with the layout of real EPYC parts, written into tmp dirs.

Only the files zen_mla.topology reads are written, with the kernel's own formats:
cpu/cpuN/cache/indexI/{level,type,size,shared_cpu_list}, cpu/cpuN/topology/thread_siblings_list
and node/nodeX/cpulist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    cpus = sorted(cpus)
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class Part:
    """`ccxs` CCXs of `cores_per_ccx` cores, SMT siblings at `cpu + cores` (Linux's numbering
    on EPYC), split evenly over `numa_nodes` nodes."""

    ccxs: int
    cores_per_ccx: int
    smt: bool
    numa_nodes: int
    l3: str

    @property
    def cores(self) -> int:
        return self.ccxs * self.cores_per_ccx

    def ccx_cpus(self, i: int) -> list[int]:
        first = list(range(i * self.cores_per_ccx, (i + 1) * self.cores_per_ccx))
        return first + ([c + self.cores for c in first] if self.smt else [])


PARTS = {
    "epyc_9654_nps1": Part(12, 8, smt=True, numa_nodes=1, l3="32768K"),  # Zen 4, 96c/192t
    "zen5_128c_nps2": Part(16, 8, smt=True, numa_nodes=2, l3="32768K"),  # Zen 5, 128c/256t
    "zen4c_two_ccx_per_ccd": Part(8, 8, smt=True, numa_nodes=1, l3="16384K"),  # 4 CCDs x 2 CCX
    "zen5c_dense": Part(12, 16, smt=True, numa_nodes=1, l3="32768K"),  # 16 cores per CCX
    "this_machine_like": Part(1, 2, smt=False, numa_nodes=1, l3="491520K"),  # one L3, 2 CPUs
}


def write_sysfs(root: Path, part: Part, *, with_cache: bool = True) -> Path:
    for i in range(part.ccxs):
        shared = part.ccx_cpus(i)
        for cpu in shared:
            d = root / "cpu" / f"cpu{cpu}"
            (d / "topology").mkdir(parents=True)
            core = cpu % part.cores
            siblings = [core, core + part.cores] if part.smt else [core]
            (d / "topology" / "thread_siblings_list").write_text(cpu_list(siblings) + "\n")
            if not with_cache:
                continue
            for index, (level, kind, size, cpus) in enumerate(
                [
                    ("1", "Data", "48K", siblings),
                    ("1", "Instruction", "32K", siblings),
                    ("2", "Unified", "1024K", siblings),
                    ("3", "Unified", part.l3, shared),
                ]
            ):
                c = d / "cache" / f"index{index}"
                c.mkdir(parents=True)
                (c / "level").write_text(level + "\n")
                (c / "type").write_text(kind + "\n")
                (c / "size").write_text(size + "\n")
                (c / "shared_cpu_list").write_text(cpu_list(cpus) + "\n")
    per_node = part.ccxs // part.numa_nodes
    for node in range(part.numa_nodes):
        cpus = [c for i in range(node * per_node, (node + 1) * per_node) for c in part.ccx_cpus(i)]
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(cpu_list(cpus) + "\n")
    return root


def all_cpus(part: Part) -> set[int]:
    return set(range(part.cores * (2 if part.smt else 1)))
