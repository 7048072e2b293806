"""The scheduler machine: vLLM's own V1 Scheduler (or the reference scheduler) plans the steps,
the driver here plays the worker; its progress drain, replay, reproducers and BASE-against-HEAD
lockstep."""
