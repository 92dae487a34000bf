"""bench/action_trace.py's tracer: imported by every Python process started with this folder on PYTHONPATH (the
trial's fork server, and so its ranks). With AUTOTUNE_TRACE_DIR set it times, per rank, each pipeline action of
torch's schedules (forward_one_chunk F, backward_one_chunk B or I, backward_weight_one_chunk W), the stage module's
own forward and backward inside them, each post (_batch_p2p) and wait (_wait_batch_p2p), and the optimizer step,
and appends one JSON line per event to <dir>/<pid>.jsonl at the end of each RankPipeline.step. Without the variable
it does nothing."""

import os

if os.environ.get("AUTOTUNE_TRACE_DIR"):
    import builtins
    import json
    import time

    _events: list = []
    _clock = time.perf_counter  # CLOCK_MONOTONIC: comparable between the ranks' processes

    def _install() -> None:
        from torch.distributed.pipelining import schedules, stage
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        import autotune.runtime as runtime

        base = stage._PipelineStageBase

        def action(name: str, kind: str) -> None:
            inner = getattr(base, name)

            def timed(self, *args, **kwargs):
                start = _clock()
                result = inner(self, *args, **kwargs)
                full = kwargs.get("full_backward", True) if name == "backward_one_chunk" else True
                _events.append([kind if full else "I", start, _clock(), self.stage_index, args[0] if args else -1])
                return result

            setattr(base, name, timed)

        def module(name: str, kind: str) -> None:
            inner = getattr(base, name)

            def timed(self, *args, **kwargs):
                start = _clock()
                result = inner(self, *args, **kwargs)
                _events.append([kind, start, _clock(), self.stage_index, -1])
                return result

            setattr(base, name, timed)

        action("forward_one_chunk", "F")
        action("backward_one_chunk", "B")
        action("backward_weight_one_chunk", "W")
        module("forward_maybe_with_nosync", "module_F")
        module("backward_maybe_with_nosync", "module_B")
        post, wait = schedules._batch_p2p, schedules._wait_batch_p2p

        def timed_post(ops, desc=None):
            start = _clock()
            works = post(ops, desc=desc)
            _events.append(["post", start, _clock(), -1, len(ops)])
            return works

        def timed_wait(works):
            start = _clock()
            wait(works)
            _events.append(["wait", start, _clock(), -1, len(works)])

        schedules._batch_p2p, schedules._wait_batch_p2p = timed_post, timed_wait
        started: list = [0.0]
        register_optimizer_step_pre_hook(lambda *_: started.__setitem__(0, _clock()))
        register_optimizer_step_post_hook(lambda *_: _events.append(["opt", started[0], _clock(), -1, -1]))
        step = runtime.RankPipeline.step

        def timed_step(self, *args, **kwargs):
            start = _clock()
            result = step(self, *args, **kwargs)
            _events.append(["step", start, _clock(), -1, -1])
            path = os.path.join(os.environ["AUTOTUNE_TRACE_DIR"], f"{os.getpid()}.jsonl")
            with open(path, "a") as out:
                out.writelines(json.dumps(e) + "\n" for e in _events)
            _events.clear()
            return result

        runtime.RankPipeline.step = timed_step

    _import = builtins.__import__
    _installed = [False]

    def _watch(name, *args, **kwargs):
        loaded = _import(name, *args, **kwargs)
        if not _installed[0] and name.startswith("autotune.runtime"):
            _installed[0] = True
            _install()
        return loaded

    builtins.__import__ = _watch
