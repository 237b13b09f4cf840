"""Step shapes from a saved ``/metrics`` scrape, for the bucket planner.

The server observes every served step's exact sizes in the
``vllm_hpu_mm:step_shape`` histogram (one series per axis: ``tokens``,
``requests``, ``decode_rows``, ``decode_blocks``, ``prefill_tokens``,
``prefill_blocks``). Its edges (``record.STEP_SHAPE_EDGES``) are every size up to 16,
then 16 a power-of-two octave, so a size is known to within 1/16 of itself: a
plan whose edges sit on the histogram's edges pads each step by at most that
much more than a plan from the exact sizes. ``vllm-hpu-mm buckets plan
--metrics FILE`` reads a scrape (``curl http://HOST:PORT/metrics > FILE``)
and plans from it. Each bin counts as its upper edge (the planner then never
under-pads a step of the bin); the ``+Inf`` bin, sizes above every edge, is
counted apart and not planned for.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vllm_hpu_mm.bucketing.planner import AxisSamples
from vllm_hpu_mm.bucketing.record import STEP_SHAPE_EDGES

__all__ = ["STEP_SHAPE_EDGES", "Scrape", "read_step_shape_metrics"]

METRIC = "vllm_hpu_mm:step_shape"

AXES = (
    "tokens",
    "requests",
    "decode_rows",
    "decode_blocks",
    "prefill_tokens",
    "prefill_blocks",
)

_SAMPLE = re.compile(
    r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)"
)
_LABEL = re.compile(r'(?P<key>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Scrape:
    """The ``step_shape`` histogram of one scrape, per axis: (upper edge,
    count) of each bin with a count, and the count above every edge."""

    bins: dict[str, tuple[tuple[int, int], ...]]
    above: dict[str, int]

    def axes(self) -> AxisSamples:
        def get(axis: str) -> tuple[tuple[int, int], ...]:
            return self.bins.get(axis, ())

        return AxisSamples(
            requests=get("requests"),
            decode_rows=get("decode_rows"),
            prefill_tokens=get("prefill_tokens"),
            decode_blocks=get("decode_blocks"),
            prefill_blocks=get("prefill_blocks"),
        )

    @property
    def steps(self) -> int:
        """Steps observed (the ``requests`` axis counts each once)."""
        return sum(c for _, c in self.bins.get("requests", ())) + self.above.get(
            "requests", 0
        )


def read_step_shape_metrics(text: str, where: str = "the scrape") -> Scrape:
    """The ``step_shape`` histogram in Prometheus text exposition ``text``
    (series of every other label, e.g. per engine, summed per axis)."""
    cumulative: dict[str, dict[float, float]] = {}
    for no, line in enumerate(text.splitlines(), 1):
        if not line.startswith(METRIC + "_bucket"):
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group("name") != METRIC + "_bucket":
            continue
        labels = {
            k.group("key"): k.group("value")
            for k in _LABEL.finditer(m.group("labels") or "")
        }
        axis, le = labels.get("axis"), labels.get("le")
        if axis is None or le is None:
            raise ValueError(f"{where}, line {no}: a bucket without axis or le")
        try:
            edge = math.inf if le == "+Inf" else float(le)
            value = float(m.group("value"))
        except ValueError as exc:
            raise ValueError(f"{where}, line {no}: not a number ({exc})") from exc
        by_edge = cumulative.setdefault(axis, {})
        by_edge[edge] = by_edge.get(edge, 0.0) + value
    if not cumulative:
        raise ValueError(
            f"{where} holds no {METRIC} histogram (save the server's /metrics "
            "after it served traffic)"
        )
    bins: dict[str, tuple[tuple[int, int], ...]] = {}
    above: dict[str, int] = {}
    for axis, by_edge in cumulative.items():
        out, before = [], 0.0
        for edge in sorted(by_edge):
            count = by_edge[edge] - before
            before = by_edge[edge]
            if count < 0:
                raise ValueError(
                    f"{where}: {METRIC} axis {axis!r} is not cumulative at le={edge}"
                )
            if count == 0:
                continue
            if math.isinf(edge):
                above[axis] = round(count)
            else:
                out.append((math.ceil(edge), round(count)))
        bins[axis] = tuple(out)
    if not bins.get("requests"):
        raise ValueError(f"{where}: {METRIC} has no served step (axis 'requests')")
    return Scrape(bins, above)
