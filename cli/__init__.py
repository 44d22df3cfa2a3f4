"""The ``vckpt`` command line (installed as the package ``verified_ckpt_cli``).

``main`` (the click group and most commands), ``recovery`` (node-health, clear-host, supervise), ``replay``, ``batch``
(S3 Batch Operations), ``command`` (the frame of a command that opens one run), ``options``, ``output``.
"""
