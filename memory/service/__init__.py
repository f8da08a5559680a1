"""The memory service's HTTP process: routes, request parsing, state and bounded answers, a search and
its legs, deadlines, the query batcher; the seed tool."""
