"""Whether a tensor is a DTensor, or a module is sharded by FSDP, without importing torch's
``torch.distributed.tensor`` and ``torch.distributed.fsdp`` (~0.6 s, which a DDP run never
needs): neither kind of object can exist before its package is imported."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs  # typing's from Python 3.13


def is_dtensor(obj: Any) -> TypeIs[DTensor]:
    """``isinstance(obj, DTensor)``."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def is_fsdp_module(obj: Any) -> TypeIs[FSDPModule]:
    """``isinstance(obj, FSDPModule)``: a module ``fully_shard`` sharded."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(obj, FSDPModule)
