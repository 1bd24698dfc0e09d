"""A three-node cluster (KRaft quorum of 3, replication factor 3, min.insync.replicas 2) loses a node while frames
flow: the partition leader, the group coordinator, the transaction coordinator, or two of the three nodes for
20 s. The worker rides each out without a restart: nothing lost, and in exactly-once nothing duplicated. They
run on a cluster of their own (three JVMs; about 40 s to start)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import faults
from .conftest import assert_kept
from .harness import MODES, Lab

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        pytest.skip("the cluster faults need the project's local Kafka (the session uses an external one)")
    lab = Lab.with_own_cluster(Path(tmp_path_factory.mktemp("cluster")))
    yield lab
    lab.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", faults.CLUSTER_FAULTS)
def test_a_cluster_node_fault_loses_nothing(cluster_lab: Lab, fault: str, mode: str) -> None:
    outcome = assert_kept(faults.FAULTS[fault](cluster_lab, mode, faults.QUICK))
    assert outcome.notes["resumed_after_s"] <= faults.CLUSTER_RESUME_BOUND_S
