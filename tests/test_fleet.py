"""Verification on a Dask cluster (``checkpoint/fleet.py``): the reads run as tasks on a real ``LocalCluster`` of
worker processes, this process records; the results equal a local verify's; a worker killed in the middle of a read
loses nothing and records nothing twice; the CLI's ``--dask local``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verified_ckpt import CheckpointManager
from verified_ckpt.checkpoint.fleet import checked_workers

distributed = pytest.importorskip("distributed")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as c, distributed.Client(c) as client:
        # The workers' first import of verified-ckpt (torch with it) is their start-up, not the bound under test:
        # on a loaded host it took over the handshake's 30 s and every test of the module lost its cluster
        checked_workers(client, timeout_s=200)
        yield client


def a_run(root: str) -> tuple[str, list]:
    """Six checkpoints, the third with a shard whose bytes changed on disk."""
    url = os.path.join(root, "run")
    mgr = CheckpointManager(url, shard_bytes=1 << 12)
    infos = [mgr.save(step, {"w": torch.arange(3000.0) * step, "b": torch.ones(7)}) for step in range(1, 7)]
    shard = os.path.join(url, "checkpoints", infos[2].id, infos[2].manifest.shards[0].path)
    data = bytearray(open(shard, "rb").read())
    data[-3] ^= 0x40
    open(shard, "wb").write(data)
    return url, infos


def records(url: str) -> list[dict]:
    folder = os.path.join(url, "records", "verification")
    return [json.loads(open(os.path.join(folder, n)).read()) for n in sorted(os.listdir(folder))]


def test_a_verify_on_a_cluster_records_what_a_local_verify_records(tmp_path, cluster):
    url, infos = a_run(str(tmp_path / "dask"))
    on_cluster = CheckpointManager(url).verify(jobs=4, cluster=cluster)
    local_url, _ = a_run(str(tmp_path / "local"))
    here = CheckpointManager(local_url).verify(jobs=4)
    def plain(results: list, cid_of: dict) -> list:  # the ids differ between the two runs: their steps do not
        return [(r.step, r.ok, [(p.kind, p.detail.replace(cid_of[r.step], "<id>")) for p in r.problems]) for r in results]

    ids = {i.step: i.id for i in infos}
    assert plain(on_cluster, ids) == plain(here, {i.step: i.id for i in CheckpointManager(local_url).list()})
    assert [r.ok for r in on_cluster] == [True, True, False, True, True, True]
    assert sorted(r["checkpoint_id"] for r in records(url)) == sorted(i.id for i in infos)


def test_a_worker_killed_in_the_middle_of_a_read_loses_and_duplicates_nothing(tmp_path, cluster):
    """The worker that reads step 4 kills itself (SIGKILL) at its first attempt: the scheduler runs the task again on
    the other worker, every checkpoint is recorded exactly once, and the results are the local verify's."""
    from verified_ckpt.checkpoint.fleet import DaskReads

    url, infos = a_run(str(tmp_path / "kill"))
    victim, flag = infos[3].id, str(tmp_path / "killed-once")

    def killing(url_: str, opts, manifest: bytes, *args):  # pickled by value with its closure: the workers run it
        import signal

        from verified_ckpt.checkpoint.fleet import read_problems

        if json.loads(manifest)["checkpoint_id"] == victim and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return read_problems(url_, opts, manifest, *args)

    mgr = CheckpointManager(url)
    from verified_ckpt.checkpoint.reading import Reader
    from verified_ckpt.checkpoint.verification import verify_all

    reads = DaskReads(cluster, url, None, task=killing)
    results = verify_all(mgr._catalog, Reader(mgr._store, 2), mgr.list(), jobs=6, progress=None, reads=reads)
    assert os.path.exists(flag)  # the kill happened
    assert [r.ok for r in results] == [True, True, False, True, True, True]
    assert sorted(r["checkpoint_id"] for r in records(url)) == sorted(i.id for i in infos)  # once each
    cluster.wait_for_workers(2, timeout=60)  # the nanny restarted the killed worker


def test_the_cli_verifies_on_a_local_cluster(tmp_path):
    url, infos = a_run(str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "verify", url, "--dask", "local",
                           "--jobs", "2", "--json"], capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert [r["ok"] for r in rows] == [True, True, False, True, True, True]
    assert len(records(url)) == len(infos)


def test_the_service_reads_on_the_cluster_and_records_once(tmp_path, cluster):
    """The service's loop for a run (``Watcher``) with the cluster: its first pass reads every checkpoint as a task,
    records each once, as the service, and the damaged checkpoint turns corrupt; the next pass reads nothing."""
    from verified_ckpt.service.metrics import Metrics
    from verified_ckpt.service.scrub import Slots, Throttle
    from verified_ckpt.service.watch import Watcher, verifier_identity

    url, infos = a_run(str(tmp_path))
    w = Watcher("run-x", url, None, Metrics(), Throttle(0), poll_s=1, scrub_interval_s=3600, verifier=verifier_identity(),
                slots=Slots.of(2), cluster=cluster)
    def done() -> int:  # read tasks the scheduler has seen finish (the fixture's cluster is shared by the module)
        return cluster.run_on_scheduler(lambda dask_scheduler: sum(
            p.state_counts["memory"] for k, p in dask_scheduler.task_prefixes.items() if k.startswith("vckpt-verify")))

    before = done()
    w.one_pass()
    assert done() - before == len(infos)  # every read ran as a task on the cluster
    assert w.state.error is None
    recs = records(url)
    assert sorted(r["checkpoint_id"] for r in recs) == sorted(i.id for i in infos)
    assert all(r["verifier"]["service"] == "vckpt serve" for r in recs)
    assert {c.id: c.status.value for c in w.state.view.infos}[infos[2].id] == "corrupt"
    w.one_pass()
    assert len(records(url)) == len(infos)
