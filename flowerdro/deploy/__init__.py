"""Deployment helpers: what cuts the per-message cost of a real SuperLink/SuperNode deployment.

* :mod:`flowerdro.deploy.grid` — replies pulled within 0.05 s of arriving (backing off to 1 s while none come) instead of every 3 s.
* :mod:`flowerdro.deploy.worker` — a node-local worker process that keeps torch, the data
  and the model loaded across messages (node config ``worker=1``).
* :mod:`flowerdro.deploy.supernode` — ``flower-supernode`` with a shorter idle poll
  (and, with ``--fork-clientapp``, the SuperExec below).
* :mod:`flowerdro.deploy.superexec` — ``flower-superexec`` that runs each ``flwr-clientapp``
  task in a fork of itself, flwr already imported.

docs/performance.md ("Deployment: per-message cost and the operator settings") says what
an operator sets and what each one saves.
"""
