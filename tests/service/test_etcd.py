"""The etcd client against a real three-member cluster (Debian's etcd-server), one
member SIGKILLed under it."""

from __future__ import annotations

import time

import pytest
from etcd_cluster import ETCD, SKIP_REASON, EtcdCluster

from rankguard.service.etcd import EtcdClient, EtcdError, parse_endpoints

pytestmark = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)


@pytest.fixture
def cluster(tmp_path):
    c = EtcdCluster(tmp_path)
    yield c
    c.close()


def _client(cluster: EtcdCluster, timeout: float = 20) -> EtcdClient:
    return EtcdClient(parse_endpoints(cluster.endpoint), timeout=timeout)


def test_put_if_is_a_compare_and_set_on_the_revision(cluster):
    c = _client(cluster)
    assert c.get(b"k") is None
    assert c.put_if(b"k", b"one", mod_revision=0) == (True, None)  # created
    first = c.get(b"k")
    put, now = c.put_if(b"k", b"two", mod_revision=0)  # exists already: not put
    assert not put and now.value == b"one"
    assert c.put_if(b"k", b"two", mod_revision=first.mod_revision)[0]
    put, now = c.put_if(b"k", b"three", mod_revision=first.mod_revision)  # stale revision
    assert not put and now.value == b"two"
    c.put(b"p/a", b"")
    c.put(b"p/b", b"x")
    assert c.count(b"p/") == 2 and c.delete(b"p/a") and not c.delete(b"p/a")


def test_a_dead_member_is_passed_over_and_the_data_is_there(cluster):
    c = _client(cluster)
    c.put(b"k", b"v")
    cluster.kill(0)  # the member the client talks to
    started = time.monotonic()
    assert c.get(b"k").value == b"v"
    c.put(b"k2", b"w")
    assert time.monotonic() - started < 10 and c.failovers >= 1
    cluster.start(0)  # it rejoins with its data and catches up
    cluster.wait_healthy([0])
    alone = EtcdClient([cluster.url(0)], timeout=10)
    assert alone.get(b"k2").value == b"w"


def test_no_quorum_is_an_error_within_the_deadline(cluster):
    cluster.kill(1)
    cluster.kill(2)
    c = _client(cluster, timeout=3)
    started = time.monotonic()
    with pytest.raises(EtcdError, match="no etcd member answered"):
        c.put(b"k", b"v")
    assert time.monotonic() - started < 10


def test_endpoints_are_parsed_or_refused():
    assert parse_endpoints("etcd://a:1,b,c:3") == ["http://a:1", "http://b:2379", "http://c:3"]
    for bad in ("etcd://", "a/b:1"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
