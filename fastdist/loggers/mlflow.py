"""``MLflowLogger``: the run in an MLflow tracking store (e.g. an SQLite database)."""

from __future__ import annotations

import os
from typing import Any

from fastdist.checks import check_optional_str
from fastdist.loggers.backend import Logger, RunContext, Scalar
from fastdist.loggers.mlflow_runs import (
    CONTINUES,
    FROM_STEP,
    check_reachable,
    copy_history,
    find_run,
    last_steps,
    mlflow_name,
    now_ms,
    successor,
    supersede,
)
from fastdist.logging import logger

#: MLflow's limit on a parameter value's length.
MAX_PARAM_CHARS = 6000


class MLflowLogger(Logger):
    """Log the options as the run's parameters and the scalars of ``log.jsonl`` as its
    metrics, at the same steps.

    mlflow is imported when training starts (``pip install fastdist[mlflow]``). Each
    ``train()`` starts a new MLflow run, except a resume, which follows these rules (the run
    id is kept in the checkpoint; a run is continued only when it comes from there):

    * a plain resume (``"auto"`` after a crash, or from the newest checkpoint) continues the
      same run and skips each metric at the steps it already holds that metric at: they are
      trained again exactly as before, so no value is written twice (a metric the run lacks
      at a held step, e.g. the evaluation after a pre-emption on an epoch's last update, is
      written);
    * a rollback (a resume from a checkpoint older than the newest one; the newer ones are
      set aside), or a resume on another number of data shards than the checkpoint's (its
      steps after the checkpoint are not trained again identically, so the killed run's
      values there are not this training's), continues in a *new* run, tagged
      ``fastdist.continues`` (the old run's id) and ``fastdist.continues_from_step`` (the
      resumed step S), which holds the old run's metrics up to S and the new ones after;
      the old run is tagged ``fastdist.superseded_by`` (the new id) and keeps the discarded
      branch, so no run presents the discarded values as the training's (a second, deeper
      rollback tags every run that continued the old one too). A later plain resume from a
      checkpoint at S or after continues the new run;
    * a checkpoint whose run the store does not hold (a resume into another ``save_path``
      without its ``mlflow.db``) starts a new run, tagged as above, with a warning.

    A metric name MLflow refuses (e.g. ``dev/f1@5``) is written with ``_`` for each
    character it refuses (kept unique with a suffix ``_2``...), named in one warning.

    A tracking server (``http(s)://``) must accept a connection within 3 s when training
    starts, else the backend is dropped with one warning. MLflow's HTTP retries and timeouts
    are bounded (``MLFLOW_HTTP_REQUEST_MAX_RETRIES=2``, ``..._TIMEOUT=5``,
    ``..._BACKOFF_FACTOR=1``, unless the environment sets them), so a server that goes away
    mid-run costs rank 0 about 20 s once, after which the backend is dropped with one
    warning; the other ranks never wait on it beyond that.

    Args:
        tracking_uri: where runs are kept, e.g. ``"sqlite:///runs/mlflow.db"`` or a server's
            URL; default ``sqlite:///<save_path>/mlflow.db``, else MLflow's own default.
        experiment: the experiment's name (created if missing).
        run_name: the run's name; default: MLflow picks one.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "fastdist",
        run_name: str | None = None,
    ) -> None:
        example = "'sqlite:///runs/mlflow.db'"
        self.tracking_uri = check_optional_str("MLflowLogger(tracking_uri)", tracking_uri, example)
        if not isinstance(experiment, str) or not experiment:
            raise (ValueError if experiment == "" else TypeError)(
                f"MLflowLogger(experiment) must be a name (a non-empty str), got {experiment!r}: "
                "e.g. 'fastdist'"
            )
        self.experiment = experiment
        self.run_name = check_optional_str("MLflowLogger(run_name)", run_name, "'baseline'")
        self.run_id: str | None = None  # the run being written (kept in checkpoints)
        self.resume_id: str | None = None  # from a checkpoint: the run the next open continues
        self.client: Any = None
        self.held: dict[str, int] = {}  # each metric's last step the run holds (a resume)
        self.names: dict[str, str] = {}  # each metric's name in MLflow (see mlflow_name)
        self.holds_options = False

    def open(self, run: RunContext) -> None:
        try:  # optional dependency, imported only when used
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(f'{exc}: pip install "fastdist[mlflow]" (or mlflow)') from exc

        uri = self.tracking_uri
        if uri is None and run.save_path:
            os.makedirs(run.save_path, exist_ok=True)
            uri = f"sqlite:///{os.path.abspath(os.path.join(run.save_path, 'mlflow.db'))}"
        check_reachable(uri)
        self.client = client = MlflowClient(tracking_uri=uri)
        resumed, self.resume_id = self.resume_id, None
        self.run_id, self.held, self.holds_options = None, {}, False
        old = None if resumed is None else find_run(client, resumed)
        if resumed is not None and old is None:
            logger.warning(
                "MLflowLogger: the checkpoint's run %s is not in the tracking store %s: a new "
                "run continues it from step %d (tagged %s=%s)",
                resumed,
                uri,
                run.step,
                CONTINUES,
                resumed,
            )
        if old is not None and not run.rollback:  # continue it, skipping the steps it holds
            old = successor(client, old, run.step)
            self.run_id = old.info.run_id
            client.update_run(self.run_id, status="RUNNING")
            self.held, self.holds_options = last_steps(client, old), True
            return
        tags = {} if resumed is None else {CONTINUES: resumed, FROM_STEP: str(run.step)}
        self.run_id = self._create(client, tags)
        if old is not None:  # a rollback: the old run's history up to the resumed step
            self.held = copy_history(client, old, self.run_id, run.step)
            supersede(client, old, self.run_id)

    def _create(self, client: Any, tags: dict[str, str]) -> str:
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
        return str(client.create_run(experiment_id, run_name=self.run_name, tags=tags).info.run_id)

    def log_options(self, options: dict[str, Scalar]) -> None:
        if self.holds_options:
            return  # a continued run holds them already
        from mlflow.entities import Param

        params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in options.items()]
        self.client.log_batch(self.run_id, params=params)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now, named = now_ms(), self._named(values)
        metrics = [  # skipped: written before the resumed run was stopped (or copied)
            Metric(name, value, now, step)
            for name, value in named.items()
            if step > self.held.get(name, -1)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def _named(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` under names MLflow accepts, each kept unique; one warning per new
        batch of renamed names."""
        renamed = {}
        for name in values:
            if name not in self.names:
                new, n, taken = mlflow_name(name), 1, set(self.names.values())
                while new in taken or (new != name and new in values):
                    n += 1
                    new = f"{mlflow_name(name)}_{n}"
                self.names[name] = new
                if new != name:
                    renamed[name] = new
        if renamed:
            logger.warning("MLflowLogger: metric names MLflow refuses are renamed: %s", renamed)
        return {self.names[name]: value for name, value in values.items()}

    def close(self, failed: bool) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            self.client = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run_id = state["run_id"]
        if not isinstance(run_id, str):
            raise TypeError(f"the checkpoint's MLflow run id is {run_id!r}, not a str")
        self.resume_id = run_id
