"""Operating the service: the ``ibex-context`` CLI, the stack launcher (supervisord and child
processes), and ``explain``. Not imported by the client library."""
