"""The DeepSpeed export trains: its JSON and PipelineModule code under deepspeed.initialize, one train_batch on 2 CPU
ranks (gloo), with the tuned stage boundaries (an uneven 1F1B split, checkpointed with token ids in, and DualPipeV).

Skipped where DeepSpeed is not installed (CI installs it: see .ci/run)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from autotune.exports import export_config
from autotune.schedules import Schedule
from tests.conftest import RECIPES
from tests.dist import spawn_ranks
from tests.unit.test_exports import make_config

pytestmark = pytest.mark.dist
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed; pip install deepspeed==0.19.8 to run this test")

GPT = str(RECIPES / "gpt.py")  # 8 layers: embedding (takes token ids), 6 blocks, head
CONFIGS = [
    dataclasses.replace(make_config(Schedule.ONE_F_ONE_B, (5, 3), pp=2, microbatches=4, batch=8), model=GPT),
    dataclasses.replace(make_config(Schedule.ONE_F_ONE_B, (2, 6), pp=2, microbatches=2, batch=4, ckpt=True), model=GPT),
    dataclasses.replace(make_config(Schedule.DUAL_PIPE_V, (3, 2, 1, 2), pp=2, microbatches=4, batch=8), model=GPT),
]


def test_deepspeed_export_trains_with_the_tuned_boundaries(tmp_path):
    from tests.dist import deepspeed_worker

    exports = [export_config(c, "deepspeed", "0.19") for c in CONFIGS]
    codes = spawn_ranks(deepspeed_worker.run, lambda rank: (rank, 2, GPT, exports, str(tmp_path)), 2, timeout=240)
    assert codes == [0, 0]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    uneven, checkpointed, dual = zip(*ranks)
    # [5, 3] holds (partition_method="parameters" would give [4, 4])
    assert [r["parts"] for r in uneven] == [[0, 5, 8]] * 2
    assert [r["bounds"] for r in uneven] == [[[0, 5]], [[5, 8]]]
    assert [r["engine"] for r in uneven] == ["PipelineEngine"] * 2
    # checkpointed: one chunk per stage, non-reentrant (the first layer takes token ids)
    assert [r["bounds"] for r in checkpointed] == [[[0, 2]], [[2, 8]]]
    assert {r["checkpoint_interval"] for r in checkpointed} == {6}
    assert {r["checkpoint_func"] for r in checkpointed} == {"non_reentrant_checkpoint"}
    # DualPipeV: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert [r["parts"] for r in dual] == [[0, 3, 5, 6, 8]] * 2
    assert [r["bounds"] for r in dual] == [[[0, 3], [6, 8]], [[3, 5], [5, 6]]]
    assert [r["engine"] for r in dual] == ["DualPipeVEngine"] * 2
    for results in ranks:
        assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in results)
