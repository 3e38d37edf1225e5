"""Typed worker failures. The Rust engine maps them by class: an out-of-memory or invalid plan fails only the
step's requests and the engine goes on; anything else is fatal."""


class WorkerError(Exception):
    """Base of the errors the worker raises on purpose."""


class WorkerOutOfMemory(WorkerError):
    """A step ran out of device memory; memory was released and the engine can go on."""


class InvalidPlan(WorkerError):
    """The plan broke the step contract (bad slot, bad row, shapes that do not add up)."""


class WorkerFatal(WorkerError):
    """The worker cannot go on (lost device, corrupted state)."""


class UnsupportedModel(WorkerError):
    """The checkpoint or a requested feature is not supported (raised at load, never during a step)."""


class StartupRefused(Exception):
    """Start-up cannot go on for a reason the user fixes (too little host memory for the load): ``ft serve`` says
    it in one line and exits 1, before anything large is allocated."""
