"""autotune.tune: the whole pipeline (real profile and plan, simulated trials), config kept or replaced, the reporter
told each phase."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from autotune.config_file import load_config
from autotune.errors import InfeasibleError
from autotune.tune import TuneRequest, load_and_profile, tune
from tests.conftest import RECIPES
from tests.fakes import SimulatedRunner


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    @contextlib.contextmanager
    def profiling(self, description):
        self.events.append("profiling")
        yield lambda completed, total, what: self.events.append("profiled") if completed == total else None

    @contextlib.contextmanager
    def planning(self, description):
        self.events.append("planning")
        yield

    @contextlib.contextmanager
    def searching(self, budget):
        self.events.append(f"searching {budget}")
        yield None

    def warning(self, text):
        self.events.append(f"warning: {text}")


@pytest.fixture
def setup(model_file, tmp_path):
    model = model_file()
    _, profile = load_and_profile(model, 16, "cpu", repeats=1)
    request = TuneRequest(model=model, gpus=2, batch_size=16, device="cpu", trials=3, storage=f"sqlite:///{tmp_path}/s.db",
                          study_name="t", output=tmp_path / "tuned.yaml", report_dir=tmp_path / "report",
                          command="autotune search model.py")
    return request, SimulatedRunner(profile)


def test_tune_writes_the_config_and_the_report_then_keeps_a_config_that_still_holds(setup, tmp_path):
    request, runner = setup
    reporter = Recorder()
    outcome = tune(request, reporter, runner=runner)
    assert reporter.events == ["profiling", "profiled", "planning", "searching 3"]
    assert outcome.config_written and not outcome.kept_existing_config and len(runner.calls) == 3
    config = load_config(tmp_path / "tuned.yaml")
    assert config.candidate == outcome.result.best.candidate
    assert config.search.best_trial == outcome.result.best_trial
    assert "# Command: autotune search model.py" in (tmp_path / "tuned.yaml").read_text()
    assert (outcome.report_dir / "report.md").is_file() and (outcome.report_dir / "report.html").is_file()

    before = (tmp_path / "tuned.yaml").read_text()
    report = (outcome.report_dir / "report.md").stat().st_mtime_ns
    again = tune(replace(request, study_name="t2", min_improvement=10.0, report_dir=None), runner=runner)
    assert again.kept_existing_config and not again.config_written and again.report_dir is None
    assert (tmp_path / "tuned.yaml").read_text() == before
    assert (outcome.report_dir / "report.md").stat().st_mtime_ns == report


def test_nothing_fits_is_an_infeasible_error_before_any_trial(setup, tmp_path):
    request, runner = setup
    with pytest.raises(InfeasibleError, match="--memory-limit"):
        tune(replace(request, memory_limit_bytes=1024), runner=runner)
    assert runner.calls == [] and not (tmp_path / "tuned.yaml").exists()


def test_only_micro_batch_sizes_a_candidate_can_use_are_profiled(monkeypatch):
    # Issue 13, item 12: `plan` at B 4096 over 1024 GPUs profiled sizes up to 4096; no layout can use over 256.
    import autotune.profiling
    from autotune.plan import largest_micro_batch
    from tests.conftest import RECIPES

    assert largest_micro_batch(1024, 4096, 96) == 256
    assert largest_micro_batch(2, 16, 10) == 16  # GPipe on 2 ranks takes the whole batch as one micro-batch
    asked = []

    def fake_profile(spec, *, micro_batch_sizes, **kwargs):
        asked.append(micro_batch_sizes)
        raise KeyboardInterrupt  # enough: the sizes were chosen

    monkeypatch.setattr(autotune.profiling, "profile_model", fake_profile)
    with pytest.raises(KeyboardInterrupt):
        load_and_profile(RECIPES / "mlp.py", 4096, "cpu", gpus=64)  # 10 layers: pp <= 8, so dp >= 8
    assert max(asked[0]) == 512 == largest_micro_batch(64, 4096, 10)


def test_the_search_asks_the_tp_degrees_the_models_plan_allows(tmp_path):
    """A model without a plan: tp 1 only; asking it for tp 2 names why. The Llama recipe (4 heads, 2 key/value heads):
    1 and 2 on 4 GPUs; asked for 4, the key/value heads refuse it."""
    from autotune.errors import InvalidCandidateError
    from autotune.model_file import load_model_file
    from autotune.tune import search_tp_degrees

    mlp = load_model_file(RECIPES / "mlp.py")
    assert search_tp_degrees(mlp, 4, None) == (1,)
    with pytest.raises(InvalidCandidateError, match="needs a tensor-parallel plan"):
        search_tp_degrees(mlp, 4, None, (1, 2))
    pytest.importorskip("transformers")
    llama = load_model_file(RECIPES / "hf_llama.py")
    assert search_tp_degrees(llama, 4, None) == (1, 2)
    assert search_tp_degrees(llama, 4, None, (2,)) == (2,)
    with pytest.raises(InvalidCandidateError, match=r"key/value heads \(2\)"):
        search_tp_degrees(llama, 4, None, (4,))


def test_a_probed_link_replaces_the_defaults_inside_a_node_and_adds_the_crossing_between_nodes():
    from autotune.simulate import LinkModel
    from autotune.tune import probed_link

    cuda = LinkModel.for_device("cuda")
    assert probed_link(cuda, intra=None, inter=None) is None
    inside = probed_link(cuda, intra=(10e-6, 150e9), inter=None)
    assert (inside.latency_s, inside.bandwidth_bytes_per_s) == (10e-6, 150e9)
    assert inside.per_action_overhead_ms == LinkModel.for_device("cuda").per_action_overhead_ms
    both = probed_link(cuda, intra=(10e-6, 150e9), inter=(30e-6, 25e9))
    assert both.bandwidth_bytes_per_s == 150e9
    assert both.inter_node_latency_s == pytest.approx(30e-6)
    assert both.inter_node_bandwidth_bytes_per_s == pytest.approx(25e9)
    assert not both.nodes_share_host
    namespaces = probed_link(cuda, intra=None, inter=(30e-6, 25e9, None, True))  # the probe read one boot id
    assert namespaces.nodes_share_host and namespaces.inter_node_allreduce_bandwidth_bytes_per_s is None


def test_the_local_link_probe_measures_two_ranks_of_this_machine():
    """What a CUDA search of 2+ GPUs runs before profiling (GPU 0 <-> GPU 1 over NCCL), here over gloo."""
    from autotune.trial.launch import probe_local_link

    latency, bandwidth = probe_local_link("cpu")
    assert 0 < latency < 0.1 and bandwidth > 1e6


def test_the_link_probe_says_when_its_two_ranks_are_one_machine():
    """Two ranks of this machine read one boot id: the inter-node probe of two network namespaces (or containers)
    on one host says so, and the simulator charges their crossing posts as inside a node (nodes_share_host)."""
    from autotune.trial.launch import TrialOptions, run_ranks
    from autotune.trial.probe import boot_id

    if boot_id() is None:
        pytest.skip("no boot id to read on this system")
    outcome = run_ranks("", None, TrialOptions(timeout_s=60, device="cpu"), ranks=range(2), kind="probe",
                        world_size=2)
    assert [outcome.results[r]["same_host"] for r in range(2)] == [True, True]
