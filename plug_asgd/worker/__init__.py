"""The worker's side of the protocol: its client and transport to the PS, the notices and collectives that
travel through the PS, the staging of a model to the host and back, the staleness compensation, hogwild's
shared model, and the exchanges (``plug_asgd.worker.exchange``) that trade a worker's model with the PS.
Nothing here knows Lightning: the strategy (``plug_asgd.strategy``) hands the exchanges what they need."""
