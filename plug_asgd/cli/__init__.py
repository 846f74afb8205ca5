"""The ``plug-asgd`` command (``plug_asgd.cli.app``, its commands in ``serving``, ``training`` and ``reporting``):
serving the PS, its live status (``status``, ``shard_status``, ``dashboard``), the plots of a run's metrics
(``plot``), and the recipes."""
