"""Both Lightning namespaces, ``pytorch_lightning`` and ``lightning``, behind one strategy and one set of
callbacks: the classes bound to the namespace a program imported (``namespaces``) and the parts of DDP's
strategy that the parameter-server strategy keeps (``plumbing``)."""
