"""The ``vckpt`` command line (installed as the package ``verified_ckpt_cli``)."""
