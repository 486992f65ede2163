"""Memory per rank before launch: :func:`estimate_memory` and ``python -m fastdist estimate``.

Parameters, gradients and optimizer state follow from the model, the optimizer (stepped once
on the meta device) and how the strategy spreads them; activations are measured from one
micro-batch on the device; the peak adds what is in flight (FSDP's gathered blocks) at the
end of the forward or at the optimizer step.
"""

from fastdist.estimate.memory import MemoryEstimate, estimate_memory
from fastdist.estimate.report import format_bytes, parse_bytes, table

__all__ = ["MemoryEstimate", "estimate_memory", "format_bytes", "parse_bytes", "table"]
