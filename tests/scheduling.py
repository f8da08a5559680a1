"""How ``make pytest`` spreads the suite over its two xdist workers (``-n 2 --dist loadgroup``).

A file's tests stay on one worker: they share module fixtures (a stack, a cluster). Each file is
an xdist group of its own, but files that share an expensive session fixture or helper process
share one group, so one worker builds it instead of both:

    litellm   the LiteLLM fork parent (``bench.litellm_fork``: ~9 s of CPU importing LiteLLM)
    cluster   ``redis_cluster`` and ``cluster_memory`` (six redis-servers and a memory service)
    minilm    ``numpy_emb`` (minilm's numpy reference pass)

xdist hands groups out in the order collected, one at a time as a worker runs short of work, so
groups are ordered longest first (``SECONDS``): the short unit files fill the end of the run
instead of one long stack file running alone while the other worker idles. Tests inside a file
keep their order; without ``--dist loadgroup`` (one process, ``make unit``) only the order changes.
"""

from __future__ import annotations

import pytest

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
SECONDS: dict[str, float] = {}
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
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(_path(item))))
