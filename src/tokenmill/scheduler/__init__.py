"""Token-based continuous-batching scheduler."""

from tokenmill.scheduler.output import ScheduledSeq, SchedulerOutput, SeqColumns, StepTokens
from tokenmill.scheduler.scheduler import Progress, Scheduler, SchedulerConfig

__all__ = [
    "Progress",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SeqColumns",
    "StepTokens",
]
