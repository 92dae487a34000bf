"""What is alive at a rank's measured peak, by kind, next to the simulator's prediction: a debugging aid for the
memory model (autotune.memory_model). Runs each candidate as a 2-rank gloo pipeline on CPU (the trial's warm-up,
then one step under autotune.trial.memory.PeakBreakdown) and prints, per rank, the bytes per kind at the peak and
what was running then.

    python bench/memory_breakdown.py recipes/gpt.py --batch-size 64 \
        --candidates Interleaved1F1B/m4/[2-2-2-2] 1F1B/m4/[4-4]

A candidate is written as in the calibration tables: <schedule>/m<n_microbatches>/[<layers per stage>][+ckpt][+bf16]
(+bf16: a bfloat16 wire in fp32); --precision bf16 trains and profiles every candidate in bf16.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from autotune.candidate import Candidate
from autotune.devices import keep_freed_cpu_memory
from autotune.model_file import load_model_file, make_batch
from autotune.process_groups import RankLayout, init_groups
from autotune.profiling import profile_model
from autotune.runtime import build_pipeline
from autotune.schedules import Schedule
from autotune.simulate import LinkModel, _stage_costs, simulate
from autotune.trial.memory import PeakBreakdown, SavedActivationBytes

WORLD_SIZE = 2


def parse_candidate(text: str, batch_size: int, precision: str = "fp32") -> Candidate:
    """'Interleaved1F1B/m4/[2-2-2-2]+ckpt' -> Candidate (2 ranks); 'dp2-shard/1F1B/m2/[10]+reshard': one stage over
    2 replicas (dp2/: replicated)."""
    match = re.fullmatch(r"(?:dp2(-shard)?/)?(\w+)/m(\d+)/\[([\d-]+)\]((?:\+\w+)*)", text)
    if match is None:
        raise SystemExit(f"cannot read candidate {text!r}; write it as GPipe/m4/[3-5] (+ckpt, +bf16 optional) or "
                         f"dp2-shard/1F1B/m2/[10] (+reshard)")
    shard, schedule, m, split, flags = match.groups()
    dp = 2 if text.startswith("dp2") else 1
    return Candidate(schedule=Schedule(schedule), pipeline_degree=WORLD_SIZE // dp, data_parallel_degree=dp,
                     data_parallel_mode="shard" if shard else "replicate", reshard_after_forward="+reshard" in flags,
                     global_batch_size=batch_size,
                     n_microbatches=int(m), layers_per_stage=tuple(int(x) for x in split.split("-")),
                     activation_checkpointing="+ckpt" in flags,
                     wire_dtype="bfloat16" if "+bf16" in flags else "float32", precision=precision)


def _ptrs(tensors: Any) -> list[int]:
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t  # a sharded parameter: this rank's shard
            out.append(local.untyped_storage().data_ptr())
        elif isinstance(t, (tuple, list)):
            out.extend(_ptrs(t))
    return out


def _rank(rank: int, model: str, candidate: dict[str, Any], store: str, out: str, warmup: int,
          phase: str | None = None) -> None:
    torch.set_num_threads(1)
    keep_freed_cpu_memory()
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    c = Candidate.from_dict(candidate)
    spec = load_model_file(Path(model))
    pp_group, dp_group = init_groups(RankLayout.of(c, rank))
    pipe = build_pipeline(spec, c, rank=rank, device=torch.device("cpu"), pp_group=pp_group, dp_group=dp_group)
    # What this rank holds of the batch, as a trial's rank holds it (the global batch let go of).
    rank_batch = pipe.prepare_batch(*make_batch(spec, c.global_batch_size))
    gc.collect()
    for _ in range(max(warmup, 1)):
        pipe.step(rank_batch)
    stages = getattr(pipe.schedule, "_stages", None) or [pipe.schedule._stage]
    batch = rank_batch.tensors()
    saved = SavedActivationBytes(exclude=[*pipe.parameters(), *batch])

    def kinds() -> dict[str, list[int]]:
        params = pipe.parameters()
        state = [v for s in pipe.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        recv_act, recv_grad, input_grads, outputs, split, losses = [], [], [], [], [], []
        for st in stages:
            for infos in st.args_recv_info.values():
                for info in infos:
                    if getattr(info, "buffer", None) is not None and not getattr(info, "is_root_arg", False):
                        recv_act.append(info.buffer)
                        if info.buffer.grad is not None:
                            input_grads.append(info.buffer.grad)
            for infos in getattr(st, "grad_recv_info", {}).values():
                for info in infos:
                    if getattr(info, "buffer", None) is not None:
                        recv_grad.append(info.buffer)
            input_grads.extend(t for ts in st.bwd_cache.values() for t in ts if isinstance(t, torch.Tensor))
            outputs.extend(t for out, _ in st.fwd_cache.values() for t in out if isinstance(t, torch.Tensor))
            for _, groups, _, _ in st.backward_state.values():
                for g in groups or []:
                    split.extend(g.get("grads") or [])
            losses.extend(st.output_chunks)
        return {
            "parameters": _ptrs(params),
            "gradients": _ptrs(p.grad for p in params if p.grad is not None),
            "optimizer state": _ptrs(state),
            "batch": _ptrs(batch),
            "receive buffers (activations)": _ptrs(recv_act),
            "receive buffers (gradients)": _ptrs(recv_grad),
            "input gradients (sent, kept on the buffers)": _ptrs(input_grads),
            "saved activations": list(saved._holders),
            "stage outputs (fwd_cache)": _ptrs(outputs),
            "split backward state (I to W)": _ptrs(split),
            "last-stage outputs": _ptrs(losses),
        }

    tracker = PeakBreakdown(kinds)
    at_start: dict[str, int] = {}  # --phase: what is alive as the action starts

    def label(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before, tracker.phase = tracker.phase, f"{name}{args[0] if args else ''}"
            inside = phase is not None and tracker.phase == phase
            if inside:  # --phase: the peak inside this action alone, from what is alive as it starts
                tracker.peak_bytes = tracker.live_bytes
                tracker._new_peak()
                at_start.update(tracker.breakdown)
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.phase = before
                if inside:
                    tracker.peak_bytes = float("inf")  # no later peak replaces it
        return wrapped

    for st in stages:
        st.forward_one_chunk = label(f"{st.stage_index}F", st.forward_one_chunk)
        st.backward_one_chunk = label(f"{st.stage_index}B", st.backward_one_chunk)
        st.backward_weight_one_chunk = label(f"{st.stage_index}W", st.backward_weight_one_chunk)
    pipe.optimizer.step = label("optimizer", pipe.optimizer.step)  # type: ignore[method-assign]
    with tracker, saved:
        pipe.step(rank_batch)
    if tracker.peak_bytes == float("inf"):
        tracker.peak_bytes = sum(tracker.breakdown.values())
    result = {"rank": rank, "peak_bytes": tracker.peak_bytes, "phase": tracker.peak_phase,
              "breakdown": dict(sorted(tracker.breakdown.items(), key=lambda kv: -kv[1])),
              "saved_peak_bytes": saved.peak_bytes,
              "at_start": dict(sorted(at_start.items(), key=lambda kv: -kv[1]))}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure(model: str, candidate: Candidate, warmup: int = 2, phase: str | None = None) -> list[dict[str, Any]]:
    """Per rank: the peak, the phase at the peak and the bytes per kind alive then (phase: the peak inside that
    action alone, e.g. 1W0, on the rank that runs it)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(model, candidate.to_dict(), os.path.join(tmp, "store"), tmp, warmup, phase),
                           nprocs=WORLD_SIZE, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--candidates", nargs="+", required=True)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--phase", help="the peak inside one action only, as the breakdown names it (1W0: stage 1's "
                                        "W of micro-batch 0), on the rank that runs it")
    args = parser.parse_args()
    profile = profile_model(load_model_file(Path(args.model)), batch_size=args.batch_size, repeats=1,
                            precision=args.precision)
    for text in args.candidates:
        candidate = parse_candidate(text, args.batch_size, args.precision)
        ranks = measure(args.model, candidate, phase=args.phase)
        predicted = simulate(profile, candidate, with_timeline=False).peak_memory_bytes
        print(f"== {text}")
        costs = profile.layer_costs(candidate.micro_batch_size)
        stages = _stage_costs(costs, candidate, input_bytes=profile.input_bytes_at(candidate.micro_batch_size),
                              link=LinkModel.for_device(profile.device),
                              loss_saved=profile.loss_saved_bytes_at(candidate.micro_batch_size))
        for field in ("parameter_bytes", "receive_buffer_bytes", "held_bytes", "output_held_bytes", "recompute_bytes",
                      "sent_grad_bytes", "loss_backward_bytes", "first_backward_bytes", "backward_bytes",
                      "input_backward_bytes", "split_kept_bytes"):
            print(f"   model, per stage: {field:22s} {getattr(stages, field)}")
        for r in ranks:
            extra = f"  predicted {predicted[r['rank']]} ({predicted[r['rank']] / r['peak_bytes'] - 1:+.1%})"
            print(f"rank {r['rank']}: peak {r['peak_bytes']} at {r['phase']}{extra}")
            for kind, nbytes in r["breakdown"].items():
                print(f"    {kind:45s} {nbytes:>12d}")
            if r["at_start"]:
                print(f"  alive as {args.phase} starts: {sum(r['at_start'].values())}")
                for kind, nbytes in r["at_start"].items():
                    print(f"    {kind:45s} {nbytes:>12d}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
