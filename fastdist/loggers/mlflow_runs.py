"""What :class:`~fastdist.loggers.MLflowLogger` asks of a tracking store: that a server
answers at all (quickly), which run a resume continues, and a run's history copied."""

from __future__ import annotations

import os
import posixpath
import re
import socket
import time
from typing import Any
from urllib.parse import urlsplit

#: How long :func:`check_reachable` waits for a tracking server to accept a connection.
PROBE_SECONDS = 3.0
#: MLflow's HTTP client settings, where the environment sets none: a server that stops
#: answering costs about 3 x 5 s + 3 s of back-off per request, not MLflow's minutes.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
}
#: Tags linking the runs of a rolled-back or moved training run.
CONTINUES, FROM_STEP, SUPERSEDED_BY = (
    "fastdist.continues",
    "fastdist.continues_from_step",
    "fastdist.superseded_by",
)
BATCH = 1000  # MLflow's limit on the metrics of one log_batch


def check_reachable(uri: str | None) -> None:
    """For an ``http(s)`` tracking URI: raise ``ConnectionError`` naming it unless its server
    accepts a connection within :data:`PROBE_SECONDS`, and bound MLflow's HTTP retries and
    timeouts (:data:`HTTP_LIMITS`, unless the environment sets them)."""
    if uri is None:
        return
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    for name, value in HTTP_LIMITS.items():
        os.environ.setdefault(name, value)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise ConnectionError(
            f"the MLflow tracking server {uri} is unreachable ({exc}): start it, or pass "
            "another tracking_uri (e.g. sqlite:///runs/mlflow.db)"
        ) from exc


def find_run(client: Any, run_id: str) -> Any:
    """The run ``run_id`` of the store, or ``None`` if the store does not hold it."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def successor(client: Any, run: Any, step: int) -> Any:
    """The run that continues ``run`` at ``step``: ``run`` itself, or, where a rollback to
    a step up to ``step`` superseded it, the run that continued it (followed on)."""
    while (after := run.data.tags.get(SUPERSEDED_BY)) is not None:
        found = find_run(client, after)
        if found is None or int(found.data.tags.get(FROM_STEP, step + 1)) > step:
            break
        run = found
    return run


def supersede(client: Any, run: Any, new_id: str) -> None:
    """Tag ``run``, and every run that continued it before (a deeper rollback: their steps
    after the new run's start are discarded too), :data:`SUPERSEDED_BY` ``new_id``."""
    seen = set()
    while run is not None and run.info.run_id not in seen:
        seen.add(run.info.run_id)
        after = run.data.tags.get(SUPERSEDED_BY)
        client.set_tag(run.info.run_id, SUPERSEDED_BY, new_id)
        run = None if after is None else find_run(client, after)


def last_steps(client: Any, run: Any) -> dict[str, int]:
    """Each metric of ``run``: the last step it holds it at."""
    run_id = run.info.run_id
    history = {key: client.get_metric_history(run_id, key) for key in run.data.metrics}
    return {key: max(m.step for m in found) for key, found in history.items() if found}


def copy_history(client: Any, source: Any, target_id: str, through: int) -> dict[str, int]:
    """Copy ``source``'s metrics at steps up to ``through`` into the run ``target_id``; return
    each copied metric's last step."""
    from mlflow.entities import Metric

    run_id = source.info.run_id
    metrics = [
        Metric(m.key, m.value, m.timestamp, m.step)
        for key in source.data.metrics
        for m in client.get_metric_history(run_id, key)
        if m.step <= through
    ]
    for start in range(0, len(metrics), BATCH):
        client.log_batch(target_id, metrics=metrics[start : start + BATCH])
    held: dict[str, int] = {}
    for m in metrics:
        held[m.key] = max(m.step, held.get(m.key, -1))
    return held


def mlflow_name(name: str) -> str:
    """``name`` with the characters MLflow refuses in a metric name (all but alphanumerics,
    ``_ - . /`` and space; colons only in recent versions) replaced by ``_``; one MLflow
    would read as another path (``a//b``, ``x/..``, ``/x``, ``.x``) flattened behind ``_``."""
    name = re.sub(r"[^\w.\- /]", "_", name)
    if name.startswith(("/", ".")) or posixpath.normpath(name) != name:
        name = "_" + name.replace("/", "_")
    return name


def now_ms() -> int:
    return int(time.time() * 1000)
