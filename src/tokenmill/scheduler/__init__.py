"""Token-based continuous-batching scheduler."""

from tokenmill.scheduler.output import ScheduledSeq, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
