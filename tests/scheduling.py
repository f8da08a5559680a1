"""How ``make pytest`` spreads the suite over its two xdist workers (``-n 2 --dist loadfile``).

A file's tests stay on one worker: they share module fixtures (a stack, a cluster). Each file is
a group of its own, but files that share an expensive session fixture or helper process share
one group, so one worker builds it instead of both:

    litellm   the LiteLLM fork parent (``bench.litellm_fork``: ~9 s of CPU importing LiteLLM)
    cluster   ``redis_cluster`` and ``cluster_memory`` (six redis-servers and a memory service)
    minilm    ``numpy_emb`` (minilm's numpy reference pass)

The groups are xdist's work units through ``GroupScheduling``, the scheduler this plugin gives
xdist for ``--dist loadfile`` (xdist's own ``loadgroup`` reads groups from a suffix it writes into
node ids, which pytest 9 no longer takes: every test became a unit of its own, and a module's
fixtures were built on both workers: https://github.com/pytest-dev/pytest-xdist/issues/1386).
xdist hands units out in the order collected, one at a time as a worker runs short of work, so
groups are ordered longest first (``SECONDS``; ``--no-loadscope-reorder`` keeps that order): the
short unit files fill the end of the run instead of one long stack file running alone while the
other worker idles. Tests inside a file keep their order; on one process (``make unit``) only the
order changes.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

# Files sharing a group with others (paths from the repository root); every other file is its own.
SHARED_GROUPS = {
    "litellm": [
        "tests/stack/test_litellm_auth.py", "tests/stack/test_litellm_call_id.py",
        "tests/stack/test_litellm_degraded.py", "tests/stack/test_litellm_large.py",
        "tests/stack/test_litellm_proxy.py", "tests/stack/test_litellm_quickstart.py",
        "tests/stack/test_litellm_routes.py", "tests/stack/test_litellm_sdks.py",
        "tests/stack/test_summaries_e2e.py", "tests/stack/test_wire_proxy.py",
    ],
    "cluster": [
        "tests/stack/test_cluster_calibration.py", "tests/stack/test_cluster_directives.py",
        "tests/stack/test_cluster_layout.py", "tests/stack/test_cluster_memory_service.py",
        "tests/stack/test_cluster_retrieval.py", "tests/stack/test_cluster_summaries.py",
        "tests/stack/test_cluster_summary_op.py", "tests/stack/test_rerank.py",
    ],
    "minilm": ["tests/stack/test_minilm_graph.py", "tests/stack/test_minilm_openvino.py"],
}
GROUP_OF = {path: group for group, paths in SHARED_GROUPS.items() for path in paths}

# Seconds a file takes on the 2-core CI machine under ``make pytest`` (setup, calls and teardown),
# for the files over ~5 s; a file not listed counts as DEFAULT_SECONDS. Only the order they give
# matters: a stale figure makes the run slower, never different.
SECONDS: dict[str, float] = {
    "tests/stack/test_minilm_graph.py": 67, "tests/stack/test_cluster_add_shard.py": 43,
    "tests/stack/test_bench_tenants.py": 43, "tests/stack/test_rerank.py": 40,
    "tests/stack/test_minilm_openvino.py": 37, "tests/stack/test_cluster_failover.py": 34,
    "tests/meta/test_packaging.py": 29, "tests/stack/test_roles.py": 29, "tests/stack/test_bench_run.py": 28,
    "tests/unit/test_history.py": 27, "tests/stack/test_cluster_memory_service.py": 26,
    "tests/unit/test_summary_plan.py": 25, "tests/stack/test_add_workers_host.py": 23,
    "tests/unit/test_chat_assembly.py": 22, "tests/stack/test_client_library.py": 22, "tests/stack/test_cli.py": 22,
    "tests/stack/test_summaries_e2e.py": 21, "tests/stack/test_cluster_summaries.py": 21,
    "tests/stack/test_summary_store.py": 21, "tests/stack/test_secret_guard.py": 20,
    "tests/stack/test_litellm_quickstart.py": 19, "tests/stack/test_storage_budgets.py": 18,
    "tests/stack/test_memory_service.py": 16, "tests/stack/test_admission_rate.py": 16,
    "tests/stack/test_embedders.py": 15, "tests/stack/test_fuzz.py": 15, "tests/stack/test_faults.py": 14,
    "tests/stack/test_endpoint_guard.py": 14, "tests/stack/test_cluster_calibration.py": 13,
    "tests/stack/test_litellm_auth.py": 13, "tests/stack/test_broker_fair_share.py": 13,
    "tests/stack/test_litellm_hook.py": 11, "tests/stack/test_usage_admission.py": 10, "tests/stack/test_auth.py": 10,
    "tests/unit/test_summary_slot.py": 9, "tests/stack/test_correlation.py": 9, "tests/stack/test_calibration.py": 9,
    "tests/stack/test_litellm_routes.py": 8, "tests/stack/test_write_neighbours.py": 8,
    "tests/stack/test_client_first_use.py": 8, "tests/stack/test_litellm_proxy.py": 8,
    "tests/stack/test_directives.py": 8, "tests/meta/test_module_identity.py": 8,
    "tests/unit/test_estimate_bound.py": 7, "tests/stack/test_litellm_degraded.py": 7,
    "tests/stack/test_org_fairness.py": 7, "tests/stack/test_calibration_poisoning.py": 7,
    "tests/stack/test_main_job.py": 7, "tests/stack/test_remote_embedder.py": 7,
    "tests/unit/test_context_editing_vs_drop.py": 7, "tests/stack/test_cluster_retrieval.py": 6,
    "tests/stack/test_directive_under_load.py": 6, "tests/stack/test_litellm_sdks.py": 6,
    "tests/stack/test_retrieval.py": 6, "tests/stack/test_memory_admission.py": 6,
    "tests/stack/test_tenant_isolation.py": 6, "tests/stack/test_cluster_directives.py": 6,
    "tests/stack/test_memory_limits.py": 6, "tests/stack/test_limits.py": 6, "tests/stack/test_wire_proxy.py": 6,
    "tests/stack/test_litellm_call_id.py": 5, "tests/unit/test_format.py": 5, "tests/stack/test_assemble_output.py": 5,
    "tests/stack/test_admission.py": 5,
}
DEFAULT_SECONDS = 1.0


def _path(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def group_of(path: str) -> str:
    return GROUP_OF.get(path, path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    weight: dict[str, float] = {}
    for path in dict.fromkeys(_path(item) for item in items):
        group = group_of(path)
        weight[group] = weight.get(group, 0.0) + SECONDS.get(path, DEFAULT_SECONDS)
    collected = {group: i for i, group in enumerate(dict.fromkeys(group_of(_path(item)) for item in items))}
    items.sort(key=lambda item: (-weight[group_of(_path(item))], collected[group_of(_path(item))]))


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a test's group (``group_of`` its file) as its scope."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid.split("::", 1)[0])


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return GroupScheduling(config, log)  # type: ignore[arg-type]
