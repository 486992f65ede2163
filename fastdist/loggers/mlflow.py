"""``MLflowLogger``: the run in an MLflow tracking store (e.g. an SQLite database)."""

from __future__ import annotations

import os
import time
from typing import Any

from fastdist.loggers.backend import Logger, RunContext, Scalar

#: MLflow's limit on a parameter value's length.
MAX_PARAM_CHARS = 6000


class MLflowLogger(Logger):
    """Log the options as the run's parameters and the scalars of ``log.jsonl`` as its
    metrics, at the same steps.

    mlflow is imported when training starts (``pip install fastdist[mlflow]``). A resumed
    run continues the same MLflow run (its id is kept in the checkpoint) and skips the steps
    that run already holds, so no step is written twice.

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
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = None
        self.client: Any = None
        self.logged_through = -1  # the last step the run already holds (a resume)

    def open(self, run: RunContext) -> None:
        try:  # optional dependency, imported only when used
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(f'{exc}: pip install "fastdist[mlflow]" (or mlflow)') from exc

        uri = self.tracking_uri
        if uri is None and run.save_path:
            os.makedirs(run.save_path, exist_ok=True)
            uri = f"sqlite:///{os.path.abspath(os.path.join(run.save_path, 'mlflow.db'))}"
        self.client = client = MlflowClient(tracking_uri=uri)
        if self.run_id is not None:  # a resume: continue the checkpoint's run
            client.update_run(self.run_id, status="RUNNING")
            held = client.get_run(self.run_id).data.metrics
            steps = (m.step for key in held for m in client.get_metric_history(self.run_id, key))
            self.logged_through = max(steps, default=-1)
            return
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
        self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self.logged_through = -1

    def log_options(self, options: dict[str, Scalar]) -> None:
        if self.logged_through >= 0:
            return  # a resumed run holds them already
        from mlflow.entities import Param

        params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in options.items()]
        self.client.log_batch(self.run_id, params=params)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        if step <= self.logged_through:
            return  # written before the resumed run was stopped
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            self.client = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state["run_id"]
