from __future__ import annotations

import os

import pytest

from tests.pool.sysfs_fixtures import PARTS, Part, all_cpus, cpu_list, write_sysfs
from zen_mla.pool.topology import discover_ccxs, parse_cpu_list, plan_workers


@pytest.fixture(scope="session")
def sysfs(tmp_path_factory: pytest.TempPathFactory):
    """`sysfs(part, with_cache=True)`: the part's tree, written once a session (thousands of
    small files; the tests only read them)."""
    trees = {}

    def tree(part: Part, *, with_cache: bool = True):
        if (part, with_cache) not in trees:
            root = tmp_path_factory.mktemp("sysfs")
            trees[part, with_cache] = write_sysfs(root, part, with_cache=with_cache)
        return trees[part, with_cache]

    return tree


@pytest.mark.parametrize("name", PARTS)
def test_ccxs_of_each_part(sysfs, name):
    part = PARTS[name]
    ccxs = discover_ccxs(sysfs(part), allowed=all_cpus(part))
    assert len(ccxs) == part.ccxs
    for i, ccx in enumerate(ccxs):
        assert ccx.id == i
        assert set(ccx.cpus) == set(part.ccx_cpus(i))
        assert ccx.cores == tuple(range(i * part.cores_per_ccx, (i + 1) * part.cores_per_ccx))
        if part.smt:
            assert all(len(t) == 2 and t[1] == t[0] + part.cores for t in ccx.core_threads)
        assert ccx.numa_node == i // (part.ccxs // part.numa_nodes)
        assert ccx.l3_bytes == int(part.l3[:-1]) * 1024


def test_epyc_9654_auto_is_one_worker_per_ccx_one_thread_per_core(sysfs):
    part = PARTS["epyc_9654_nps1"]
    slots = plan_workers(discover_ccxs(sysfs(part), allowed=all_cpus(part)))
    assert len(slots) == 12
    assert [s.cpus for s in slots] == [tuple(range(8 * i, 8 * i + 8)) for i in range(12)]
    assert all(s.threads == 8 for s in slots)


def test_smt_pins_siblings_too(sysfs):
    part = PARTS["epyc_9654_nps1"]
    slots = plan_workers(discover_ccxs(sysfs(part), allowed=all_cpus(part)), smt=True)
    assert slots[1].cpus == (*range(8, 16), *range(104, 112))
    assert slots[1].threads == 16


def test_fewer_workers_merge_neighbouring_ccxs_within_numa_nodes(sysfs):
    part = PARTS["zen5_128c_nps2"]
    ccxs = discover_ccxs(sysfs(part), allowed=all_cpus(part))
    slots = plan_workers(ccxs, 2)
    assert [s.ccx for s in slots] == [tuple(range(8)), tuple(range(8, 16))]
    assert [s.numa_node for s in slots] == [0, 1]
    assert all(s.threads == 64 for s in slots)
    slots = plan_workers(ccxs, 5)  # uneven: every CCX in exactly one worker
    assert sorted(i for s in slots for i in s.ccx) == list(range(16))
    assert len(slots) == 5


def test_more_workers_than_ccxs_split_cores_never_share(sysfs):
    part = PARTS["zen5c_dense"]
    ccxs = discover_ccxs(sysfs(part), allowed=all_cpus(part))
    slots = plan_workers(ccxs, 24)
    assert len(slots) == 24
    cpus = [c for s in slots for c in s.cpus]
    assert len(cpus) == len(set(cpus)) == 192
    assert all(s.threads == 8 and len(s.ccx) == 1 for s in slots)


def test_cpuset_that_cuts_a_ccx_in_half(sysfs):
    part = PARTS["epyc_9654_nps1"]
    allowed = set(range(4, 20))  # half of CCX 0, all of CCX 1, half of CCX 2; no SMT siblings
    ccxs = discover_ccxs(sysfs(part), allowed=allowed)
    assert [c.cpus for c in ccxs] == [(4, 5, 6, 7), tuple(range(8, 16)), (16, 17, 18, 19)]
    assert [s.threads for s in plan_workers(ccxs)] == [4, 8, 4]


def test_zen4c_two_ccx_per_ccd_are_separate_l3s(sysfs):
    part = PARTS["zen4c_two_ccx_per_ccd"]
    ccxs = discover_ccxs(sysfs(part), allowed=all_cpus(part))
    assert len(ccxs) == 8 and all(c.l3_bytes == 16 << 20 for c in ccxs)


def test_no_cache_data_is_one_group_of_all_allowed(sysfs):
    part = PARTS["epyc_9654_nps1"]
    allowed = set(range(0, 24))
    ccxs = discover_ccxs(sysfs(part, with_cache=False), allowed=allowed)
    assert len(ccxs) == 1 and ccxs[0].cpus == tuple(range(24)) and ccxs[0].l3_bytes is None


def test_this_machine(sysfs):
    part = PARTS["this_machine_like"]
    ccxs = discover_ccxs(sysfs(part), allowed={0, 1})
    assert [s.cpus for s in plan_workers(ccxs, 2)] == [(0,), (1,)]
    assert [s.cpus for s in plan_workers(ccxs)] == [(0, 1)]
    real = discover_ccxs()  # the real sysfs: every allowed CPU in some CCX, once
    assert sorted(c for x in real for c in x.cpus) == sorted(os.sched_getaffinity(0))


def test_worker_count_out_of_range(sysfs):
    part: Part = PARTS["this_machine_like"]
    ccxs = discover_ccxs(sysfs(part), allowed={0, 1})
    with pytest.raises(ValueError, match="workers: expected 1 to 2"):
        plan_workers(ccxs, 3)
    with pytest.raises(ValueError):
        plan_workers(ccxs, 0)


@pytest.mark.parametrize("cpus", [[0], [0, 1, 2], [3, 5, 6, 7, 100], list(range(0, 64, 2))])
def test_cpu_list_round_trip(cpus):
    assert parse_cpu_list(cpu_list(cpus)) == cpus
