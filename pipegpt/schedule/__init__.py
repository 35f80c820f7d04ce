"""Schedules as data: pure Python, no torch (so `pipegpt simulate` starts instantly)."""
from .actions import Action, Kind, Plan, ScheduleError
from .generators import SCHEDULES, build_plan
from .lowering import lower
from .validate import PlanError, validate

__all__ = ["Action", "Kind", "Plan", "PlanError", "ScheduleError", "SCHEDULES", "build_plan", "lower", "validate"]
