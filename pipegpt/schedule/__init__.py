"""Schedules as data: pure Python, no torch (so `pipegpt simulate` starts instantly)."""
from .actions import Action, Kind, Plan, PlanError, ScheduleError
from .lowering import lower
from .registry import SCHEDULES, ScheduleSpec, build_plan, schedule_spec
from .validate import validate

__all__ = ["Action", "Kind", "Plan", "PlanError", "ScheduleError", "SCHEDULES", "ScheduleSpec", "build_plan",
           "lower", "schedule_spec", "validate"]
