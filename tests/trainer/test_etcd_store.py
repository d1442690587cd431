"""The etcd store keeps TCPStore's semantics: the same checks run against both."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from etcd_cluster import ETCD, SKIP_REASON, EtcdCluster

from rankguard.cli.local_stack import free_ports
from rankguard.service.etcd import EtcdClient, parse_endpoints
from rankguard.trainer.etcd_store import EtcdStore

TIMEOUT = timedelta(seconds=2)


@pytest.fixture(params=["tcp", "etcd"])
def store(request, tmp_path):
    if request.param == "tcp":
        (port,) = free_ports(1)
        yield dist.TCPStore("127.0.0.1", port, is_master=True, timeout=TIMEOUT)
        return
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster = EtcdCluster(tmp_path, n=1)
    try:
        client = EtcdClient(parse_endpoints(cluster.endpoint), timeout=10)
        yield EtcdStore(client, "rankguard/rdzv/test/", TIMEOUT)
    finally:
        cluster.close()


def test_compare_set_add_append_and_waits_behave_as_tcpstores(store):
    assert store.compare_set("k", "x", "y") == b"x"  # missing, expected given: not set
    assert not store.check(["k"])
    assert store.compare_set("k", "", "first") == b"first"
    assert store.compare_set("k", "other", "second") == b"first"
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    store.set("a", "1")
    store.append("a", "2")
    assert store.get("a") == b"12"
    assert store.multi_get(["a", "k"]) == [b"12", b"second"]
    store.multi_set(["b", "c"], ["3", "4"])
    assert store.check(["b", "c"]) and not store.check(["b", "missing"])
    with pytest.raises(dist.DistStoreError):
        store.wait(["missing"], timedelta(milliseconds=300))
    with pytest.raises(dist.DistStoreError):
        store.get("missing")  # after the store's timeout
    assert store.delete_key("b") and not store.check(["b"])


def test_a_prefix_store_over_it_works_as_torchs_rendezvous_uses_it(store):
    outer = dist.PrefixStore("torch.rendezvous.job.0", store)
    outer.set("MASTER_ADDR", "10.0.0.1")
    assert outer.get("MASTER_ADDR") == b"10.0.0.1"
    assert outer.add("barrier", 1) == 1
    assert outer.compare_set("state", "", "s0") == b"s0"
    outer.wait(["MASTER_ADDR"])
