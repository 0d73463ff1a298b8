"""``plan --calibrate-from``: the alpha-beta fit recovers known link parameters from a synthesized
CommProfiler CSV (written with the profiling package's own ``write_csv``), falls back to the given
values where it cannot fit and says so, and refuses bad input naming the problem."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from lightning_hier.plan import Cluster, calibrate_from_csv
from lightning_hier.plan.calibrate import fit_alpha_beta
from lightning_hier.plan.cli import main
from lightning_hier.plan.cost_model import flat_ring
from lightning_hier.profiling import CSV_COLUMNS, write_csv

# the "true" cluster the synthetic run was measured on: 2 nodes x 2 devices
NODES, LOCAL = 2, 2
INTRA_BW = 2e9  # bytes/s per device
INTER_BW = 1.25e9  # bytes/s per node (10 Gbit/s), shared by the node's LOCAL concurrent slice all-reduces
ALPHA_INTRA = 20e-6  # seconds per ring step
ALPHA_INTER = 200e-6


def synthesize(
    path: Path,
    steps: int = 30,
    vary: bool = True,
    noise: float = 0.005,
    seed: int = 0,
    kinds: tuple[str, ...] = ("intra", "inter", "world"),
) -> Path:
    """Rows as hier_sliced on NODES x LOCAL would produce them: per step ``k`` buckets of ``S`` bytes in
    total; intra: a reduce-scatter of each bucket and an all-gather of its slice (``L - 1`` steps each);
    inter: the all-reduce of each bucket's slice over the nodes (``2 (N - 1)`` steps). Times follow the
    alpha-beta model with the constants above plus ``noise`` relative Gaussian noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for rank in range(NODES * LOCAL):
        for step in range(steps):
            buckets = 1 + step % 3 if vary else 2
            total = (1 + (step * 7) % 8) * 1_000_000 if vary else 4_000_000
            intra_wire = 2 * (LOCAL - 1) * total // LOCAL
            intra_time = ALPHA_INTRA * (LOCAL - 1) * 2 * buckets + intra_wire / INTRA_BW
            inter_bytes = total // LOCAL
            inter_wire = 2 * (NODES - 1) * inter_bytes // NODES
            inter_time = ALPHA_INTER * 2 * (NODES - 1) * buckets + inter_wire / (INTER_BW / LOCAL)
            common = {"rank": rank, "step": step, "step_ms": 50.0, "compute_ms": 40.0}
            measured = {
                "intra": (2 * buckets, total + total // LOCAL, intra_wire, intra_time),
                "inter": (buckets, inter_bytes, inter_wire, inter_time),
                "world": (1, 8, 12, 50e-6),  # control traffic: not a link the model fits
            }
            for kind in kinds:
                count, nbytes, wire, seconds = measured[kind]
                ms = seconds * 1e3 * (1 + noise * rng.standard_normal())
                rows.append({**common, "kind": kind, "count": count, "bytes": nbytes, "wire_bytes": wire,
                             "time_ms": ms, "exposed_ms": ms / 2, "hidden_ms": ms / 2})  # fmt: skip
    return write_csv(rows, path)


def test_fit_recovers_known_alpha_and_beta(tmp_path: Path) -> None:
    # 0.5 % noise on 120 rows per kind: bandwidths within 2 %, latencies within 10 %
    cal = calibrate_from_csv(synthesize(tmp_path / "run.csv"), latency=1e-6)
    assert (cal.ranks, cal.nodes, cal.devices_per_node) == (4, 2, 2)  # inferred from the inter rows
    assert cal.intra_bandwidth == pytest.approx(INTRA_BW, rel=0.02)
    assert cal.inter_bandwidth == pytest.approx(INTER_BW, rel=0.02)  # per node = 2 x per rank
    assert cal.fits["inter"].bandwidth_per_rank == pytest.approx(INTER_BW / LOCAL, rel=0.02)
    assert cal.fits["intra"].alpha_per_step == pytest.approx(ALPHA_INTRA, rel=0.10)
    assert cal.fits["inter"].alpha_per_collective == pytest.approx(ALPHA_INTER * 2, rel=0.10)
    assert cal.latency == pytest.approx(ALPHA_INTER, rel=0.10) and cal.latency_from == "inter"
    assert "world" not in cal.fits
    for fit in cal.fits.values():  # residuals of the order of the noise: 0.5 % of a row's time
        assert fit.note == "" and 0 < fit.residual_ms < 0.02 * fit.mean_ms
    given = Cluster(16, 8, intra_bandwidth=1e9, inter_bandwidth=1e9, latency=1e-6)
    applied = cal.apply(given)
    assert (applied.nodes, applied.devices_per_node) == (16, 8)
    assert applied.inter_bandwidth == pytest.approx(INTER_BW, rel=0.02)


def test_same_bytes_every_step_fits_beta_with_the_given_latency(tmp_path: Path) -> None:
    # a steady run: every row has the same bytes per collective, so alpha and beta cannot be separated
    path = synthesize(tmp_path / "steady.csv", vary=False)
    cal = calibrate_from_csv(path, latency=ALPHA_INTER)
    inter = cal.fits["inter"]
    assert inter.alpha_per_collective is None and "not identifiable" in inter.note
    assert cal.latency is None  # the model keeps the command line's latency
    assert cal.inter_bandwidth == pytest.approx(INTER_BW, rel=0.02)
    table = cal.table(Cluster(2, 2, 1e9, 1e9, ALPHA_INTER))
    assert re.search(r"latency\s+200 us\s+command line \(not fitted\)", table), table
    assert "alpha not identifiable" in table


def test_too_few_rows_fall_back_to_the_given_values(tmp_path: Path) -> None:
    path = synthesize(tmp_path / "one.csv", steps=1)
    # keep a single inter row (rank 0): beta cannot be fitted from one observation
    text = path.read_text().splitlines()
    keep = [line for line in text if ",inter," not in line or line.startswith("0,")]
    path.write_text("\n".join(keep) + "\n")
    cal = calibrate_from_csv(path, latency=ALPHA_INTRA)  # the intra rows' true alpha: beta unbiased
    assert cal.fits["inter"].rows == 1 and "1 row(s)" in cal.fits["inter"].note
    assert cal.inter_bandwidth is None
    assert cal.fits["intra"].rows == 4 and cal.fits["intra"].alpha_per_collective is None  # < 4 rows
    assert cal.intra_bandwidth == pytest.approx(INTRA_BW, rel=0.02)
    given = Cluster(2, 2, intra_bandwidth=1e9, inter_bandwidth=3e9, latency=ALPHA_INTRA)
    assert cal.apply(given).inter_bandwidth == 3e9
    assert "command line (not fitted)" in cal.table(given)


def test_non_physical_fits_are_not_used() -> None:
    wire = [1e6, 2e6, 4e6, 8e6]
    # time falls as bytes grow: the two-parameter fit has a negative beta; beta alone is refitted with
    # the given alpha (0.1 s per collective): sum(w (t - 0.1)) / sum(w^2) = 1.7e6 / 85e12 s per byte
    alpha, beta, rms, note = fit_alpha_beta([1, 1, 1, 1], wire, [0.8, 0.4, 0.2, 0.1], 0.1)
    assert alpha is None and "non-physical" in note and beta == pytest.approx(85e12 / 1.7e6)
    # every time below the given latency: no positive bandwidth fits at all
    alpha, beta, rms, note = fit_alpha_beta([1, 1, 1, 1], wire, [0.05, 0.04, 0.03, 0.02], 0.1)
    assert alpha is None and beta is None and rms is None and "nothing fitted" in note


def test_cli_prints_the_calibration_and_plans_with_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = synthesize(tmp_path / "run.csv")
    code = main(["--nodes", "2", "--devices-per-node", "2", "--intra-bandwidth", "1GB/s", "--inter-bandwidth",
                 "1Gbit", "--latency", "1us", "--params", "1e8", "--calibrate-from", str(path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    values = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r"^([a-z-]+)\s+([\d.]+) \S+\s+CSV \((?:intra|inter) rows; command line: ", out, re.M
        )
    }
    assert values["intra-bandwidth"] == pytest.approx(INTRA_BW / 1e9, rel=0.02), out  # GB/s
    assert values["inter-bandwidth"] == pytest.approx(INTER_BW * 8 / 1e9, rel=0.02)  # Gbit/s
    assert values["latency"] == pytest.approx(ALPHA_INTER * 1e6, rel=0.10)  # us
    assert re.search(r"^inter\s+120\s", out, re.M) and re.search(r"^intra\s+120\s", out, re.M)
    # the plan below uses the fitted link: compare ddp's line with the model on the true cluster
    truth = flat_ring(Cluster(2, 2, INTRA_BW, INTER_BW, ALPHA_INTER), 4e8)
    ddp = next(line for line in out.splitlines() if line.startswith("ddp (flat ring)"))
    assert float(ddp.split()[3]) == pytest.approx(truth.seconds * 1e3, rel=0.03)
    assert "inter 10 Gbit/s per node" in out


def test_several_csvs_of_one_layout(tmp_path: Path) -> None:
    a = synthesize(tmp_path / "a.csv", vary=False, seed=1)
    steady = calibrate_from_csv(a, latency=0.0)
    assert steady.latency is None
    # a second run with other bucket sizes makes alpha identifiable
    b = synthesize(tmp_path / "b.csv", seed=2)
    both = calibrate_from_csv([a, b], latency=0.0)
    assert both.latency == pytest.approx(ALPHA_INTER, rel=0.10) and both.fits["inter"].rows == 240


@pytest.mark.parametrize(
    ("setup", "kwargs", "message"),
    [
        ("missing", {}, "no such CSV file"),
        ("columns", {}, "lacks the column"),
        ("header", {}, "header but no rows"),
        ("text", {}, "not a number"),
        ("world", {}, "no rows of kind intra or inter"),
        ("inter", {"kinds": ["intra"]}, "no rows of kind intra"),
        ("full", {"kinds": ["world"]}, "kind 'world' is not one the model distinguishes"),
        ("full", {"devices_per_node": 3}, "devices_per_node=3 does not divide the 4 ranks"),
        ("full", {"latency": -1.0}, "latency must be >= 0"),
    ],
)
def test_bad_input_is_refused_naming_the_problem(
    tmp_path: Path, setup: str, kwargs: dict, message: str
) -> None:
    path = tmp_path / f"{setup}.csv"
    if setup == "columns":
        path.write_text("rank,step,kind,count,bytes\n0,0,inter,1,100\n")
    elif setup == "header":
        path.write_text(",".join(CSV_COLUMNS) + "\n")
    elif setup == "text":
        path.write_text(",".join(CSV_COLUMNS) + "\n0,0,inter,two,100,100,1.0,0.5,0.5,5.0,4.0\n")
    elif setup == "world":
        synthesize(path, kinds=("world",))
    elif setup == "inter":
        synthesize(path, kinds=("inter",))
    elif setup == "full":
        synthesize(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        calibrate_from_csv(path, **kwargs)


def test_steps_the_profiler_did_not_time_are_left_out_of_the_fit(tmp_path: Path) -> None:
    """CommProfiler(time_every_n_steps=n) writes timed=0 rows with zero times: fitted as if they were absent
    (the same fit as a CSV of the timed rows alone), and a CSV with no timed row is refused."""
    from lightning_hier.profiling import read_csv

    rows = read_csv(synthesize(tmp_path / "all.csv"))
    sampled = [r if r["step"] % 3 == 0 else {**r, "timed": 0, "time_ms": 0.0, "exposed_ms": 0.0,
               "hidden_ms": 0.0} for r in rows]  # fmt: skip
    mixed = calibrate_from_csv(write_csv(sampled, tmp_path / "sampled.csv"), latency=1e-6)
    alone = calibrate_from_csv(
        write_csv([r for r in rows if r["step"] % 3 == 0], tmp_path / "timed.csv"), latency=1e-6
    )
    for kind in ("intra", "inter"):
        assert mixed.fits[kind].bandwidth_per_rank == alone.fits[kind].bandwidth_per_rank
        assert mixed.fits[kind].alpha_per_step == alone.fits[kind].alpha_per_step
    assert mixed.inter_bandwidth == pytest.approx(INTER_BW, rel=0.05)
    none_timed = write_csv([{**r, "timed": 0} for r in rows], tmp_path / "none.csv")
    with pytest.raises(ValueError, match="no timed step"):
        calibrate_from_csv(none_timed, latency=1e-6)


def test_cli_refuses_a_missing_csv(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["--nodes", "2", "--devices-per-node", "2", "--intra-bandwidth", "1GB/s", "--inter-bandwidth",
                 "1Gbit", "--params", "1e8", "--calibrate-from", str(tmp_path / "nope.csv")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "plan: error: calibrate: no such CSV file" in err and "nope.csv" in err
