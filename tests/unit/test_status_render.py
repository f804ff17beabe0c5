"""``llmq-status``' tables (shared/status.py ``render``), from a reading made by hand: no Redis."""

from __future__ import annotations

from shared.status import Parallel, Status, WorkerStatus, render


def worker(id: str, device: str, parallel: Parallel, **more: object) -> WorkerStatus:
    return WorkerStatus(id=id, model="m", status="ready", slots=2, running=0, host="h", pid=1, device=device,
                        parallel=parallel, last_heartbeat_age_s=0.5, **more)


def test_the_workers_table_shows_each_workers_kind_device_and_engine_layout():
    workers = [worker("h:1:ab", "cpu:1 cpus=0-1", Parallel()),
               worker("h:2:cd", "gpu:0,1", Parallel(tensor=2), devices=["gpu:0", "gpu:1"]),
               worker("h:3:ef", "gpu:0,1,2,3,4,5,6,7", Parallel(tensor=8, pipeline=2, nodes=2), kind="embed"),
               worker("h:4:gh", "", Parallel(pipeline=2), adapters=["a", "b"])]
    text = render(Status(prefix="p", at=0.0, models=[], workers=workers))
    assert text.split("\n")[3:] == [
        "workers: 4",
        "  id      model  kind      status  slots  running  host  pid  device               layout             "
        "last beat (s ago)  adapters",
        "  h:1:ab  m      generate  ready   2      0        h     1    cpu:1 cpus=0-1       tp=1               "
        "0.5                -",
        "  h:2:cd  m      generate  ready   2      0        h     1    gpu:0,1              tp=2               "
        "0.5                -",
        "  h:3:ef  m      embed     ready   2      0        h     1    gpu:0,1,2,3,4,5,6,7  tp=8 pp=2 nodes=2  "
        "0.5                -",
        "  h:4:gh  m      generate  ready   2      0        h     1    -                    tp=1 pp=2          "
        "0.5                a, b",
    ]


def test_a_pooling_models_line_says_its_kind():
    from shared.status import ModelStatus

    models = [ModelStatus(name="e", kind="embed", waiting=1, running=0, dead_letters=0, ready_workers=2, levels=[]),
              ModelStatus(name="g", waiting=0, running=3, dead_letters=0, ready_workers=1, levels=[])]
    lines = render(Status(prefix="p", at=0.0, models=models, workers=[])).split("\n")
    assert "model e (embed): 1 waiting, 0 running, 0 dead-lettered, 2 ready worker(s)" in lines
    assert "model g: 0 waiting, 3 running, 0 dead-lettered, 1 ready worker(s)" in lines
