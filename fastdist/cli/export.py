"""``python -m fastdist export CHECKPOINT OUT``: the model of a checkpoint as one file.

Offline, in one process, with no process group: CHECKPOINT is a checkpoint fastdist wrote (a
``step-*.pt`` file, a sharded ``step-*`` directory of DCP shards, written by any number of
ranks), a checkpoint directory (its newest checkpoint) or a plain ``state_dict`` file (a
best model). OUT gets the whole model's ``state_dict``: a ``.safetensors`` file
(``--format safetensors``, the default for a name ending in ``.safetensors``) or a
``torch.save`` file (``--format torch``); an existing OUT is replaced only with
``--overwrite``, and OUT may lie in no checkpoint directory. Only the model is read: a
sharded checkpoint's optimizer shards stay on disk.

Example:
    python -m fastdist export save/checkpoints model.safetensors
    python -m fastdist export save/checkpoints/step-00000120 model.pt
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fastdist.checkpoint.export import export_checkpoint


def add_parser(commands: Any) -> None:
    """Register the ``export`` command on the ``python -m fastdist`` sub-parsers."""
    parser = commands.add_parser(
        "export",
        help="write the model of a checkpoint (sharded or not) as one safetensors or torch file",
        description=__doc__.split("\n\nExample")[0] if __doc__ else None,
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file or directory")
    parser.add_argument("out", metavar="OUT", help="the file to write")
    parser.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        help="default: safetensors if OUT ends in .safetensors, else torch",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it exists (refused otherwise)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Export; return 0, or 1 with a message on stderr."""
    format = args.format or ("safetensors" if args.out.endswith(".safetensors") else "torch")
    try:
        source = export_checkpoint(args.checkpoint, args.out, format, args.overwrite)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        print(f"fastdist export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({format}): the model of {source}")
    return 0
