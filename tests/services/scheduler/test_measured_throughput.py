"""Elastic-Tiresias's throughput model taken from measured runs (issue #19):
``MeasuredThroughput``, its curve files, its choice in the cluster config's scaling
options and in ``rhizome-sim elastic`` (unit tests: no servers)."""

from __future__ import annotations

import configparser
import fnmatch
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from services.scheduler.elasticity import load_scaling_config, scaling_from_config
from services.scheduler.elasticity.api import (
    BUNDLED_THROUGHPUT_CURVE,
    THROUGHPUT_CURVE_FORMAT,
    CommunicationBound,
    ElasticJob,
    MeasuredThroughput,
    ScalingConfigError,
    fit_overhead,
    load_throughput_curve,
)
from services.scheduler.elasticity.tiresias import ElasticTiresias
from services.scheduler.sim.cli import main as sim_main

ROOT = Path(__file__).resolve().parents[3]


def write_curve(path: Path, points: list[tuple[Any, Any]], **extra: Any) -> Path:
    doc = {
        "format": THROUGHPUT_CURVE_FORMAT,
        "points": [{"learners": p, "samples_per_s": t} for p, t in points],
        **extra,
    }
    path.write_text(json.dumps(doc))
    return path


# --- the model ---------------------------------------------------------------------------


def test_points_are_made_relative_to_one_learner_and_interpolated_linearly() -> None:
    model = MeasuredThroughput({1: 100.0, 2: 180.0, 4: 300.0})
    assert model.points == ((1, 1.0), (2, 1.8), (4, 3.0))
    assert model.throughput(1) == 1.0
    assert model.throughput(2) == pytest.approx(1.8)
    assert model.throughput(3) == pytest.approx(2.4)  # halfway between 1.8 and 3.0
    assert model.throughput(4) == pytest.approx(3.0)
    assert model.throughput(0) == 0.0 and model.throughput(-2) == 0.0


def test_points_may_be_given_as_pairs() -> None:
    assert MeasuredThroughput([(1, 2.0), (3, 5.0)]).throughput(2) == pytest.approx(1.75)


def test_gain_is_the_difference_of_throughputs_everywhere() -> None:
    model = MeasuredThroughput({1: 1.0, 2: 1.9, 3: 2.5, 6: 4.0, 8: 4.4})
    for p in range(0, 40):
        assert model.gain(p) == pytest.approx(model.throughput(p + 1) - model.throughput(p))
    # measured gains, not the comm-bound model's: 2 -> 3 adds 0.6, 3 -> 4 adds 0.5
    assert model.gain(2) == pytest.approx(0.6)
    assert model.gain(3) == pytest.approx(0.5)


def test_the_fit_recovers_a_communication_bound_overhead() -> None:
    for overhead in (0.0, 0.03, 0.1, 0.4):
        points = {p: CommunicationBound(overhead).throughput(p) for p in (1, 2, 3, 4, 6, 8)}
        assert fit_overhead(points) == pytest.approx(overhead, abs=1e-4)
    # super-linear measurements clip to linear (an overhead below 0 is not a model)
    assert fit_overhead({1: 1.0, 2: 2.2, 4: 4.8}) == 0.0


def test_beyond_the_last_point_the_fitted_communication_bound_shape_is_scaled_to_it() -> None:
    # not on any comm-bound curve: the fit passes near the points, not through them
    model = MeasuredThroughput({1: 1.0, 2: 1.95, 4: 3.0, 8: 4.0})
    tail = CommunicationBound(model.overhead)
    assert 0 < model.overhead < 1
    assert tail.throughput(8) != pytest.approx(4.0, abs=0.05)
    assert model.throughput(8) == pytest.approx(4.0)  # continuous at the last point
    for p in (9, 12, 16, 64):
        assert model.throughput(p) == pytest.approx(4.0 * tail.throughput(p) / tail.throughput(8))
    values = [model.throughput(p) for p in range(8, 65)]
    assert all(b > a for a, b in itertools.pairwise(values))  # still increasing
    assert all(g > 0 for g in (model.gain(p) for p in range(8, 64)))
    # decreasing returns: each added learner adds less than the one before
    assert all(model.gain(p + 1) < model.gain(p) for p in range(8, 64))


def test_a_curve_that_is_exactly_communication_bound_is_that_model_past_its_points() -> None:
    cb = CommunicationBound(0.1)
    model = MeasuredThroughput({p: cb.throughput(p) for p in (1, 2, 4)})
    for p in (1, 2, 4, 5, 8, 16, 32):  # p=3 is interpolated: a straight line, not cb
        assert model.throughput(p) == pytest.approx(cb.throughput(p), rel=1e-3)


def test_a_single_point_is_linear_scaling_beyond_it() -> None:
    model = MeasuredThroughput({1: 7.0})
    assert model.overhead == 0.0
    assert [model.throughput(p) for p in (1, 2, 5)] == [1.0, 2.0, 5.0]


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ({}, "no measured points"),
        ([], "no measured points"),
        ({1: 0.0}, "throughput at p=1 is 0.0; it must be > 0"),
        ({1: 1.0, 2: -3.0}, "throughput at p=2 is -3.0; it must be > 0"),
        ({1: 1.0, 2: math.nan}, "throughput at p=2 is nan"),
        ({1: 1.0, 2: math.inf}, "throughput at p=2 is inf"),
        ({1: 1.0, 2: "fast"}, "throughput at p=2 is 'fast'; use a number > 0"),
        ({1: 1.0, 2: True}, "throughput at p=2 is True"),
        ({0: 1.0, 1: 2.0}, "learners=0; use whole numbers >= 1"),
        ({1: 1.0, -2: 2.0}, "learners=-2"),
        ([(1, 1.0), (2.5, 2.0)], "learners=2.5"),
        ([(1, 1.0), (4, 3.0), (2, 1.8)], "learners must increase strictly; p=2 follows p=4"),
        ([(1, 1.0), (2, 1.8), (2, 1.9)], "learners must increase strictly; p=2 follows p=2"),
        ({2: 1.0, 4: 1.8}, "the first point is p=2; it must be p=1"),
    ],
)
def test_invalid_points_are_refused_naming_the_problem(points: Any, message: str) -> None:
    with pytest.raises(ScalingConfigError, match="throughput curve: ") as err:
        MeasuredThroughput(points)
    assert message in str(err.value)


# --- curve files -------------------------------------------------------------------------


def test_a_curve_file_loads(tmp_path: Path) -> None:
    path = write_curve(tmp_path / "c.json", [(1, 50.0), (2, 90.0), (4, 150.0)], command="x")
    model = load_throughput_curve(path)
    assert model.points == ((1, 1.0), (2, 1.8), (4, 3.0))
    assert load_throughput_curve(str(path)).points == model.points


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "format is None, expected 'rhizome.throughput-curve/1'"),
        (json.dumps({"points": []}), "format is None"),
        (json.dumps({"format": "csv", "points": []}), "format is 'csv'"),
        (json.dumps({"format": THROUGHPUT_CURVE_FORMAT}), "'points' must be a list"),
        (
            json.dumps({"format": THROUGHPUT_CURVE_FORMAT, "points": [{"learners": 1}]}),
            "'points' must be a list of {learners: p, samples_per_s: x}",
        ),
        (
            json.dumps({"format": THROUGHPUT_CURVE_FORMAT, "points": [[1, 2.0]]}),
            "'points' must be a list",
        ),
        (json.dumps({"format": THROUGHPUT_CURVE_FORMAT, "points": []}), "no measured points"),
        (
            json.dumps(
                {
                    "format": THROUGHPUT_CURVE_FORMAT,
                    "points": [
                        {"learners": 1, "samples_per_s": 10},
                        {"learners": 1, "samples_per_s": 12},
                    ],
                }
            ),
            "learners must increase strictly",
        ),
    ],
)
def test_a_file_that_is_not_a_curve_is_refused_naming_it(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "curve.json"
    path.write_text(content)
    with pytest.raises(ScalingConfigError) as err:
        load_throughput_curve(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_a_missing_curve_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ScalingConfigError, match=r"cannot read throughput curve .*nope\.json"):
        load_throughput_curve(tmp_path / "nope.json")


def test_the_bundled_measured_curve_loads_and_says_how_it_was_measured() -> None:
    model = load_throughput_curve(BUNDLED_THROUGHPUT_CURVE)
    learners = [p for p, _ in model.points]
    assert learners[0] == 1 and len(learners) >= 6 and learners[-1] >= 8
    doc = json.loads(BUNDLED_THROUGHPUT_CURVE.read_text())
    for key in ("command", "date", "host", "workload", "fitted_overhead"):
        assert key in doc, key
    assert "elastic_throughput.py" in doc["command"]
    assert doc["fitted_overhead"] == pytest.approx(model.overhead, abs=1e-3)
    assert all(t > 0 for _, t in model.points)


def test_the_bundled_curve_is_declared_package_data() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    patterns = cfg["options.package_data"]["services.scheduler.elasticity"].split(",")
    relative = BUNDLED_THROUGHPUT_CURVE.relative_to(ROOT / "services/scheduler/elasticity")
    assert any(fnmatch.fnmatch(str(relative), pat.strip()) for pat in patterns)


# --- chosen in the cluster config ----------------------------------------------------------


def policy_with(**options: Any) -> ElasticTiresias:
    config = {"scheduler": {"scaling": "elastic-tiresias", "scaling_options": options}}
    policy = scaling_from_config(config)
    assert isinstance(policy, ElasticTiresias)
    return policy


def test_the_policy_takes_the_bundled_measured_curve_from_scaling_options() -> None:
    model = policy_with(throughput_model="measured").model
    assert isinstance(model, MeasuredThroughput)
    assert model.points == load_throughput_curve(BUNDLED_THROUGHPUT_CURVE).points


def test_the_policy_takes_a_curve_file_from_scaling_options(tmp_path: Path) -> None:
    path = write_curve(tmp_path / "c.json", [(1, 1.0), (2, 1.5), (3, 1.7)])
    for options in ({"throughput_curve": str(path)},
                    {"throughput_model": "measured", "throughput_curve": str(path)}):  # fmt: skip
        model = policy_with(**options).model
        assert isinstance(model, MeasuredThroughput)
        assert model.points == ((1, 1.0), (2, 1.5), (3, 1.7))


def test_a_relative_curve_path_in_a_config_file_is_taken_beside_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    write_curve(config_dir / "curve.json", [(1, 1.0), (2, 1.9)])
    (config_dir / "cluster.yaml").write_text(
        "nodes: []\nscheduler:\n  scaling: elastic-tiresias\n"
        "  scaling_options: {throughput_curve: curve.json}\n"
    )
    monkeypatch.chdir(tmp_path)  # the daemon's working directory is not the config's
    policy = load_scaling_config(config_dir / "cluster.yaml")
    assert isinstance(policy, ElasticTiresias)
    assert isinstance(policy.model, MeasuredThroughput)
    assert policy.model.points == ((1, 1.0), (2, 1.9))


def test_without_those_options_the_policy_keeps_the_communication_bound_model() -> None:
    assert policy_with().model == CommunicationBound(0.05)
    assert policy_with(throughput_overhead=0.2).model == CommunicationBound(0.2)
    assert policy_with(throughput_model="comm-bound", throughput_overhead=0.1).model == (
        CommunicationBound(0.1)
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"throughput_model": "exact"}, "throughput_model='exact'; use 'measured' or 'comm-bound'"),
        (
            {"throughput_model": "measured", "throughput_overhead": 0.1},
            "throughput_overhead belongs",
        ),
        ({"throughput_model": "comm-bound", "throughput_curve": "c.json"}, "throughput_curve is"),
        ({"throughput_curve": "/nonexistent/curve.json"}, "cannot read throughput curve"),
        ({"throughput_curv": "c.json"}, "unknown option 'throughput_curv'"),
    ],
)
def test_bad_throughput_options_are_config_errors(options: dict[str, Any], message: str) -> None:
    config = {"scheduler": {"scaling": "elastic-tiresias", "scaling_options": options}}
    with pytest.raises(ScalingConfigError, match=r"scheduler\.scaling_options") as err:
        scaling_from_config(config)
    assert message in str(err.value)


def test_growth_follows_the_measured_gains() -> None:
    # measured: 2 -> 3 learners adds 0.1, 3 -> 4 adds 1.0; the comm-bound model would
    # give the one free learner to the smaller job, the measured curve to the larger
    model = MeasuredThroughput({1: 1.0, 2: 1.9, 3: 2.0, 4: 3.0})
    jobs = [
        ElasticJob("small", 2, 1, 8, 1, 0.0, 0.0, "gpu"),
        ElasticJob("large", 3, 1, 8, 1, 0.0, 1.0, "gpu"),
    ]

    def one_free() -> Any:
        budget = [1]

        def take(job_id: str) -> bool:
            budget[0] -= 1
            return budget[0] >= 0

        return take

    measured = ElasticTiresias(model=model).grow(jobs, one_free())
    assert [(d.job_id, d.learners) for d in measured] == [("large", 4)]
    comm = ElasticTiresias().grow(jobs, one_free())
    assert [(d.job_id, d.learners) for d in comm] == [("small", 3)]


# --- rhizome-sim elastic ----------------------------------------------------------------

SMALL = ["elastic", "--seeds", "1", "--jobs", "20", "--gpus", "16"]


def test_the_simulator_uses_the_measured_curve_by_default() -> None:
    result = CliRunner().invoke(sim_main, SMALL)
    assert result.exit_code == 0, result.output
    assert "throughput model measured (bundled: 1:1.00 2:" in result.output
    out = CliRunner().invoke(sim_main, [*SMALL, "--json"])
    settings = json.loads(out.output)["settings"]
    assert settings["throughput"] == "measured" and settings["overhead"] is None


def test_the_simulator_takes_the_comm_bound_model_or_a_curve_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        sim_main, [*SMALL, "--throughput", "comm-bound", "--overhead", "0.2"]
    )
    assert result.exit_code == 0, result.output
    assert "throughput model comm-bound, overhead 0.2" in result.output
    path = write_curve(tmp_path / "c.json", [(1, 1.0), (2, 1.5), (4, 2.0)])
    result = CliRunner().invoke(sim_main, [*SMALL, "--throughput-curve", str(path)])
    assert result.exit_code == 0, result.output
    assert f"throughput model measured ({path}: 1:1.00 2:1.50 4:2.00;" in result.output


def test_the_model_changes_the_simulated_figures(tmp_path: Path) -> None:
    linear = write_curve(tmp_path / "linear.json", [(1, 1.0), (2, 2.0), (4, 4.0)])
    flat = write_curve(tmp_path / "flat.json", [(1, 1.0), (2, 1.05), (4, 1.1)])
    jct = {}
    for name, path in (("linear", linear), ("flat", flat)):
        out = CliRunner().invoke(sim_main, [*SMALL, "--throughput-curve", str(path), "--json"])
        assert out.exit_code == 0, out.output
        jct[name] = json.loads(out.output)["mean"]["elastic-tiresias"]["jct_mean_min"]
    assert jct["linear"] != jct["flat"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--overhead", "0.2"], "--overhead is the comm-bound model's"),
        (["--throughput", "comm-bound", "--throughput-curve", "c.json"], "goes with --throughput"),
        (["--throughput", "exact"], "'exact' is not one of"),
    ],
)
def test_contradictory_simulator_options_are_usage_errors(extra: list[str], message: str) -> None:
    result = CliRunner().invoke(sim_main, [*SMALL, *extra])
    assert result.exit_code == 2
    assert message in result.output


def test_a_bad_curve_file_for_the_simulator_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "csv"}))
    result = CliRunner().invoke(sim_main, [*SMALL, "--throughput-curve", str(path)])
    assert result.exit_code == 2
    assert "--throughput-curve" in result.output and "format is 'csv'" in result.output
