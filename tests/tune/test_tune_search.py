"""The search of ``gateway tune`` on a simulated gateway whose best settings are known: it finds the
grid's best (or one within a few percent) with far fewer measurements, refuses when nothing can
meet the target, and its outputs (env file, report) say what it chose."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from service.settings import Settings
from service.tune.report import read_env, write_env, write_report
from service.tune.search import Candidate, Level, Plan, Space, Target, Trial, chosen, search

SPACE = Space(workers=(1, 2))
PLAN = Plan.make(quick=False, max_concurrency=64)


def simulated(candidate: Candidate, clients: int) -> Level:
    """A closed loop on a backend whose batch of n takes 2 ms + 0.5 ms x n (a second worker adds
    half as much again; the adaptive policy does not wait for a batch to fill; the fixed one waits
    its delay when fewer clients than its batch size are sending)."""
    n = min(candidate.batch, clients)
    batch_s = 0.002 + 0.0005 * n
    capacity = min(candidate.inflight, 2) * n / batch_s * (1 + 0.5 * (candidate.workers - 1))
    wait = 0.0 if candidate.policy == "adaptive" or clients >= candidate.batch else candidate.delay_ms / 1000
    latency = batch_s + wait + max(0.0, clients / capacity - batch_s)
    throughput = clients / latency
    return Level(clients, throughput, latency * 1000, latency * 1300, 0.0)


class Simulation:
    def __init__(self) -> None:
        self.measured: list[Candidate] = []

    async def __call__(self, candidate: Candidate, levels: Sequence[int], seconds: float, stage: str) -> Trial:
        self.measured.append(candidate)
        trial = Trial(candidate, stage, seconds)
        target = TARGET
        for clients in levels:
            level = simulated(candidate, clients)
            trial.levels.append(level)
            if not target.meets(level):
                break
        return trial


TARGET = Target(slo_p99_ms=40.0)


def grid_best(target: Target) -> float:
    best = 0.0
    for policy, batch, delay, inflight, workers in itertools.product(
        SPACE.policies, SPACE.batches, SPACE.delays_ms, SPACE.inflights, SPACE.workers
    ):
        candidate = Candidate(policy, batch, delay, inflight, workers)
        for clients in PLAN.concurrency:
            level = simulated(candidate, clients)
            if target.meets(level):
                best = max(best, level.throughput)
    return best


async def test_search_finds_the_grids_best_with_a_fraction_of_the_measurements() -> None:
    simulation = Simulation()
    trials = await search(simulation, SPACE, TARGET, PLAN)
    winner = chosen(trials)
    assert winner is not None
    best = winner.best(TARGET)
    assert best is not None
    assert best.p99_ms <= TARGET.p99_ms
    assert best.throughput >= 0.95 * grid_best(TARGET)
    grid_size = len(SPACE.policies) * len(SPACE.batches) * len(SPACE.delays_ms) * len(SPACE.inflights) * 2
    assert len(set(simulation.measured)) < grid_size / 4
    # successive halving: 4 finalists, then 2, then 1, each round longer
    finals = [t for t in trials if t.stage.startswith("final")]
    assert [t.seconds for t in finals] == [4.0] * 4 + [6.0] * 2 + [9.0]
    assert finals[-1] is winner


async def test_a_target_no_candidate_can_meet_chooses_nothing() -> None:
    impossible = Target(slo_p99_ms=1.0)  # every batch takes more than 2 ms here
    trials = await search(Simulation(), SPACE, impossible, Plan.make(quick=True, max_concurrency=16))
    assert chosen(trials) is None
    assert all(t.best(impossible) is None for t in trials)


async def test_min_throughput_out_of_reach_chooses_nothing() -> None:
    greedy = replace(TARGET, min_throughput=10 * grid_best(TARGET))
    trials = await search(Simulation(), SPACE, greedy, Plan.make(quick=True, max_concurrency=64))
    assert chosen(trials) is None


def test_quick_plan_sweeps_fewer_levels_for_shorter() -> None:
    quick, full = Plan.make(quick=True, max_concurrency=64), Plan.make(quick=False, max_concurrency=64)
    assert quick.concurrency == (1, 4, 16, 64)
    assert full.concurrency == (1, 2, 4, 8, 16, 32, 64)
    assert quick.screen_seconds < full.screen_seconds
    assert Plan.make(quick=True, max_concurrency=48).concurrency == (1, 4, 16, 48)


def test_coarse_candidates_span_the_batch_sizes_under_each_policy() -> None:
    coarse = Space(batches=(1, 2, 4, 8, 16, 32)).coarse()
    assert sorted({c.batch for c in coarse}) == [1, 4, 16, 32]
    assert {c.policy for c in coarse} == {"fixed", "adaptive"}


def test_candidate_env_names_real_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    candidate = Candidate("adaptive", 8, 2.0, 4, 1)
    for name, value in candidate.env().items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert (settings.batch_policy, settings.max_batch_size, settings.max_inflight_batches) == ("adaptive", 8, 4)
    assert settings.max_delay == pytest.approx(0.002)


async def test_env_file_and_report_say_what_was_chosen(tmp_path: Path) -> None:
    trials = await search(Simulation(), SPACE, TARGET, Plan.make(quick=True, max_concurrency=64))
    winner = chosen(trials)
    assert winner is not None
    env_file = tmp_path / "tuned.env"
    report = write_report(tmp_path / "report", trials, TARGET, {"backend": "simulated"}, env_file)
    write_env(env_file, winner, TARGET, {"GATEWAY_MODEL": "trivial"}, report)
    assert read_env(env_file) == {"GATEWAY_MODEL": "trivial", **winner.candidate.env()}
    text = report.read_text()
    assert f"Chosen: **{winner.candidate.label}**" in text
    assert text.count("**chosen**") == 1
    assert text.count("\n| ") == len(trials) + 1  # header and one row per run
    rows = (tmp_path / "report" / "candidates.csv").read_text().splitlines()
    assert len(rows) == 1 + sum(len(t.levels) for t in trials)


async def test_tritons_settings_are_searched_from_the_repositorys_values_when_given() -> None:
    """With Triton's dimensions in the space, the search starts from the repository's values and
    walks them like the gateway's own: here more instances add capacity, so it ends on the most."""
    space = Space(
        batches=(4, 16),
        delays_ms=(2.0,),
        policies=("adaptive",),
        inflights=(2,),
        workers=(1,),
        triton_instances=(1, 2, 4),
        triton_delays_us=(0, 2000),
        defaults=Candidate(triton_instances=2, triton_delay_us=2000),
    )
    assert space.start().triton_instances == 2
    assert space.start().triton_delay_us == 2000

    class WithInstances(Simulation):
        async def __call__(self, candidate: Candidate, levels: Sequence[int], seconds: float, stage: str) -> Trial:
            assert candidate.triton_instances is not None
            widened = replace(candidate, workers=candidate.triton_instances)  # each adds capacity
            trial = await super().__call__(widened, levels, seconds, stage)
            return replace(trial, candidate=candidate)

    simulation = WithInstances()
    trials = await search(simulation, space, TARGET, Plan.make(quick=False, max_concurrency=64))
    winner = chosen(trials)
    assert winner is not None
    assert winner.candidate.triton_instances == 4
    assert winner.candidate.server() == {
        "instance_group.count": 4,
        "dynamic_batching.max_queue_delay_microseconds": winner.candidate.triton_delay_us,
    }
    assert "t4" in winner.candidate.label
    assert Candidate().server() == {}  # without a Triton repository nothing of Triton's is set
