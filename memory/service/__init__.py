"""The memory service's HTTP process: routes, request parsing, state and bounded answers, quotas,
deadlines, the query batcher."""
