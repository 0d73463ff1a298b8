"""Fit the cost model's alpha-beta parameters to a measured run: ``plan --calibrate-from <CSV>``.

Input: the ``comm_profile.csv`` of :class:`lightning_hier.CommProfiler` (one row per rank x step x
link kind; :func:`lightning_hier.profiling.read_csv`). For each link kind the model distinguishes,
``intra`` (a node's devices) and ``inter`` (across nodes), every row with communication is one
observation::

    time = alpha_c * count + wire_bytes / beta_r        (least squares over the rows)

``alpha_c`` is the latency of one collective, ``beta_r`` the bandwidth one rank's ring sees. The model
(:mod:`.cost_model`) counts latency per ring *step* and bandwidth per device (intra) or per node
(inter), so the fit is converted with the measured layout of ``N`` nodes x ``L`` devices:

- an ``intra`` collective (reduce-scatter or all-gather over ``L``) is ``L - 1`` steps; ``inter`` (the
  all-reduce of a slice over ``N``) is ``2 (N - 1)`` steps: ``alpha = alpha_c / steps``;
- ``intra_bandwidth = beta_r(intra)``; ``inter_bandwidth = L * beta_r(inter)``: all ``L`` devices of a
  node run their slice's all-reduce at once over the node's one link (what ``hier_sliced`` does).

The model has one latency for both links: the calibrated one is the inter-node alpha where it was
fitted (it dominates at scale), else the intra-node one; both are printed.

What cannot be fitted keeps the value given on the command line, and the table says why:

- **alpha is not identifiable** when every row has about the same bytes per collective (a steady
  training run sends the same buckets every step): the two columns are then proportional. The fit
  then keeps the given latency and fits only beta (``time - alpha_c * count = wire_bytes / beta_r``).
  Rows of two runs with different bucket sizes (several CSVs) make alpha identifiable.
- too few rows (fewer than :data:`MIN_ROWS_BETA` for beta alone, :data:`MIN_ROWS_BOTH` for both);
- a non-physical fit (negative alpha: refitted with the given latency; non-positive beta: not used).

``N`` is found from the ``inter`` rows (an all-reduce over ``N`` puts ``2 (N - 1) / N`` of its bytes on
the wire) and ``L`` = ranks / ``N``; give ``devices_per_node`` when the run was laid out otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from lightning_hier.plan.cost_model import Cluster

KINDS = ("intra", "inter")
MIN_ROWS_BETA = 2  # rows needed to fit beta alone
MIN_ROWS_BOTH = 4  # rows needed to fit alpha and beta together
MIN_SPREAD = 2.0  # max / min bytes per collective over the rows needed to separate alpha from beta


@dataclass(frozen=True)
class LinkFit:
    """The fit of one link kind. ``None`` where a value was not fitted (the table says why in ``note``)."""

    kind: str
    rows: int  # rows with communication of this kind
    group_size: int  # ranks in one group of this kind in the measured run
    steps_per_collective: int  # ring steps of one collective (L - 1 intra, 2 (N - 1) inter)
    alpha_per_collective: float | None  # seconds, fitted
    bandwidth_per_rank: float | None  # bytes/s one rank's ring sees, fitted
    residual_ms: float | None  # root mean square of the fit's residuals
    mean_ms: float  # mean measured time of a row
    note: str = ""

    @property
    def alpha_per_step(self) -> float | None:
        if self.alpha_per_collective is None or self.steps_per_collective < 1:
            return None
        return self.alpha_per_collective / self.steps_per_collective


@dataclass(frozen=True)
class Calibration:
    """The cost model's parameters fitted to a measured run; ``None`` = not fitted (keep the given one)."""

    paths: tuple[str, ...]
    ranks: int
    nodes: int  # of the measured run
    devices_per_node: int  # of the measured run
    intra_bandwidth: float | None  # bytes/s per device
    inter_bandwidth: float | None  # bytes/s per node
    latency: float | None  # seconds per ring step
    latency_from: str | None  # the kind the latency was taken from
    fits: dict[str, LinkFit] = field(default_factory=dict)

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` with the fitted values in place of its own (the others are kept)."""
        values = {
            name: getattr(self, name)
            for name in ("intra_bandwidth", "inter_bandwidth", "latency")
            if getattr(self, name) is not None
        }
        return replace(cluster, **values)

    def table(self, given: Cluster) -> str:
        """What was fitted, from which rows, how well, and what was kept from ``given``."""
        names = ", ".join(self.paths)
        lines = [
            f"calibration from {names}: {self.ranks} rank(s) measured as {self.nodes} node(s) x "
            f"{self.devices_per_node} device(s)",
            f"{'kind':<7}{'rows':>6}{'alpha/coll us':>15}{'alpha/step us':>15}{'MB/s per rank':>15}"
            f"{'rms resid ms':>14}{'mean ms':>10}  note",
        ]
        for kind in KINDS:
            fit = self.fits.get(kind)
            if fit is None:
                continue
            alpha_c = "-" if fit.alpha_per_collective is None else f"{fit.alpha_per_collective * 1e6:.3g}"
            alpha_s = "-" if fit.alpha_per_step is None else f"{fit.alpha_per_step * 1e6:.3g}"
            beta = "-" if fit.bandwidth_per_rank is None else f"{fit.bandwidth_per_rank / 1e6:.4g}"
            resid = "-" if fit.residual_ms is None else f"{fit.residual_ms:.3g}"
            lines.append(
                f"{kind:<7}{fit.rows:>6}{alpha_c:>15}{alpha_s:>15}{beta:>15}{resid:>14}{fit.mean_ms:>10.3g}"
                + (f"  {fit.note}" if fit.note else "")
            )
        lines.append("model parameter     value used              source")
        rows = [
            ("intra-bandwidth", self.intra_bandwidth, given.intra_bandwidth, "intra", _gbytes),
            ("inter-bandwidth", self.inter_bandwidth, given.inter_bandwidth, "inter", _gbits),
            ("latency", self.latency, given.latency, self.latency_from, _micro),
        ]
        for name, fitted, cli, kind, fmt in rows:
            if fitted is None:
                lines.append(f"{name:<20}{fmt(cli):<24}command line (not fitted)")
            else:
                lines.append(f"{name:<20}{fmt(fitted):<24}CSV ({kind} rows; command line: {fmt(cli)})")
        return "\n".join(lines)


def calibrate_from_csv(
    path: str | Path | Sequence[str | Path],
    *,
    latency: float = 5e-6,
    devices_per_node: int | None = None,
    kinds: Sequence[str] | None = None,
) -> Calibration:
    """Fit alpha and beta per link kind to the rows of one or more CommProfiler CSVs (one run layout).

    ``latency`` (seconds per ring step) is assumed where alpha cannot be fitted (the CLI passes
    ``--latency``). ``devices_per_node`` is the measured run's (default: inferred, see the module
    docstring). ``kinds``: the kinds that must be fitted (default: whichever of intra / inter have
    rows, at least one); a kind named here without rows is an error.
    Raises ``ValueError`` naming the problem: a missing file, a CSV without the needed columns, no rows
    of a needed kind, a layout that does not divide the ranks.
    """
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise ValueError("calibrate: no CSV given.")
    if not (isinstance(latency, (int, float)) and math.isfinite(latency) and latency >= 0):
        raise ValueError(f"calibrate: latency must be >= 0 seconds, got {latency!r}.")
    for kind in kinds or ():
        if kind not in KINDS:
            raise ValueError(f"calibrate: kind {kind!r} is not one the model distinguishes ({list(KINDS)}).")
    rows: list[dict[str, Any]] = []
    ranks: set[int] | None = None
    for p in paths:
        these = _read(Path(p))
        file_ranks = {int(r["rank"]) for r in these}
        if ranks is not None and file_ranks != ranks:
            raise ValueError(
                f"calibrate: {p} has ranks {sorted(file_ranks)}, the other CSV(s) {sorted(ranks)}: "
                "calibrate from runs of one layout."
            )
        ranks = file_ranks
        rows += these
    world = len(ranks or ())
    by_kind = {k: [r for r in rows if r["kind"] == k and int(r["count"]) > 0] for k in KINDS}
    present = sorted({str(r["kind"]) for r in rows if int(r["count"]) > 0})
    wanted = list(kinds) if kinds else [k for k in KINDS if by_kind[k]]
    missing = [k for k in wanted if not by_kind[k]]
    if not wanted or missing:
        raise ValueError(
            f"calibrate: {', '.join(str(p) for p in paths)} has no rows of kind "
            f"{' or '.join(missing or list(KINDS))} with communication (kinds present: {present or 'none'}); "
            "calibrate from a hier_sliced run (ddp's flat ring mixes both links in kind 'world')."
        )
    nodes, local = _layout(by_kind["inter"], world, devices_per_node)
    steps = {"intra": local - 1, "inter": 2 * (nodes - 1)}
    group = {"intra": local, "inter": nodes}
    fits = {k: _fit(k, by_kind[k], group[k], steps[k], latency) for k in KINDS if by_kind[k] or k in wanted}
    intra, inter = fits.get("intra"), fits.get("inter")
    inter_bw = None if inter is None or inter.bandwidth_per_rank is None else inter.bandwidth_per_rank * local
    latency_fit, latency_from = None, None
    for kind in ("inter", "intra"):
        fit = fits.get(kind)
        if fit is not None and fit.alpha_per_step is not None:
            latency_fit, latency_from = fit.alpha_per_step, kind
            break
    return Calibration(
        paths=tuple(str(p) for p in paths),
        ranks=world,
        nodes=nodes,
        devices_per_node=local,
        intra_bandwidth=None if intra is None else intra.bandwidth_per_rank,
        inter_bandwidth=inter_bw,
        latency=latency_fit,
        latency_from=latency_from,
        fits=fits,
    )


def fit_alpha_beta(
    count: Sequence[float], wire_bytes: Sequence[float], seconds: Sequence[float], alpha_given: float
) -> tuple[float | None, float | None, float | None, str]:
    """Least squares of ``seconds = alpha * count + wire_bytes / beta``.

    Returns ``(alpha or None, beta or None, rms residual in seconds or None, note)``: ``alpha`` is
    ``None`` when it was not fitted (then ``alpha_given`` was used to fit beta), ``beta`` ``None`` when
    no positive bandwidth fits. ``note`` says what was not fitted and why (empty when both were).
    """
    n = np.asarray(count, dtype=float)
    w = np.asarray(wire_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    rows = len(t)
    if rows < MIN_ROWS_BETA:
        return None, None, None, f"{rows} row(s), at least {MIN_ROWS_BETA} needed: nothing fitted"
    if not np.any(w > 0):
        return None, None, None, "no bytes on the wire: nothing fitted"
    note = ""
    per_collective = w / n
    spread = float(per_collective.max() / per_collective.min()) if per_collective.min() > 0 else math.inf
    if rows < MIN_ROWS_BOTH:
        note = f"alpha not fitted ({rows} rows, {MIN_ROWS_BOTH} needed): given latency kept"
    elif spread < MIN_SPREAD:
        size = float(np.sum(w) / np.sum(n))
        note = (
            f"alpha not identifiable (bytes per collective vary only {spread:.2f}x, {MIN_SPREAD:g}x needed): "
            f"given latency kept; beta holds near {_size(size)} per collective"
        )
    else:
        (alpha, inverse_beta), *_ = np.linalg.lstsq(np.stack([n, w], axis=1), t, rcond=None)
        if alpha >= 0 and inverse_beta > 0:
            rms = float(np.sqrt(np.mean((t - alpha * n - w * inverse_beta) ** 2)))
            return float(alpha), float(1.0 / inverse_beta), rms, ""
        note = f"fitted alpha {alpha * 1e6:.3g} us or beta < 0 (non-physical): given latency kept"
    rest = t - alpha_given * n
    inverse_beta = float(np.dot(w, rest) / np.dot(w, w))
    if not inverse_beta > 0:
        return None, None, None, note + "; no positive bandwidth fits: nothing fitted"
    rms = float(np.sqrt(np.mean((rest - w * inverse_beta) ** 2)))
    return None, 1.0 / inverse_beta, rms, note


def _fit(kind: str, rows: list[dict[str, Any]], group: int, steps: int, latency: float) -> LinkFit:
    count = [float(r["count"]) for r in rows]
    wire = [float(r["wire_bytes"]) for r in rows]
    seconds = [float(r["time_ms"]) * 1e-3 for r in rows]
    mean_ms = 1e3 * sum(seconds) / len(seconds) if seconds else 0.0
    if steps < 1:
        return LinkFit(kind, len(rows), group, steps, None, None, None, mean_ms,
                       f"groups of {group} rank(s) do not communicate: nothing fitted")  # fmt: skip
    alpha, beta, rms, note = fit_alpha_beta(count, wire, seconds, latency * steps)
    return LinkFit(
        kind, len(rows), group, steps, alpha, beta, None if rms is None else rms * 1e3, mean_ms, note
    )


def _layout(inter_rows: list[dict[str, Any]], world: int, devices_per_node: int | None) -> tuple[int, int]:
    """``(nodes, devices_per_node)`` of the measured run."""
    local = devices_per_node
    if local is not None:
        if isinstance(local, bool) or not isinstance(local, int) or local < 1:
            raise ValueError(f"calibrate: devices_per_node must be a positive integer, got {local!r}.")
        if world % local:
            raise ValueError(
                f"calibrate: devices_per_node={local} does not divide the {world} ranks of the CSV."
            )
        return world // local, local
    if not inter_rows:
        return 1, world  # no inter-node traffic: one node
    sent = sum(float(r["bytes"]) for r in inter_rows)
    wire = sum(float(r["wire_bytes"]) for r in inter_rows)
    ratio = wire / sent if sent > 0 else 0.0  # all-reduce over N: 2 (N - 1) / N
    nodes = round(2.0 / (2.0 - ratio)) if ratio < 2.0 else 0
    if nodes < 2 or abs(ratio - 2.0 * (nodes - 1) / nodes) > 0.01 or world % nodes:
        raise ValueError(
            f"calibrate: cannot tell the measured layout from the inter rows (wire/bytes = {ratio:.4f}, "
            f"{world} ranks); give the measured run's devices per node (--calibrate-devices-per-node)."
        )
    return nodes, world // nodes


def _read(path: Path) -> list[dict[str, Any]]:
    from lightning_hier.profiling.report import read_csv, timed_rows  # imports torch: only when calibrating

    if not path.is_file():
        raise ValueError(f"calibrate: no such CSV file: {path}.")
    try:
        rows = read_csv(path)
    except (ValueError, TypeError) as error:
        message = str(error)
        if "is not a CommProfiler CSV" in message:
            raise ValueError(f"calibrate: {message}") from error
        raise ValueError(f"calibrate: {path} has a value that is not a number ({message}).") from error
    except (UnicodeDecodeError, OSError) as error:
        raise ValueError(f"calibrate: cannot read {path} as a CSV ({error}).") from error
    if not rows:
        raise ValueError(f"calibrate: {path} has a header but no rows.")
    rows = timed_rows(rows)  # CommProfiler(time_every_n_steps=n): times of timed steps only
    if not rows:
        raise ValueError(f"calibrate: {path} has no timed step (every row has timed=0).")
    return rows


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"


def _gbytes(value: float) -> str:
    return f"{value / 1e9:.4g} GB/s"


def _gbits(value: float) -> str:
    return f"{value * 8 / 1e9:.4g} Gbit/s"


def _micro(value: float) -> str:
    return f"{value * 1e6:.4g} us"
