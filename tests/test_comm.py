"""The communicator on real gloo ranks: unguarded multi-rank saves, byte and batch exchange."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from verified_ckpt import CheckpointManager, Communicator, Status, state_fingerprint

pytestmark = pytest.mark.timeout(120)


def _state(rank: int) -> dict:
    torch.manual_seed(7)  # every rank holds the same replica
    return {f"w{i}": torch.randn(512) for i in range(6)} | {"meta": {"rank_independent": 1}}


def unguarded_save(rank: int, world: int, run: str, blocking: bool) -> dict:
    from verified_ckpt import store as store_mod

    opened: list[str] = []
    real = store_mod.RunStore.open_shard_for_write

    def spy(self, cid, name, size_hint=0):
        opened.append(name)
        return real(self, cid, name, size_hint)

    store_mod.RunStore.open_shard_for_write = spy
    try:
        mgr = CheckpointManager(run, shard_bytes=2048)  # the world group by default: torch.distributed is initialised
        got = mgr.save(5, _state(rank), blocking=blocking)
        info = got if blocking else got.result()
    finally:
        store_mod.RunStore.open_shard_for_write = real  # the rank processes serve later tests
    return {"opened": sorted(opened), "id": info.id, "status": info.status.value, "world": mgr.comm.world}


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_unguarded_multi_rank_save_has_every_rank_write_its_share(tmp_path, blocking):
    run = str(tmp_path / "run")
    results = run_ranks(unguarded_save, 3, run, blocking)
    assert {r["id"] for r in results} == {results[0]["id"]}  # one checkpoint, committed once
    assert all(r["world"] == 3 and r["status"] == "unverified" for r in results)
    shares = [set(r["opened"]) for r in results]
    assert all(shares), "every rank writes at least one shard"
    assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
    [info] = CheckpointManager(run).list()
    assert {s.path for s in info.manifest.shards} == set().union(*shares)
    assert info.status is Status.UNVERIFIED and info.manifest.topology.world_size == 3
    fresh = {k: torch.zeros(512) for k in _state(0) if k != "meta"} | {"meta": None}
    CheckpointManager(run).restore(fresh, allow_unverified=True)
    assert state_fingerprint(fresh) == state_fingerprint(_state(0))


def exchange(rank: int, world: int) -> dict:
    comm = Communicator()
    texts = comm.gather_bytes(f"rank-{rank}".encode() * rank)
    mine = [{"ids": torch.arange(rank + 1), "mask": torch.ones(2, rank + 1, dtype=torch.bool), "lang": f"l{rank}",
             "n": rank, "scale": 0.5 * rank, "nested": [(torch.full((rank,), float(rank)), None)]}]
    everyone = comm.exchange_batches(mine)
    hosts = [h.to_dict() for h in comm.topology()]
    return {"texts": [t.decode() for t in texts], "hosts": hosts, "batches": [
        {"ids": b[0]["ids"].tolist(), "mask": b[0]["mask"].tolist(), "lang": b[0]["lang"], "n": b[0]["n"],
         "scale": b[0]["scale"], "nested": [b[0]["nested"][0][0].tolist(), b[0]["nested"][0][1]],
         "tuple": isinstance(b[0]["nested"][0], tuple)} for b in everyone]}


def test_bytes_batches_and_topology_travel_between_ranks():
    results = run_ranks(exchange, 3)
    for got in results:
        assert got["texts"] == ["", "rank-1", "rank-2rank-2"]
        assert [h["rank"] for h in got["hosts"]] == [0, 1, 2]
        for r, b in enumerate(got["batches"]):
            assert b == {"ids": list(range(r + 1)), "mask": [[True] * (r + 1)] * 2, "lang": f"l{r}", "n": r,
                         "scale": 0.5 * r, "nested": [[float(r)] * r, None], "tuple": True}


def test_a_single_process_communicator_talks_to_itself():
    comm = Communicator()
    assert (comm.rank, comm.world, comm.active) == (0, 1, False)
    assert comm.gather_bytes(b"x") == [b"x"] and comm.broadcast_bytes(b"y") == b"y"
    [[mb]] = comm.exchange_batches([{"a": torch.ones(2)}])
    assert mb["a"].tolist() == [1.0, 1.0]
