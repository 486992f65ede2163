"""The parameters that train stay as DDP wrapped them (fastdist.trainer.safety.TrainableCheck),
in one process: the check the loop runs as each pass starts (the bad-input table holds the
2-rank case, a layer frozen in ``on_train_begin``). Audit 69: a layer unfrozen at an epoch's
end on every rank trained apart on each rank for a whole epoch under DDP."""

from __future__ import annotations

import pytest
from torch import nn

from fastdist.trainer.safety import TrainableCheck


def test_a_change_of_requires_grad_is_refused_where_ddp_fixed_it() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    check = TrainableCheck(model, fixed=True)
    free = TrainableCheck(model, fixed=False)  # one process, FSDP: free to change
    check.check()  # unchanged: nothing to say
    model[0].requires_grad_(True)  # gradual unfreezing, as at an epoch's end
    with pytest.raises(ValueError, match=r"unfrozen: \['0.bias', '0.weight'\], frozen: \[\]"):
        check.check()
    model[0].requires_grad_(False)
    model[1].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"unfrozen: \[\], frozen: \['1.bias'\]"):
        check.check()
    free.check()  # changed twice, and no error
