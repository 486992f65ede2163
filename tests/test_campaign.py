"""The fault campaign's CI tier (tests/campaign.py has the long one): 10 seeded kills under DDP
and FSDP in one ``torchrun --max-restarts=10`` launch, a full disk, a node lost and a network
cut. Every fault must be survived with nothing lost; the counts table is printed at the end.

``FASTDIST_CAMPAIGN_SEED=N`` replays another seed (a failure names its seed and fault);
``FASTDIST_CAMPAIGN_TABLE=FILE`` writes the counts table (markdown) there too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from campaign import Counts, Table, kill_campaign, markdown
from campaign_faults import NeedsRoot, Outcome, disk_full, network_cut, node_lost

SEED = int(os.environ.get("FASTDIST_CAMPAIGN_SEED", "30"))
KILLS, CONFIGS, EPOCHS = 10, ["ddp", "fsdp"], 2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def table(request: pytest.FixtureRequest) -> Iterator[Table]:
    """The counts of this module's faults, printed (and written) when the module is done."""
    counts: Table = {}
    yield counts
    title = f"CI tier, seed {SEED}: {KILLS} kills over {', '.join(CONFIGS)}, then one of each kind."
    text = markdown(counts, title)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n" + text)
    if os.environ.get("FASTDIST_CAMPAIGN_TABLE"):
        Path(os.environ["FASTDIST_CAMPAIGN_TABLE"]).write_text(text)


def assert_survived(table: Table, kinds: list[str]) -> None:
    for kind in kinds:
        counts = table[kind]
        failures = "\n".join(counts.failures)
        assert counts.survived == counts.tried and not counts.lost, (
            f"seed {SEED}, {kind}: {counts}\n{failures}"
        )


@pytest.mark.timeout(600)
def test_seeded_kills_under_ddp_and_fsdp_resume_exactly(table: Table, tmp_path: Path) -> None:
    """Each kill (a random rank mid-update, in an evaluation, in a checkpoint's write, after
    its rename, in predict's spill) resumes from the step it left, trains the straight run's
    samples with its losses, and ends with its parameters and predictions, bit for bit."""
    kill_campaign(tmp_path, SEED, KILLS, CONFIGS, EPOCHS, table)
    kinds = [kind for kind in table if kind.startswith("kill: ")]
    assert sum(table[kind].tried for kind in kinds) == KILLS
    assert_survived(table, kinds)


@pytest.fixture(scope="module")
def waiting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Outcome]]]:
    """The node loss and the network cut, started together: each mostly waits (for a
    rendezvous, a timeout, a slowed worker), so side by side they take the time of one."""
    faults = {"node lost": node_lost, "network cut": network_cut}
    with ThreadPoolExecutor(len(faults)) as pool:
        yield {
            kind: pool.submit(fault, SEED, tmp_path_factory.mktemp(kind.replace(" ", "_")))
            for kind, fault in faults.items()
        }


def _other(table: Table, kind: str, fault: Callable[[], Outcome]) -> None:
    try:
        problems, lost = fault()
    except NeedsRoot as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root, yet: {exc}")
        pytest.skip(f"needs root here: {exc}")
    table.setdefault(kind, Counts()).add(problems, lost, f"{kind} (seed {SEED})")
    assert_survived(table, [kind])


@pytest.mark.timeout(300)
def test_a_full_disk_keeps_the_newest_intact_checkpoint(table: Table, tmp_path: Path) -> None:
    _other(table, "disk full", lambda: disk_full(SEED, tmp_path))


@pytest.mark.timeout(300)
def test_a_node_lost_shrinks_and_grows_the_job(
    table: Table, waiting: dict[str, Future[Outcome]]
) -> None:
    _other(table, "node lost", waiting["node lost"].result)


@pytest.mark.timeout(300)
def test_a_network_cut_names_the_unreachable_rank_and_resumes(
    table: Table, waiting: dict[str, Future[Outcome]]
) -> None:
    _other(table, "network cut", waiting["network cut"].result)
