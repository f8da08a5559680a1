"""What every bench suite shares, so that two suites' numbers mean the same thing.

* ``cpu``: CPU time of a process (another one, or this one) and of one thread;
* ``percentiles``: the one percentile definition (nearest rank) and HDR histogram summaries by it;
* ``tables``: Markdown tables as the suites print and write them;
* ``stack``: a started ``LocalStack``, a connected client, the event loop runner, the commit;
* ``transport``: the transport-mode worker (replies at once: sockets, broker and client alone).

A suite imports these, never another suite's private names.
"""
