"""The errors the training loop raises with a message for the user; their own module, so that the loop's helpers
(modules/trainer/resume.py) raise them without importing the loop."""


class TrainingError(Exception):
    """A failure during training with a message for the user (the CLI exits 1)."""


class BackupWriteError(TrainingError):
    """A backup could not be written (a full or read-only disk); the weights in memory are fine."""

    def __init__(self, failure: str, kept: str):
        super().__init__(f"{failure}; training stopped and {kept}")
        self.failure = failure  # what failed, without what it means for a run that stops
