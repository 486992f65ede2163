"""PowerSGD (torch's DDP hook) with its state kept per parameter, so it resumes exactly.

torch's ``powerSGD_hook`` keeps its error feedback and its low-rank ``P``/``Q`` matrices in one
flat tensor per DDP bucket, keyed by the bucket's index. A new DDP lays its buckets out anew:
all parameters in one bucket in the first iteration, then, from the second, in the order the
gradients became ready. Buffers saved by one DDP and restored into another therefore line up
with the wrong parameters. :class:`PowerSGD` wraps the hook: it records which parameters each
bucket holds, and whenever a bucket's parameters change (a new DDP, or its rebuild) it cuts
the old buffers into per-parameter pieces and reassembles them in the new layout. Checkpoints
hold the pieces by parameter name. The hook's arithmetic is torch's own.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from fastdist.checkpoint.rng import decode_numpy_state, encode_numpy_state

#: The state torch keeps per bucket: name in the checkpoint -> PowerSGDState attribute.
BUFFERS = {"error": "error_dict", "p": "p_memory_dict", "q": "q_memory_dict"}


class PowerSGD:
    """torch's PowerSGD hook (rank-1 approximation after 10 plain all-reduces, error feedback,
    warm start) whose state survives bucket rebuilds and resumes.

    Args:
        model: the module DDP wraps (its parameter names key the saved state).
        group: the process group of the gradient all-reduce.
    """

    def __init__(self, model: nn.Module, group: Any) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=10
        )
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.layout: dict[int, list[tuple[str, torch.Size]]] = {}  # bucket -> its parameters
        self.pieces: dict[str, dict[str, torch.Tensor]] = {}  # per parameter, not in a bucket

    def hook(self, state, bucket):
        """The DDP communication hook: torch's, after lining the state up with ``bucket``.

        (Unannotated: DDP checks the annotations' objects, which postponed annotations would
        turn into strings.)
        """
        params = [(self.names[id(p)], p.shape) for p in bucket.parameters()]
        index = bucket.index()
        if self.layout.get(index) != params:  # a new DDP, or its rebuilt buckets
            names = {name for name, _ in params}
            moved = {i: ps for i, ps in self.layout.items() if names & {n for n, _ in ps}}
            self._cut(moved)
            for i in moved:
                del self.layout[i]
            self.layout[index] = params
            self._assemble(index, params, bucket.buffer())
        return powerSGD_hook.powerSGD_hook(state, bucket)

    def _buffers(self, name: str) -> dict[int, torch.Tensor]:
        return getattr(self.state, BUFFERS[name])

    def _cut(self, layout: dict[int, list[tuple[str, torch.Size]]]) -> None:
        """Move the buffers of the buckets of ``layout`` into per-parameter pieces."""
        for index, params in layout.items():
            for name, buffer in BUFFERS.items():
                flat = getattr(self.state, buffer).pop(index, None)
                if flat is None:
                    continue
                for (param, _), piece in zip(
                    params, _split(name, flat, params, self.state), strict=True
                ):
                    self.pieces.setdefault(param, {})[name] = piece

    def _assemble(
        self, index: int, params: list[tuple[str, torch.Size]], like: torch.Tensor
    ) -> None:
        """Build bucket ``index``'s buffers from the pieces of its parameters, if all are here."""
        if not all(name in self.pieces for name, _ in params):
            return
        for name in BUFFERS:
            if not all(name in self.pieces[param] for param, _ in params):
                continue
            parts = [self.pieces[param][name] for param, _ in params]
            order = _order(name, params, self.state)
            flat = torch.cat([parts[i].reshape(-1) for i in order])
            self._buffers(name)[index] = flat.to(like.device, like.dtype)
        for param, _ in params:
            del self.pieces[param]

    def state_dict(self) -> dict[str, Any]:
        """The iteration, the seed generator and every parameter's pieces (CPU tensors)."""
        self._cut(self.layout)  # pieces now; the next hook call reassembles them
        self.layout = {}
        return {
            "iter": self.state.iter,
            "rng": encode_numpy_state(self.state.rng.get_state(legacy=True)),
            "params": {
                param: {name: piece.detach().cpu() for name, piece in pieces.items()}
                for param, pieces in self.pieces.items()
            },
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the buffers are assembled as buckets come."""
        for buffer in BUFFERS.values():
            getattr(self.state, buffer).clear()
        self.layout = {}
        self.state.iter = saved["iter"]
        self.state.rng.set_state(decode_numpy_state(saved["rng"]))
        self.pieces = {param: dict(pieces) for param, pieces in saved["params"].items()}


def _sizes(name: str, params: list[tuple[str, torch.Size]], state: Any) -> list[int]:
    """Elements of each parameter's piece of buffer ``name``, in bucket order."""
    if name == "error":
        return [shape.numel() for _, shape in params]
    sizes = []
    for _, shape in params:
        n = shape[0] if len(shape) else 1
        m = shape.numel() // max(n, 1)
        rank = min(n, m, state.matrix_approximation_rank)
        compress, _, _ = powerSGD_hook._should_compress(n, m, rank, state.min_compression_rate)
        sizes.append(((n if name == "p" else m) * rank) if compress else 0)
    return sizes


def _order(name: str, params: list[tuple[str, torch.Size]], state: Any) -> list[int]:
    """The order of the parameters' pieces in buffer ``name``: bucket order for the error;
    for ``P`` and ``Q``, grouped by matrix shape in order of first appearance, as the hook
    batches them."""
    if name == "error":
        return list(range(len(params)))
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (_, shape) in enumerate(params):
        n = shape[0] if len(shape) else 1
        groups[(n, shape.numel() // max(n, 1))].append(i)
    return [i for members in groups.values() for i in members]


def _split(
    name: str, flat: torch.Tensor, params: list[tuple[str, torch.Size]], state: Any
) -> list[torch.Tensor]:
    """Buffer ``name`` of a bucket cut into its parameters' pieces, in bucket order."""
    sizes = _sizes(name, params, state)
    order = _order(name, params, state)
    pieces: list[torch.Tensor] = [flat[:0]] * len(params)
    start = 0
    for i in order:
        pieces[i] = flat[start : start + sizes[i]]
        start += sizes[i]
    return pieces
