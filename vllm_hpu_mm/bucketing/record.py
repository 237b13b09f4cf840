"""The served step shapes, exported for the bucket planner.

With ``hpu_mm.bucketing.record_steps: FILE`` the first rank appends each
served step's exact (unpadded) shape to FILE, one JSON object a line with the
keys ``vllm-hpu-mm buckets plan --samples FILE`` reads::

    {"num_reqs": 3, "num_decodes": 2, "decode_blocks": 9, "prefill_tokens": 57,
     "prefill_blocks": 4}

so an operator fits the buckets to live traffic: serve with the defaults and
``record_steps``, plan from the file, restart with ``strategy: explicit``. The
other export, the ``step_shape`` histogram on ``/metrics`` (edges below), needs
no setting: ``vllm-hpu-mm buckets plan --metrics SCRAPE`` plans from a saved
scrape (``bucketing.scrape``).
Warmup and the memory profile are not recorded (the recorder starts when warmup
ends). The file is line-buffered: each step's line is written when the step
runs (a write of about 100 bytes against a step of milliseconds).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import IO

logger = logging.getLogger("vllm.hpu_mm.record")

STEP_SHAPE_EDGES: tuple[float, ...] = tuple(
    float(v)
    for v in sorted(
        set(range(1, 17))
        | {(16 + i) << e for e in range(14) for i in range(16)}
        | {1 << 18}
    )
)
"""Edges of the ``step_shape`` histogram on ``/metrics`` (``vllm_hpu_mm.
metrics.STEP_SHAPE``), the other export of the served shapes: every size up to
16, then 16 an octave (multiples of ``2**e / 16`` in ``[2**e, 2**(e+1))``) up to
``2**18``, 240 edges. Fine enough to plan from (``bucketing.scrape``): a size
is known to within 1/16 of itself."""


class StepRecorder:
    """Appends step shapes to a JSONL file once ``start`` is called."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.steps = 0
        self._file: IO[str] | None = None

    def start(self) -> None:
        """Open the file (append) and record from now on."""
        if self._file is not None:
            return
        try:
            self._file = self.path.open("a", encoding="utf-8", buffering=1)
        except OSError as exc:
            raise OSError(
                f"hpu_mm.bucketing.record_steps = {str(self.path)!r}: cannot open "
                f"it for appending ({exc.strerror}); give a writable file path"
            ) from exc
        logger.info("Recording served step shapes to %s", self.path)

    def record(
        self,
        num_reqs: int,
        num_decodes: int,
        decode_blocks: int,
        prefill_tokens: int,
        prefill_blocks: int,
    ) -> None:
        if self._file is None:
            return
        line = json.dumps(
            {
                "num_reqs": num_reqs,
                "num_decodes": num_decodes,
                "decode_blocks": decode_blocks,
                "prefill_tokens": prefill_tokens,
                "prefill_blocks": prefill_blocks,
            }
        )
        self._file.write(line + "\n")
        self.steps += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:  # the engine's shutdown drops the runner
        self.close()
