"""The report: every figure report.md names exists, the HTML is self-contained, the choice and its gain and reasons
are stated, and each warning appears exactly when its condition holds."""

from __future__ import annotations

import base64
import dataclasses
import io
import re
from pathlib import Path

import pytest
from PIL import Image
from torch import nn

from autotune.candidate import Candidate, uniform_split
from autotune.config_file import save_config
from autotune.model_file import ModelSpec, load_model_file
from autotune.plan import plan
from autotune.records import SearchResult, TrialRecord
from autotune.report import write_search_report
from autotune.report.document import build_document
from autotune.report.facts import gather_facts
from autotune.report.html import _inline, render_html
from autotune.report.markdown import render_markdown
from autotune.report.measures import bm_curves
from autotune.report.reasons import oom_neighbours, size_flag
from autotune.report.writer import FIGURE_NAMES, batchnorm_layers
from autotune.schedules import Schedule
from autotune.search import SearchOptions, run_search
from autotune.simulate import LinkModel, Predictor, simulate
from autotune.tuned_config import SearchSummary, TunedConfig
from tests.conftest import RECIPES
from tests.fakes import SimulatedRunner, synthetic_profile

LIMIT = 64 * 2**20
WARNING_TITLES = {
    "batchnorm": "BatchNorm statistics come from small micro-batches",
    "oom": "Out of memory next to the chosen config",
    "noise": "Measurements too noisy to separate the leaders",
    "asynchronous": "trains on weights one step old",
}
SYNCHRONOUS_FIGURES = [name for name in FIGURE_NAMES if name != "loss_per_step"]
"""What a search without an asynchronous (2BW) run draws."""


make_profile = synthetic_profile



def make_study(tmp_path: Path, *, n_trials: int = 5, fail=lambda c: None, name: str = "s") -> SearchResult:
    """A real (small) search over a fake runner, stored in tmp_path/<name>.db."""
    profile = make_profile()
    options = SearchOptions(gpus=2, batch_size=32, n_trials=n_trials, seed=1, memory_limit_bytes=LIMIT,
                            layouts=((2, 1),))
    planned = plan(profile, gpus=2, batch_size=32, memory_limit_bytes=LIMIT)
    spec = load_model_file(RECIPES / "mlp.py")  # recorded as the study's model; the fake runner never builds it
    return run_search(spec, profile, planned, options, study_name=name, storage=f"sqlite:///{tmp_path / name}.db",
                      runner=SimulatedRunner(fail=fail))


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> SearchResult:
    result = make_study(tmp_path_factory.mktemp("study"))
    assert result.best is not None and result.default is not None
    return dataclasses.replace(result, too_noisy=False)


def write(result: SearchResult, tmp_path: Path, *, spec: ModelSpec | None = None, config: Path | None = None,
          limit: int | None = LIMIT) -> tuple[str, str]:
    """The whole report on disk (figures drawn: about a second)."""
    out = write_search_report(result, spec=spec, profile=make_profile(), config_path=config,
                              report_dir=tmp_path / "report", memory_limit_bytes=limit)
    assert out == tmp_path / "report"
    return (out / "report.md").read_text(), (out / "report.html").read_text()


def text(result: SearchResult, *, spec: ModelSpec | None = None) -> tuple[str, str]:
    """What the report says, without drawing figures (fast)."""
    facts = gather_facts(result, profile=make_profile(), memory_limit_bytes=LIMIT,
                         batchnorm_layers=batchnorm_layers(spec, make_profile()))
    blocks = build_document(facts, [])
    return render_markdown(blocks), render_html(blocks, title=facts.title)


def fake_spec(layer_names: tuple[str, ...], build=None) -> ModelSpec:
    """A spec whose BatchNorm layers are found the way load_model_file finds them: at any depth of each layer."""
    layers = list(build()) if build else []
    return ModelSpec(
        path=Path("/models/net.py"), build_model=build or (lambda: nn.Sequential()), make_batch=lambda b: None,
        loss_fn=lambda o, t: o, build_optimizer=None, layer_names=layer_names, parameter_bytes=(0,) * len(layer_names),
        batchnorm_layers=tuple(i for i, layer in enumerate(layers)
                               if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in layer.modules())),
    )


def record(number: int, candidate: Candidate, outcome: str, **fields) -> TrialRecord:
    return TrialRecord(number=number, candidate=candidate, outcome=outcome, reason=fields.pop("reason", ""),
                       launched=outcome != "pruned", phase="explore", **fields)


# --- files -------------------------------------------------------------------------------------------------------


def test_every_image_report_md_names_exists_and_is_a_png(study, tmp_path):
    markdown, _ = write(study, tmp_path)
    paths = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert sorted(Path(p).stem for p in paths) == sorted(SYNCHRONOUS_FIGURES)
    for relative in paths:
        assert not Path(relative).is_absolute() and relative.startswith("figures/")
        with Image.open(tmp_path / "report" / relative) as image:
            assert image.format == "PNG" and image.width > 500 and image.height > 150


def test_html_is_one_self_contained_file(study, tmp_path):
    _, html = write(study, tmp_path)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", html, re.IGNORECASE)
    assert "<script" not in html.lower() and "<link" not in html.lower() and "@import" not in html
    images = re.findall(r"<img\b[^>]*>", html)
    assert len(images) == len(SYNCHRONOUS_FIGURES)
    for tag in images:
        src = re.search(r'src="([^"]+)"', tag).group(1)
        assert src.startswith("data:image/png;base64,")
        width, height = (int(re.search(rf'{a}="(\d+)"', tag).group(1)) for a in ("width", "height"))
        with Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))) as image:
            assert image.size == (width, height)


def test_a_second_report_replaces_the_first_and_drops_figures_it_cannot_draw(study, tmp_path):
    write(study, tmp_path)
    nothing = dataclasses.replace(study, best=None, best_trial=None, best_estimate=None, leaders=())
    markdown, _ = write(nothing, tmp_path)
    figures = {p.stem for p in (tmp_path / "report" / "figures").glob("*.png")}
    named = {Path(p).stem for p in re.findall(r"\]\((figures/[^)]+)\)", markdown)}
    assert figures == named and "timeline" not in figures
    assert not list((tmp_path / "report").rglob("*.tmp"))


# --- what it says ------------------------------------------------------------------------------------------------


def test_states_the_choice_the_gain_over_the_default_and_why(study):
    markdown, html = text(study)
    best, default = study.best, study.default
    default_ms = next(lead.step_time_ms for lead in study.leaders if lead.candidate == default)
    gain = best.throughput_samples_per_s / (default.global_batch_size / default_ms * 1000) - 1
    for page in (markdown, html):
        assert "Chosen configuration: " in page and best.candidate.key in page
        assert f"{gain * 100:+.0f} % (measured)" in page
        assert "over the rule-of-thumb default" in page and default.key in page
        assert "Why this configuration" in page
        for reason in ("Fastest measured", "Bubble", "Stage balance", "Memory headroom", "B/M = "):
            assert reason in page
    assert "64.0 MiB limit" in markdown


def test_gain_is_predicted_and_says_so_when_the_default_never_ran(study):
    others = tuple(r for r in study.records if r.candidate != study.default)
    leaders = tuple(lead for lead in study.leaders if lead.candidate != study.default)
    result = dataclasses.replace(study, records=others, leaders=leaders)
    markdown, _ = text(result)
    assert "(predicted)" in markdown and "the default was not run in this search" in markdown
    assert "(measured)" not in markdown


def failed(records: tuple[TrialRecord, ...], outcomes: list[str]) -> tuple[TrialRecord, ...]:
    """The records with the first ones turned into failures of the given kinds."""
    changed = [
        dataclasses.replace(r, outcome=o, reason=f"rank 0: injected {o}", throughput_samples_per_s=None,
                            step_time_ms=None, peak_memory_bytes=())
        for r, o in zip(records, outcomes)
    ]
    return tuple(changed) + records[len(changed):]


def test_every_trial_is_listed_with_status_and_reason(study):
    result = dataclasses.replace(study, records=failed(study.records, ["oom", "error", "timeout"]))
    markdown, html = text(result)
    rows = [line for line in markdown.splitlines() if re.match(r"\| \d+( ★)? \|", line)]
    assert [int(row.split()[1]) for row in rows] == [r.number for r in result.records]
    for status in ("**oom**", "**error**", "**timeout**"):
        assert status in markdown
    assert "rank 0: injected timeout" in markdown and "rank 0: injected timeout" in html


def test_reproduce_commands_and_exports(study, tmp_path):
    config = TunedConfig.from_measurement(
        study.best, model="recipes/mlp.py", model_sha256="0123456789abcdef", memory_limit_bytes=LIMIT,
        search=SearchSummary(study="s", storage=study.storage, trials=len(study.records)),
    )
    path = save_config(config, tmp_path / "autotune.yaml")
    markdown, _ = write(study, tmp_path, config=path)
    assert "autotune search" in markdown and "--memory-limit 64MiB" in markdown and "--study-name s-again" in markdown
    assert f"autotune report --storage {study.storage} --study-name s" in markdown
    for heading, snippet in (("### torchtitan", "pipeline_parallel_degree"), ("### deepspeed", "train_batch_size"),
                             ("### megatron", "--pipeline-model-parallel-size")):
        assert heading in markdown and snippet in markdown


def test_no_exports_without_a_config(study, tmp_path):
    markdown, _ = write(study, tmp_path, config=tmp_path / "missing.yaml")
    assert "Use the config in another trainer" not in markdown


def test_a_search_where_nothing_ran_still_reports_every_reason(study, tmp_path):
    records = failed(study.records, ["oom"] * len(study.records))
    result = dataclasses.replace(study, records=records, best=None, best_trial=None, best_estimate=None, leaders=())
    markdown, html = write(result, tmp_path)
    assert "No configuration was chosen" in markdown and "No configuration ran successfully" in markdown
    assert "injected oom" in html


# --- warnings ----------------------------------------------------------------------------------------------------


def test_no_warning_when_no_condition_holds(study):
    markdown, html = text(study, spec=fake_spec(("Linear",) * 8))
    assert "## Warnings" not in markdown
    for title in WARNING_TITLES.values():
        assert title not in markdown and title not in html


def test_batchnorm_model_is_warned_about_with_the_micro_batch_size(study):
    spec = fake_spec(("Linear", "BatchNorm1d") + ("Linear",) * 6,
                     lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), *[nn.Linear(4, 4) for _ in range(6)]))
    markdown, _ = text(study, spec=spec)
    assert WARNING_TITLES["batchnorm"] in markdown and "GroupNorm" in markdown
    assert f"M = {study.best.candidate.micro_batch_size}" in markdown and "1 (BatchNorm1d)" in markdown


def test_batchnorm_inside_a_block_is_found():
    def build():
        return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.ReLU(), nn.Linear(4, 2))

    found = batchnorm_layers(fake_spec(("Sequential", "ReLU", "Linear"), build), make_profile())
    assert found == ["0 (Sequential)"]
    assert batchnorm_layers(fake_spec(("Linear", "ReLU")), make_profile()) == []


def test_oom_next_to_the_chosen_config_is_warned_about(study):
    chosen = study.best.candidate
    doubled = dataclasses.replace(chosen, n_microbatches=chosen.n_microbatches * 2)
    neighbour = record(90, doubled, "oom", reason="rank 0: CUDA out of memory")
    result = dataclasses.replace(study, records=study.records + (neighbour,))
    markdown, _ = text(result)
    assert WARNING_TITLES["oom"] in markdown and "trial 90" in markdown


def test_oom_of_another_schedule_or_a_far_split_is_not_a_neighbour(study):
    chosen = study.best.candidate
    other = Schedule.GPIPE if chosen.schedule is not Schedule.GPIPE else Schedule.ONE_F_ONE_B
    far_m = dataclasses.replace(chosen, n_microbatches=chosen.n_microbatches * 8)
    records = [
        record(1, dataclasses.replace(chosen, schedule=other), "oom"),
        record(2, far_m, "oom"),
        record(3, dataclasses.replace(chosen, n_microbatches=chosen.n_microbatches * 2), "ok"),
    ]
    assert oom_neighbours(chosen, records) == []
    split = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=32, n_microbatches=8,
                      layers_per_stage=(4, 4))
    near = record(4, dataclasses.replace(split, layers_per_stage=(2, 6)), "oom")
    far = record(5, dataclasses.replace(split, layers_per_stage=(1, 7)), "oom")
    assert oom_neighbours(split, [near, far]) == [near]


def test_too_noisy_leaders_are_warned_about(study):
    markdown, _ = text(dataclasses.replace(study, too_noisy=True))
    assert WARNING_TITLES["noise"] in markdown
    assert study.leaders[0].candidate.key in markdown and study.leaders[1].candidate.key in markdown


# --- asynchronous (2BW) runs ----------------------------------------------------------------------------------

SYNC_LOSSES = (2.30, 2.10, 1.90, 1.72, 1.55)
STALE_LOSSES = (2.30, 2.30, 2.12, 1.95, 1.80)  # 2BW: the first two steps train W(0), then one step behind


def with_2bw(study: SearchResult, *, chosen: bool, losses: bool = True) -> SearchResult:
    """The study plus an ok 2BW run (the fastest, when chosen) and a run of the synchronous best that recorded its
    losses per step; losses=False: both stored before trials recorded them."""
    from autotune.records import Leader

    best = study.best
    stale = dataclasses.replace(best.candidate, schedule=Schedule.TWO_BW,
                                layers_per_stage=uniform_split(sum(best.candidate.layers_per_stage), 2))
    stale_ms = best.step_time_ms * (0.8 if chosen else 1.25)
    n = len(study.records)
    records = (*study.records,
               record(n, best.candidate, "ok", step_time_ms=best.step_time_ms, losses=SYNC_LOSSES if losses else (),
                      throughput_samples_per_s=best.throughput_samples_per_s, peak_memory_bytes=best.peak_memory_bytes),
               record(n + 1, stale, "ok", step_time_ms=stale_ms, losses=STALE_LOSSES if losses else (),
                      throughput_samples_per_s=stale.global_batch_size / stale_ms * 1000,
                      peak_memory_bytes=best.peak_memory_bytes))
    leaders = sorted((*study.leaders, Leader(candidate=stale, step_times_ms=(stale_ms,))),
                     key=lambda leader: leader.step_time_ms)
    result = dataclasses.replace(study, records=records, leaders=tuple(leaders))
    if chosen:
        result = dataclasses.replace(result, best=dataclasses.replace(
            best, candidate=stale, step_time_ms=stale_ms, throughput_samples_per_s=stale.global_batch_size / stale_ms
            * 1000))
    return result


def warning_callouts(markdown: str) -> list[str]:
    """The Warnings section's callouts, in order."""
    section = markdown.split("## Warnings")[1].split("\n## ")[0]
    return [block for block in section.split("\n\n") if block.strip()]


def test_a_search_without_2bw_draws_no_loss_figure_and_says_nothing_of_staleness(study):
    facts = gather_facts(study, profile=make_profile(), memory_limit_bytes=LIMIT)
    assert facts.loss_curves == ()
    markdown, _ = text(study)
    assert "asynchronous" not in markdown.lower() and "Loss per step" not in markdown


def test_2bw_runs_that_were_not_chosen_get_the_loss_figure_and_a_warning(study, tmp_path):
    result = with_2bw(study, chosen=False)
    facts = gather_facts(result, profile=make_profile(), memory_limit_bytes=LIMIT)
    stale, synchronous = facts.loss_curves
    assert stale.candidate.schedule is Schedule.TWO_BW and stale.losses == STALE_LOSSES
    assert synchronous.candidate == study.best.candidate and synchronous.losses == SYNC_LOSSES
    markdown, html = write(result, tmp_path)
    paths = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert sorted(Path(p).stem for p in paths) == sorted(FIGURE_NAMES)
    assert "### Loss per step" in markdown and "first two steps train the same weights" in markdown
    warning = warning_callouts(markdown)[-1]  # not the choice: after the other warnings
    assert WARNING_TITLES["asynchronous"] in warning and stale.candidate.key in warning
    for words in ("one step late", "W(t+1) = W(t) - lr * grad f(W(t-1))", "loss per step therefore differs",
                  "one repeated batch", "train your own model with it", "torchtitan, DeepSpeed and Megatron refuse",
                  "from 2.3 to 1.8", "from 2.3 to 1.55", study.best.candidate.key):
        assert words in warning, words
    assert "It is asynchronous" not in markdown  # the chosen config is synchronous
    assert WARNING_TITLES["asynchronous"] in html


def test_a_chosen_2bw_config_is_flagged_where_it_is_stated_and_warned_about_first(study):
    result = with_2bw(study, chosen=True)
    markdown, html = text(result)
    summary = markdown.split("## Warnings")[0]
    assert "Chosen configuration: `" in summary and "**It is asynchronous**: 2BW trains each step" in summary
    first = warning_callouts(markdown)[0]
    assert "The chosen config is asynchronous (2BW)" in first and "Before adopting it" in first
    assert "It is asynchronous" in html


def test_2bw_runs_stored_without_losses_are_warned_about_without_a_figure(study):
    result = with_2bw(study, chosen=False, losses=False)
    facts = gather_facts(result, profile=make_profile(), memory_limit_bytes=LIMIT)
    assert facts.loss_curves == ()
    markdown, _ = text(result)
    assert WARNING_TITLES["asynchronous"] in markdown and "Loss per step" not in markdown


# --- helpers -----------------------------------------------------------------------------------------------------


def test_inline_markdown_to_html_escapes_and_keeps_code_literal():
    assert _inline("**a `x<*y*>` b** & *c*") == "<strong>a <code>x&lt;*y*&gt;</code> b</strong> &amp; <em>c</em>"


def test_size_flag_reads_back_exactly():
    assert size_flag(40 * 2**30) == "40GiB" and size_flag(512 * 2**20) == "512MiB" and size_flag(1000) == "1000"


def predictor(profile):
    return Predictor(profile=profile, link=LinkModel.for_device(profile.device))


def test_bm_curves_follow_each_schedules_rules_and_add_the_chosen_layout():
    curves, recommended = bm_curves(predictor(make_profile()), 2, 32, None)
    one_f_one_b = next(c for c in curves if c.schedule is Schedule.ONE_F_ONE_B)
    assert [m for m, _ in one_f_one_b.points] == [2, 4, 8, 16, 32]  # 1F1B needs B/M >= stages
    assert all(c.pipeline_degree == 2 and c.data_parallel_degree == 1 for c in curves)
    assert recommended is not None and recommended[0] <= recommended[1] and 32 % recommended[0] == 0
    chosen = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, data_parallel_degree=2, global_batch_size=32,
                       n_microbatches=2, layers_per_stage=(8,))
    with_layout, _ = bm_curves(predictor(make_profile()), 2, 32, chosen)
    assert len(with_layout) == len(curves) + 1
    assert (with_layout[-1].pipeline_degree, with_layout[-1].data_parallel_degree) == (1, 2)
    assert [m for m, _ in with_layout[-1].points] == [1, 2, 4, 8, 16]  # divisors of the replica batch


def test_a_bf16_searchs_curves_and_default_are_simulated_at_its_precision():
    """A bf16 profile simulates bf16 candidates only: the B/M curves and the rule-of-thumb default of a bf16 search
    (and of its report rebuilt from the study) are made at the profile's precision."""
    from autotune.search import rule_of_thumb

    bf16 = dataclasses.replace(make_profile(), precision="bf16")
    curves, _ = bm_curves(predictor(bf16), 2, 32, None)
    assert curves and {len(c.points) for c in curves} != {0}
    default = rule_of_thumb(8, 2, 32, bf16.precision)
    assert default.precision == "bf16" and predictor(bf16)(default).throughput_samples_per_s > 0


def test_the_trial_table_folds_repeats_into_one_row_per_configuration(study):
    # Issue 13: 343 trials for 8 runs made a 343-row table; a person reads one row per configuration and outcome.
    best = next(r for r in study.records if r.launched and r.candidate == study.best.candidate)
    pruned = dataclasses.replace(best, outcome="pruned", launched=False, reason="predicted 1 samples/s, too slow",
                                 throughput_samples_per_s=None, step_time_ms=None, phase="explore")
    start = max(r.number for r in study.records) + 1
    repeats = [dataclasses.replace(best, number=start + i, outcome="duplicate", launched=False, phase="explore")
               for i in range(40)]
    prunes = [dataclasses.replace(pruned, number=start + 40 + i) for i in range(12)]
    markdown, _ = text(dataclasses.replace(study, records=study.records + tuple(repeats) + tuple(prunes)))
    plain, _ = text(study)
    table_rows = lambda page: [line for line in page.splitlines() if re.match(r"\| \**\d+", line)]  # noqa: E731
    # one row more: the pruned configuration's first
    assert table_rows(plain) and len(table_rows(markdown)) == len(table_rows(plain)) + 1
    assert f"+40 asked again, not launched: #{start}, #{start + 1}," in markdown
    assert "+11 asked again" in markdown and "folded" in markdown


def test_a_multi_node_reports_predictions_equal_its_configs_predicted_block(tmp_path):
    """Issue 22: the report re-predicts the chosen config from the study (autotune report), with the link and nodes
    the search predicted with, so it says what the config's `predicted` block says (result.best_estimate, which
    tune._config_of writes)."""
    from autotune.search import load_search

    profile = make_profile()
    link = LinkModel.for_device(profile.device).with_probe(inter_latency_s=5e-3, inter_bandwidth_bytes_per_s=2e7)
    options = SearchOptions(gpus=4, batch_size=32, n_trials=4, seed=1, gpus_per_node=2,
                            setup={"nodes": 2, "gpus_per_node": 2})
    planned = plan(profile, gpus=4, batch_size=32, memory_limit_bytes=None, gpus_per_node=2, link=link)
    spec = load_model_file(RECIPES / "mlp.py")
    storage = f"sqlite:///{tmp_path / 'nodes.db'}"
    searched = run_search(spec, profile, planned, options, study_name="nodes", storage=storage,
                          runner=SimulatedRunner(profile), link=link)
    assert searched.best is not None and searched.best_estimate is not None
    predicted = searched.best_estimate  # the config's `predicted` block

    loaded, stored_profile = load_search(storage, "nodes")
    facts = gather_facts(loaded, profile=stored_profile, memory_limit_bytes=None, setup=loaded.setup)
    for estimate in (loaded.best_estimate, facts.estimate):
        assert estimate is not None
        assert estimate.step_time_ms == predicted.step_time_ms
        assert estimate.peak_memory_bytes == predicted.peak_memory_bytes
    one_node = simulate(profile, searched.best.candidate, with_timeline=False)  # what the report said before
    assert one_node.step_time_ms != predicted.step_time_ms


def test_figures_of_a_thousand_ranks_stay_legible():
    # Issue 30: one bar per rank and one row per pipeline rank are unreadable past ~100 ranks: ranks are grouped
    # (memory) or sampled (timeline), and the caption says so.
    from autotune.report.figures import MAX_ROWS, _rank_groups, _sampled_ranks, memory_per_rank, pipeline_timeline
    from autotune.report.measures import RunMemory
    from autotune.simulate import TimelineEvent

    groups = _rank_groups(1000)
    assert len(groups) <= MAX_ROWS and [r for g in groups for r in g] == list(range(1000))
    assert _rank_groups(8) == [range(r, r + 1) for r in range(8)]
    sampled = _sampled_ranks(128)
    assert len(sampled) == MAX_ROWS and sampled[0] == 0 and sampled[-1] == 127 and sampled == sorted(set(sampled))
    assert _sampled_ranks(5) == [0, 1, 2, 3, 4]

    candidate = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=64, data_parallel_degree=16,
                          global_batch_size=1024, n_microbatches=64, layers_per_stage=(1,) * 64)
    peaks = tuple(2**30 + 2**20 * (rank % 64) for rank in range(1024))
    image = memory_per_rank([RunMemory(candidate=candidate, peak_memory_bytes=peaks, step_time_ms=10.0)], 2**31)
    assert image.png.startswith(b"\x89PNG") and "1024 ranks are drawn in 32 groups" in image.caption
    events = [TimelineEvent(rank=r, stage=r, kind=k, microbatch=i, start_ms=(r + 2 * i + (k == "B")) * 1.0,
                            end_ms=(r + 2 * i + (k == "B")) * 1.0 + 0.9)
              for r in range(64) for i in range(64) for k in ("F", "B")]
    timeline = pipeline_timeline(events, pipeline_degree=64, candidate=candidate, bubble_fraction=0.5,
                                 pipeline_time_ms=200.0)
    assert timeline.png.startswith(b"\x89PNG") and "32 of the 64 pipeline ranks are drawn" in timeline.caption


def test_pipeline_or_fsdp_compares_the_best_measured_run_of_each_kind(study):
    """A search that tried a pipeline, pure FSDP and pure data parallelism says which kind ran fastest, from its
    measurements, and what the other kinds did."""
    from autotune.records import Leader

    best = study.best.candidate
    fsdp = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=1, data_parallel_degree=2,
                     global_batch_size=best.global_batch_size, n_microbatches=2,
                     layers_per_stage=(sum(best.layers_per_stage),), data_parallel_mode="shard")
    ddp = dataclasses.replace(fsdp, data_parallel_mode="replicate")
    fsdp_ms = study.best.step_time_ms * 2  # half the pipeline's throughput
    n = len(study.records)
    records = (*study.records,
               record(n, fsdp, "ok", step_time_ms=fsdp_ms, peak_memory_bytes=(3 * 2**20, 5 * 2**20),
                      throughput_samples_per_s=fsdp.global_batch_size / fsdp_ms * 1000),
               record(n + 1, ddp, "oom", reason="rank 1: out of memory"),
               record(n + 2, dataclasses.replace(ddp, n_microbatches=4), "pruned", reason="cannot fit"))
    leaders = (*study.leaders, Leader(candidate=fsdp, step_times_ms=(fsdp_ms,)))
    markdown, html = text(dataclasses.replace(study, records=records, leaders=leaders))
    section = markdown.split("## Pipeline or FSDP?")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(" ★"): line for line in section.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"pipeline", "FSDP", "data parallel"}
    assert f"`{fsdp.key}`" in rows["FSDP"] and "0.50x" in rows["FSDP"] and "5.0 MiB" in rows["FSDP"]
    assert "fastest" in rows["pipeline"] and best.key in rows["pipeline"]
    assert "none ran" in rows["data parallel"] and "1 oom" in rows["data parallel"]
    assert "**pipeline** was fastest, 2.00x the best FSDP run" in section
    assert "Pipeline or FSDP?" in html


def test_a_search_of_one_kind_of_parallelism_has_no_comparison(study):
    markdown, _ = text(study)
    assert "Pipeline or FSDP?" not in markdown


def test_a_tensor_parallel_choice_shows_tp_beside_pp_and_dp(study):
    """The chosen configuration's summary, its at-a-glance table and its layout bullet name the tp degree; a tp run
    is its own kind of parallelism in the comparison."""
    best = study.best
    c = dataclasses.replace(best.candidate, schedule=Schedule.ONE_F_ONE_B, pipeline_degree=1,
                            layers_per_stage=(sum(best.candidate.layers_per_stage),), tensor_parallel_degree=2)
    chosen = dataclasses.replace(best, candidate=c)
    records = (*study.records, record(len(study.records), c, "ok", step_time_ms=best.step_time_ms,
                                      throughput_samples_per_s=best.throughput_samples_per_s,
                                      peak_memory_bytes=best.peak_memory_bytes))
    markdown, html = text(dataclasses.replace(study, best=chosen, records=records))
    assert "pp x dp x tp = 1 x 1 x 2" in markdown and "each stage tensor-parallel over 2 ranks" in markdown
    assert "| pp x dp x tp | 1 x 1 x 2 | " in markdown
    assert "Each stage is split over 2 consecutive ranks with the model's tensor-parallel plan" in markdown
    assert "tensor parallel" in markdown.split("## Pipeline or FSDP?")[1]


def over_nodes(study: SearchResult, records: tuple[TrialRecord, ...], *, gpus_per_node: int | None = 1,
               probed: bool = True, allreduce: float | None = None, one_machine: bool = False) -> tuple[str, str]:
    """The report of `study` as if it had run over nodes of gpus_per_node ranks with (or without) a probed link
    (allreduce: the probe's all-reduce bandwidth, where it timed one; one_machine: the probe found the nodes on one
    machine)."""
    link = LinkModel.for_device("cpu")
    if probed:  # the probe's figures, as tune.probed_link gives them without an intra-node probe
        link = link.with_probe(inter_latency_s=5e-3, inter_bandwidth_bytes_per_s=2e7,
                               inter_allreduce_bandwidth_bytes_per_s=allreduce, nodes_share_host=one_machine)
    setup = {**study.setup, "device": "cpu", "link": dataclasses.asdict(link),
             **({"gpus_per_node": gpus_per_node} if gpus_per_node else {})}
    facts = gather_facts(dataclasses.replace(study, records=records), profile=make_profile(),
                         memory_limit_bytes=LIMIT, setup=setup)
    blocks = build_document(facts, [])
    return render_markdown(blocks), render_html(blocks, title=facts.title)


def timed(number: int, candidate: Candidate, *, measured_ms: float | None, predicted_ms: float | None,
          outcome: str = "ok") -> TrialRecord:
    """A trial that ran in measured_ms after the search predicted predicted_ms for it."""
    rate = candidate.global_batch_size / predicted_ms * 1e3 if predicted_ms else None
    return record(number, candidate, outcome, step_time_ms=measured_ms, predicted_throughput_samples_per_s=rate)


def test_a_multi_node_report_shows_the_probed_link_and_how_far_predictions_over_nodes_were(study):
    """Issue 27: beside the default link, the probed one; over the runs spanning nodes (2 ranks, nodes of 1), the
    median signed error of the predicted step time and the worst; runs inside one node, not launched, or without a
    measurement or a prediction do not count."""
    spans = study.best.candidate
    assert spans.world_size == 2
    one_rank = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=1, data_parallel_degree=1,
                         global_batch_size=spans.global_batch_size, n_microbatches=2,
                         layers_per_stage=(sum(spans.layers_per_stage),))
    records = (
        timed(0, spans, measured_ms=100.0, predicted_ms=80.0),  # -20 %
        timed(1, spans, measured_ms=50.0, predicted_ms=65.0),  # +30 %: the worst
        timed(2, spans, measured_ms=200.0, predicted_ms=210.0),  # +5 %: the median
        timed(3, one_rank, measured_ms=100.0, predicted_ms=10.0),  # one node: not counted
        timed(4, spans, measured_ms=None, predicted_ms=10.0, outcome="oom"),  # nothing measured
        timed(5, spans, measured_ms=100.0, predicted_ms=None),  # nothing predicted
        timed(6, spans, measured_ms=None, predicted_ms=1.0, outcome="pruned"),  # not launched
    )
    markdown, html = over_nodes(study, records)
    section = markdown.split("## Link between nodes")[1].split("\n## ")[0]
    assert "nodes of 1 rank and probed" in section
    assert "| latency | 5.00 ms | 20 us | 20 us |" in section
    assert "| bandwidth | 20 MB/s | 3.00 GB/s | 3.00 GB/s |" in section
    assert "all-reduce" not in section  # a probe that timed none (studies from before it did)
    assert "one machine" not in section
    assert "Over the 3 measured runs of configurations spanning nodes" in section
    assert "off by **+5 %** (median" in section
    assert (f"The worst: `{spans.key}` (trial #1), predicted 65.0 ms against 50.0 ms measured, **+30 %**."
            in section)
    assert "Link between nodes" in html and "<strong>+30 %</strong>" in html

    markdown, _ = over_nodes(study, records[3:])
    section = markdown.split("## Link between nodes")[1].split("\n## ")[0]
    assert "No configuration over more than one node (more than 1 rank) was measured" in section
    assert "| latency | 5.00 ms |" in section

    markdown, _ = over_nodes(study, records, allreduce=1.76e7)  # the probe's all-reduce got 88 % of the stream
    section = markdown.split("## Link between nodes")[1].split("\n## ")[0]
    assert "| collectives' bandwidth (the probe's all-reduce) | 17.6 MB/s | as above | as above |" in section

    markdown, _ = over_nodes(study, records, one_machine=True)  # two network namespaces on one host
    section = markdown.split("## Link between nodes")[1].split("\n## ")[0]
    assert "The probe found both nodes on one machine" in section


def test_a_one_node_report_says_nothing_of_a_link_between_nodes(study):
    records = (timed(0, study.best.candidate, measured_ms=100.0, predicted_ms=80.0),)
    assert "Link between nodes" in over_nodes(study, records)[0]  # the same runs over nodes would show it
    for markdown in (text(study)[0], over_nodes(study, records, gpus_per_node=None)[0],
                     over_nodes(study, records, probed=False)[0]):
        assert "Link between nodes" not in markdown
