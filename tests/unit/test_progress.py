"""Hang blame by progress: the rank the others wait on, read from the schedule actions each rank completed, where
the stacks cannot tell (under NCCL every waiting rank sits outside torch.distributed)."""

from __future__ import annotations

from autotune.candidate import Candidate
from autotune.schedules import Schedule
from autotune.trial.launch import RanksOutcome, _blame
from autotune.trial.progress import RankProgress, hang_culprit, read_progress

# 1F1B, 2 stages, 2 micro-batches:  rank 0: 0F0 0F1 0B0 0B1   rank 1: 1F0 1B0 1F1 1B1
PP2 = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=8, n_microbatches=2,
                layers_per_stage=(2, 2))
# The same with two replicas (pp-inner: replica 0 = ranks 0, 1; replica 1 = ranks 2, 3).
PP2_DP2 = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, data_parallel_degree=2, global_batch_size=8,
                    n_microbatches=2, layers_per_stage=(2, 2))


def test_a_rank_stuck_in_its_forward_is_blamed_not_the_rank_waiting_for_its_gradient():
    # Step 3: rank 0 did 0F0 0F1 and waits for 1B0; rank 1 has 0F0's activation but never finished 1F0.
    culprit = hang_culprit(PP2, {0: (3, 1, 2), 1: (3, 1, 0)})
    assert culprit is not None and culprit.rank == 1
    assert "own work" in culprit.why and "1F0" in culprit.why


def test_a_rank_stuck_before_its_next_forward_is_blamed():
    # Rank 0 did 0F0 and hangs in 0F1; rank 1 did 1F0 1B0 and waits for 0F1's activation.
    culprit = hang_culprit(PP2, {0: (2, 1, 1), 1: (2, 1, 2)})
    assert culprit is not None and culprit.rank == 0 and "0F1" in culprit.why


def test_with_tensor_parallelism_the_stuck_tp_rank_is_blamed():
    # pp 2 x tp 2: ranks 0, 1 hold stage 0 and wait for 1B0; ranks 2, 3 (stage 1) never finished 1F0 (a tp peer
    # stuck holds the other in its collective). Read as a pp 4 grid, rank 1 would seem to be stage 1, done with 1B0.
    pp2_tp2 = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, tensor_parallel_degree=2, global_batch_size=8,
                        n_microbatches=2, layers_per_stage=(2, 2))
    culprit = hang_culprit(pp2_tp2, {0: (3, 1, 2), 1: (3, 1, 2), 2: (3, 1, 0), 3: (3, 1, 0)})
    assert culprit is not None and culprit.rank == 2 and "1F0" in culprit.why


def test_a_rank_that_never_started_the_step_the_others_wait_in_is_blamed():
    # Rank 0 is in step 3 waiting for 1B0; rank 1 finished step 2 and never started step 3.
    culprit = hang_culprit(PP2, {0: (3, 1, 2), 1: (2, 0, 4)})
    assert culprit is not None and culprit.rank == 1 and "had not started step 3" in culprit.why


def test_the_hung_replica_is_found_while_the_other_waits_in_the_all_reduce():
    # Replica 0 (ranks 0, 1) finished the step and waits in the gradient all-reduce; in replica 1, rank 3 hangs.
    progress = {0: (2, 0, 4), 1: (2, 0, 4), 2: (2, 1, 2), 3: (2, 1, 0)}
    culprit = hang_culprit(PP2_DP2, progress)
    assert culprit is not None and culprit.rank == 3


def test_where_chains_end_at_two_ranks_the_stacks_break_the_tie():
    # Both replicas stuck in their own work (ranks 1 and 3): the lowest, unless the stacks point at the other.
    progress = {0: (2, 1, 2), 1: (2, 1, 0), 2: (2, 1, 2), 3: (2, 1, 0)}
    assert hang_culprit(PP2_DP2, progress).rank == 1
    assert hang_culprit(PP2_DP2, progress, prefer=lambda r: r == 3).rank == 3


def test_progress_cannot_tell_before_the_first_action_nor_between_steps():
    assert hang_culprit(PP2, {0: (1, 1, 0), 1: (1, 1, 0)}) is None  # set-up and shape inference: the stacks decide
    assert hang_culprit(PP2, {0: (3, 0, 4), 1: (3, 0, 4)}) is None  # all-reduce, optimizer, barrier
    assert hang_culprit(PP2, {0: (3, 1, 2)}) is None  # a rank without progress: the stacks decide


def _hung(stuck, progress):
    return RanksOutcome(node=None, results={0: None, 1: None}, errors={0: None, 1: None},
                        exitcodes={0: None, 1: None}, stuck=stuck, timed_out=True, log_tails={}, progress=progress)


def test_under_nccl_stacks_blame_the_lowest_rank_and_progress_corrects_it():
    # NCCL: both ranks' innermost frames are outside torch.distributed (torch.cuda.synchronize), so the stacks
    # name rank 0; rank 0 waits for 1B0 and rank 1 never finished 1F0.
    error = _blame([_hung({0: True, 1: True}, {0: [3, 1, 2], 1: [3, 1, 0]})], 300.0, PP2)
    assert error.kind == "timeout" and error.rank == 1
    assert "rank 1 hung: by every rank's progress, it was stuck in its own work" in error.message
    assert "waiting ranks: 0" in error.message
    # Where progress cannot tell, the stacks still decide (gloo: the waiting rank is inside torch.distributed).
    error = _blame([_hung({0: False, 1: True}, {0: [1, 1, 0], 1: [1, 1, 0]})], 300.0, PP2)
    assert error.rank == 1 and "rank 1 hung outside torch.distributed" in error.message


def test_a_rank_writes_its_progress_where_the_launcher_reads_it(tmp_path):
    progress = RankProgress(tmp_path / "progress-1.bin")
    assert read_progress(tmp_path, 1) == (0, 0, 0)
    progress.run_started()
    progress.action_done()
    progress.action_done()
    assert read_progress(tmp_path, 1) == (1, 1, 2)
    progress.run_ended()
    progress.run_started()
    assert read_progress(tmp_path, 1) == (2, 1, 0)
    assert read_progress(tmp_path, 7) is None
